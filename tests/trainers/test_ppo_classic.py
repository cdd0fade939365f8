"""PPO as the classic TRL docs wrote it: PPOConfig's classic names, `PPOTrainer(config=, model=, ref_model=model,
tokenizer=, dataset=)`, text queries through `generate(..., max_length=)` and `step(responses, rewards, queries)`,
the adaptive KL controller (and its checkpointed coefficient), and a classic value-head model as the policy."""

import math

import pytest
import torch
from tests.helpers.online import online_args

from posttrain import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from posttrain.models.loading import load_causal_lm, load_tokenizer

MODEL = "posttrain/tiny-qwen2"


def instructions(n: int = 8) -> list[dict]:
    return [{"instruction": f"reverse {i} {i + 1} {i + 2}", "output": "ignored"} for i in range(n)]


def test_classic_doc_loop_runs_as_written(tmp_path):
    model, tokenizer = load_causal_lm(MODEL), load_tokenizer(None, model=MODEL)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    ppo_config = PPOConfig(learning_rate=1.41e-5, batch_size=4, mini_batch_size=2, num_rollouts=1000,
                           kl_penalty="kl", init_kl_coef=0.2, adap_kl_ctrl=True, ppo_epochs=1,
                           output_dir=str(tmp_path), report_to="none")
    ppo_trainer = PPOTrainer(config=ppo_config, model=model, ref_model=model, tokenizer=tokenizer,
                             dataset=instructions())
    # ref_model=model: a frozen copy, never the policy itself frozen
    assert ppo_trainer.ref_model is not model and all(p.requires_grad for p in model.parameters())
    batches = 0
    for batch in ppo_trainer.dataloader:
        assert len(batch["instruction"]) == 4
        responses = ppo_trainer.generate(batch["instruction"], max_length=12)
        assert all(isinstance(r, str) for r in responses) and len(responses) == 4
        for query, response in zip(batch["instruction"], responses):  # max_length counts prompt + response
            assert len(tokenizer(query)["input_ids"]) + len(tokenizer(response, add_special_tokens=False)
                                                             ["input_ids"]) <= 12 + 2  # re-tokenising may merge
        rewards = [float(len(r) % 4) for r in responses]
        stats = ppo_trainer.step(responses, rewards, batch["instruction"])
        ppo_trainer.log(stats)
        batches += 1
    assert batches == 2
    for name in ("loss/policy_avg", "loss/value_avg", "objective/kl", "objective/kl_coef", "lr"):
        assert math.isfinite(stats[name]), name
    assert ppo_trainer.state.global_step == 2 * 2  # batches x mini-batches (1 PPO epoch)
    assert all(not torch.equal(p, initial[n]) for n, p in model.named_parameters())  # the user's model trained
    ref = dict(ppo_trainer.ref_model.named_parameters())
    assert all(torch.equal(ref[n], initial[n]) for n in initial)  # the reference did not move
    # the KL (~0) is below target=6: the coefficient shrinks after each batch; the second batch used the first update
    assert ppo_trainer.kl_ctl.value < ppo_trainer.args.beta < 0.2


def test_classic_config_names_map_onto_the_engine(tmp_path):
    args = PPOConfig(output_dir=str(tmp_path), batch_size=8, mini_batch_size=2, gradient_accumulation_steps=2,
                     num_rollouts=64, init_kl_coef=0.3, ppo_epochs=2)
    assert (args.per_device_train_batch_size, args.num_mini_batches, args.steps_per_generation) == (2, 2, 4)
    assert args.per_process_generation == 8 and args.total_episodes == 64
    assert args.kl_coef == args.beta == 0.3 and args.num_iterations == 2 and not args.adap_kl_ctrl
    for classic, estimator in (("kl", "k1"), ("abs", "abs"), ("mse", "k2")):
        assert PPOConfig(output_dir=str(tmp_path), kl_penalty=classic).kl_estimator == estimator
    with pytest.raises(ValueError, match="kl_penalty='full'.*sampled tokens only"):
        PPOConfig(output_dir=str(tmp_path), kl_penalty="full")
    with pytest.raises(ValueError, match="batch_size=6 must be a multiple of mini_batch_size"):
        PPOConfig(output_dir=str(tmp_path), batch_size=6, mini_batch_size=4)
    with pytest.raises(ValueError, match="adap_kl_ctrl needs init_kl_coef"):
        PPOConfig(output_dir=str(tmp_path), adap_kl_ctrl=True, init_kl_coef=0.0)


