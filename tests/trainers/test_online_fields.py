"""The GRPO/RLOO fields and behaviours TRL 1.16 users rely on: config fields, loss types, generation
fields, evaluate() on raw datasets and dicts, pad ids the model cannot embed, reward-function keywords."""

import pytest
import torch
from tests.helpers.online import first_token_reward, online_args, prompts, train_and_check

from posttrain.core.shaping import normalize_then_sum
from posttrain.rollout.generate import SamplingConfig, generate
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

TINY = "posttrain/tiny-qwen2"


def test_loss_type_names_the_policy_loss_too(tmp_path):
    for loss_type in ("cispo", "sapo", "luspo"):
        args = GRPOConfig(output_dir=str(tmp_path), loss_type=loss_type)
        assert args.policy_loss == loss_type
    assert GRPOConfig(output_dir=str(tmp_path), loss_type="dapo").policy_loss == "clipped"  # unchanged
    with pytest.raises(ValueError, match="loss_type='cispo' uses policy_loss='cispo'"):
        GRPOConfig(output_dir=str(tmp_path), loss_type="cispo", policy_loss="reinforce")


def test_config_refusals_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="vLLM is not installed"):  # this machine has no vLLM
        GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate")
    with pytest.raises(ValueError, match=r"generation_kwargs \['num_beams'\]"):
        GRPOConfig(output_dir=str(tmp_path), generation_kwargs={"top_k": 5, "num_beams": 2})
    with pytest.raises(ValueError, match="multi_objective_aggregation"):
        GRPOConfig(output_dir=str(tmp_path), multi_objective_aggregation="mean")
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        GRPOConfig(output_dir=str(tmp_path), top_entropy_quantile=0.0)
    with pytest.raises(ValueError, match="delta"):
        GRPOConfig(output_dir=str(tmp_path), delta=1.1)
    # accepted as TRL users set them (vllm_* are read only with use_vllm)
    GRPOConfig(output_dir=str(tmp_path), vllm_mode="server", vllm_server_port=8001, vllm_gpu_memory_utilization=0.5)


def test_rloo_normalize_advantages_is_an_alias(tmp_path):
    assert RLOOConfig(output_dir=str(tmp_path), normalize_advantages=True).normalize_advantage is True
    assert RLOOConfig(output_dir=str(tmp_path)).normalize_advantage is False


def test_steps_per_generation_not_a_multiple_of_accumulation_trains(tmp_path):
    """TRL accepts 3 micro-batches per generation with 2 per optimizer step; so do we, and the step that
    straddles two generation batches weighs each part by its share."""
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, steps_per_generation=3, max_steps=3,
                                    loss_type="luspo"))
    trainer = GRPOTrainer(TINY, first_token_reward, args=args, train_dataset=prompts())
    assert not trainer.old_is_current and trainer.loss_mode == "seq_mean_token_sum"
    micro = trainer.build_experience(trainer.sample_completions([[5, 6, 7]] * 3), torch.arange(12.0))
    # 3 micro-batches: a full step of 2, then 1 that shares its step: its token count is doubled
    assert len(micro) == 3
    tokens = [float(mb["loss_mask"].sum()) for mb in micro]
    assert float(micro[0]["token_denominator"]) == pytest.approx(tokens[0] + tokens[1])
    assert float(micro[2]["token_denominator"]) == pytest.approx(2 * tokens[2])
    train_and_check(trainer, metrics=["loss/policy_avg", "reward"])
    assert trainer.state.global_step == 3