def test_step_tells_the_argument_order_by_type(tmp_path):
    args = PPOConfig(**online_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                                   num_ppo_epochs=1))
    trainer = PPOTrainer(args=args, model=MODEL, train_dataset=instructions())
    queries = ["reverse 1 2", "reverse 3 4"]
    single = trainer.generate(queries[0], max_new_tokens=3)
    assert isinstance(single, str)
    responses = trainer.generate(queries, max_new_tokens=3)
    # the later classic order (queries, responses, scores) with tensor scores, then the classic docs' order
    trainer.step(queries, responses, [torch.tensor(1.0), torch.tensor(0.0)])
    sampled = trainer.generate(queries, max_new_tokens=3, return_prompt=False)
    ids = [trainer._sampled[text].tolist() for text in sampled]
    seen = []
    rollout_from = trainer._rollout_from
    trainer._rollout_from = lambda p, r: seen.append(r) or rollout_from(p, r)
    trainer.step(sampled, [1.0, 0.0], queries)
    assert seen == [ids]  # texts from generate() are trained on as the tokens sampled, not re-tokenised
    assert trainer.state.global_step == 2
    with pytest.raises(ValueError, match="none of its arguments is a list of numbers"):
        trainer.step(queries, responses, queries)


def test_adaptive_kl_coefficient_is_checkpointed(tmp_path):
    def make():
        args = PPOConfig(**online_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                                       num_ppo_epochs=1, init_kl_coef=0.2, adap_kl_ctrl=True, target=0.01,
                                       horizon=10))
        return PPOTrainer(args=args, model=MODEL, train_dataset=instructions())

    trainer = make()
    queries = ["reverse 1 2", "reverse 3 4"]
    trainer.step(queries, trainer.generate(queries, max_new_tokens=4), [1.0, 0.0])
    trainer.step(queries, trainer.generate(queries, max_new_tokens=4), [1.0, 0.0])
    moved = trainer.kl_ctl.value
    assert moved != 0.2  # |KL| after a step is far from target=0.01: the coefficient moves
    trainer.save_checkpoint_extras(str(tmp_path / "ckpt"))
    again = make()
    assert again.kl_ctl.value == 0.2
    again.load_checkpoint_extras(str(tmp_path / "ckpt"))
    assert again.kl_ctl.value == moved


def test_classic_value_head_model_is_the_policy_and_critic(tmp_path):
    vh = AutoModelForCausalLMWithValueHead.from_pretrained(MODEL)
    head_before = vh.v_head.summary.weight.detach().clone()
    body_before = {n: p.detach().clone() for n, p in vh.pretrained_model.named_parameters()}
    args = PPOConfig(**online_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                                   num_ppo_epochs=1))
    trainer = PPOTrainer(args=args, model=vh, ref_model=vh, train_dataset=instructions())
    assert trainer.model.v_head is vh.v_head and trainer.policy is vh.pretrained_model
    assert trainer.ref_model is not vh.pretrained_model
    queries = ["reverse 1 2", "reverse 3 4"]
    trainer.step(queries, trainer.generate(queries, max_new_tokens=4), [2.0, -1.0])
    assert not torch.equal(vh.v_head.summary.weight, head_before)
    assert all(not torch.equal(p, body_before[n]) for n, p in vh.pretrained_model.named_parameters())


def test_adaptive_kl_run_resumes_identically(tmp_path):
    from tests.helpers.online import first_token_reward, prompts
    from tests.helpers.resume import assert_resumes_identically

    # one optimizer step per batch; target and horizon small, so the coefficient moves a lot after every batch
    def make(**fields):
        args = PPOConfig(**{**online_args(fields["output_dir"], gradient_accumulation_steps=1, num_ppo_epochs=1,
                                          init_kl_coef=0.2, adap_kl_ctrl=True, target=0.01, horizon=10), **fields})
        return PPOTrainer(args=args, model=MODEL, reward_funcs=first_token_reward, train_dataset=prompts(12))

    resumed = assert_resumes_identically(make, tmp_path, max_steps=3, stop_at=1)
    coefs = [e["objective/kl_coef"] for e in resumed.state.log_history if "objective/kl_coef" in e]
    assert len(set(coefs)) == len(coefs) >= 2  # it moved between the logged steps