def test_trl_loss_fields_train(tmp_path):
    """sapo with the entropy bonus, top-entropy tokens, delta, bias-corrected KL, off-policy masking,
    normalize_then_sum over two rewards, fp32 head, generation fields: every parameter moves, metrics finite."""
    seen = {}

    def length_reward(completions, trainer_state, log_metric, log_extra, **kwargs):
        seen["step"] = trainer_state.global_step
        log_metric("custom/length", sum(map(len, completions)) / len(completions))
        log_extra("length", [len(c) for c in completions])
        return [float(len(c)) for c in completions]

    args = GRPOConfig(**online_args(
        tmp_path, num_generations=4, loss_type="sapo", entropy_coef=0.01, top_entropy_quantile=0.5,
        delta=2.0, beta=0.1, use_bias_correction_kl=True, off_policy_mask_threshold=0.5, num_iterations=2,
        multi_objective_aggregation="normalize_then_sum", reward_weights=[1.0, 0.5], cast_lm_head_to_fp32=True,
        repetition_penalty=1.3, generation_kwargs={"top_k": 20, "temperature": 0.9}, pad_to_multiple_of=4))
    trainer = GRPOTrainer(TINY, [first_token_reward, length_reward], args=args, train_dataset=prompts())
    assert trainer.sampling.top_k == 20 and trainer.sampling.temperature == 0.9
    assert trainer.sampling.repetition_penalty == 1.3
    assert trainer.policy.get_output_embeddings().weight.dtype == torch.float32
    logged = train_and_check(trainer, metrics=["loss/policy_avg", "policy_loss", "objective/kl", "custom/length"],
                             reward_names=("first_token_reward", "length_reward"))
    assert "step" in seen and all(v >= 0 for v in logged["custom/length"])


def test_normalize_then_sum_by_hand():
    # one group of 2: reward 1 values (1, 3) -> (-1/√2, 1/√2) (std of 2 values, Bessel: √2); reward 2 (5, 5) -> 0
    per_function = torch.tensor([[1.0, 5.0], [3.0, 5.0]])
    total = normalize_then_sum(per_function, torch.tensor([1.0, 2.0]), group_size=2)
    z = 1 / (2 ** 0.5 + 1e-4)
    assert total.tolist() == pytest.approx([-z, z])
    # two groups of 2, a weight of 2 on the second reward, an abstention (NaN) counting 0
    per_function = torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, float("nan")], [4.0, 7.0]])
    total = normalize_then_sum(per_function, torch.tensor([1.0, 2.0]), group_size=2)
    assert total.tolist() == pytest.approx([-z - 2 * z, z + 2 * z, 0.0, 0.0])


def test_evaluate_raw_dataset_and_dict_with_eval_loss(tmp_path):
    args = RLOOConfig(**online_args(tmp_path, num_generations=2, per_device_eval_batch_size=2,
                                    num_generations_eval=2))
    trainer = RLOOTrainer(model=TINY, reward_funcs=first_token_reward, args=args, train_dataset=prompts(8))
    rows = [{"prompt": p} for p in prompts(4)["prompt"]]
    metrics = trainer.evaluate(eval_dataset=rows)  # a plain list of dicts
    assert {"eval_loss", "eval_reward"} <= set(metrics)
    several = trainer.evaluate(eval_dataset={"a": rows[:2], "b": prompts(2)})
    assert {"eval_a_loss", "eval_a_reward", "eval_b_loss", "eval_b_reward"} <= set(several)
    assert all(torch.isfinite(torch.tensor(v)) for v in several.values())


def test_trainer_exposes_trl_attributes(tmp_path):
    args = GRPOConfig(**online_args(tmp_path, num_generations=4))
    trainer = GRPOTrainer(TINY, first_token_reward, args=args, train_dataset=prompts())
    assert isinstance(trainer.get_train_dataloader(), torch.utils.data.DataLoader)
    assert trainer.reward_processing_classes is None


def test_pad_id_past_the_embeddings_is_never_embedded():
    """A tokenizer's added [PAD] beyond the model's embedding rows: the sampler pads with EOS instead and
    the masks still mark the padding (TRL users hit IndexError here)."""
    from posttrain.models import loading

    model = loading.load_causal_lm(TINY)
    vocab = model.get_input_embeddings().num_embeddings
    eos = 2
    out = generate(model, [[5, 6, 7], [8]], SamplingConfig(max_new_tokens=4, num_generations=2),
                   pad_token_id=vocab + 3, eos_token_id=eos, generator=torch.Generator().manual_seed(0))
    assert out.prompt_mask[2:].tolist() == [[0, 0, 1]] * 2  # the short prompt's padding is still masked
    assert int(out.prompt_ids.max()) < vocab and int(out.completion_ids.max()) < vocab
    assert out.prompt_ids[2, 0] == eos


def test_repetition_penalty_stops_greedy_repeats():
    from posttrain.models import loading

    model = loading.load_causal_lm(TINY)
    prompt = [[5, 6, 7]]
    plain = generate(model, prompt, SamplingConfig(max_new_tokens=12, do_sample=False), pad_token_id=0,
                     eos_token_id=None)
    penalised = generate(model, prompt, SamplingConfig(max_new_tokens=12, do_sample=False, repetition_penalty=1e6),
                         pad_token_id=0, eos_token_id=None)
    tokens = penalised.completion_ids[0].tolist()
    assert len(set(tokens)) == len(tokens) and not set(tokens) & {5, 6, 7}  # nothing seen is chosen again
    assert plain.completion_ids[0].tolist() != tokens
    # the log-probs stay the policy's own (unpenalised), as the training forward computes them
    assert torch.all(penalised.logprobs <= 0)


def test_chat_template_kwargs_reach_the_template(tmp_path):
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, chat_template_kwargs={"greeting": "zebra"}))
    trainer = GRPOTrainer(TINY, first_token_reward, args=args, train_dataset=prompts())
    trainer.processing_class.chat_template = ("{{ greeting | default('none') }}:{% for m in messages %}"
                                              "{{ m['content'] }}{% endfor %}")
    batch = trainer._collate([{"prompt": [{"role": "user", "content": "hi"}]}])
    assert trainer.processing_class.decode(batch["prompt_ids"][0]).startswith("zebra:")


def test_generation_fields_from_the_command_line():
    from posttrain.cli import parse

    _, config = parse("grpo", ["--model_name_or_path", TINY, "--dataset_name", "x", "--output_dir", "out",
                               "--reward_funcs", "digit_match", "--generation_kwargs", '{"top_k": 5}',
                               "--chat_template_kwargs", '{"enable_thinking": false}', "--repetition_penalty", "1.2",
                               "--loss_type", "cispo", "--per_device_train_batch_size", "4", "--num_generations", "4"])
    assert config.generation_kwargs == {"top_k": 5} and config.chat_template_kwargs == {"enable_thinking": False}
    assert config.repetition_penalty == 1.2 and config.policy_loss == "cispo"


def test_log_extra_columns_join_the_completions_table(tmp_path):
    """A reward function's `log_extra(column, values)` adds one value per completion to the completions table
    (the file under output_dir), next to the prompt, the completion and the rewards; a wrong count is refused."""
    import json

    def length_reward(completions, log_extra, **kwargs):
        log_extra("length", [len(c) for c in completions])
        log_extra("parity", ["even" if len(c) % 2 == 0 else "odd" for c in completions])
        return [float(len(c)) for c in completions]

    args = GRPOConfig(**online_args(tmp_path, num_generations=4, max_steps=1, log_completions=True))
    GRPOTrainer(TINY, length_reward, args=args, train_dataset=prompts()).train()
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert rows and all(row["length"] == len(row["completion"]) == row["length_reward"] for row in rows)
    assert all(row["parity"] == ("even" if row["length"] % 2 == 0 else "odd") for row in rows)

    def short_reward(completions, log_extra, **kwargs):
        log_extra("one", [1])
        return [0.0] * len(completions)

    trainer = GRPOTrainer(TINY, short_reward, args=GRPOConfig(**online_args(tmp_path / "b", num_generations=4,
                                                                           max_steps=1, log_completions=True)),
                          train_dataset=prompts())
    with pytest.raises(ValueError, match="log_extra\\('one', values\\): 1 values for 8 completions"):
        trainer.train()


def test_a_missing_train_dataset_is_refused_without_environments(tmp_path):
    for trainer_class, config_class in ((GRPOTrainer, GRPOConfig), (RLOOTrainer, RLOOConfig)):
        with pytest.raises(ValueError, match="train_dataset is required"):
            trainer_class(TINY, first_token_reward, args=config_class(**online_args(tmp_path)))
