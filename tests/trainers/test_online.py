"""The online engine: on-policy ratio and gradient, skipped passes, split invariance, options."""

import pytest
import torch
from tests.helpers.online import batch_loss_and_grads, first_token_reward, online_args, prompts

from posttrain.forward.logprobs import token_logprobs
from posttrain.trainers import online, online_sampling
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.online import OnlineConfig, OnlineTrainer
from posttrain.trainers.online_config import resolve_aliases


def grpo(tmp_path, model="posttrain/tiny-qwen2", **overrides):
    args = GRPOConfig(**online_args(tmp_path, **{"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                                                  "num_generations": 4, **overrides}))
    return GRPOTrainer(model, first_token_reward, args=args, train_dataset=prompts())


def first_batch(trainer):
    inputs = next(iter(trainer.get_train_dataloader()))
    return inputs, trainer.make_experience(inputs)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_on_policy_ratio_is_one_and_gradient_is_reinforce(tmp_path):
    trainer = grpo(tmp_path)
    _, micro = first_batch(trainer)
    assert len(micro) == 1 and micro[0]["old_is_current"]
    mb = micro[0]
    model = trainer.model
    model.zero_grad()
    trainer.compute_loss(model, mb).backward()
    engine = grads(model)
    assert trainer.recorded_metrics()["val/ratio"][-1] == 1.0
    assert trainer.recorded_metrics()["val/ratio_var"][-1] == 0.0
    # plain REINFORCE with a token-mean ("dapo") normaliser: -sum(A * log pi) / #tokens
    model.zero_grad()
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
    attention = torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1)
    logp, _, _ = token_logprobs(model, ids, attention, num_scored=mb["completion_ids"].shape[1])
    mask = mb["loss_mask"].bool()
    (-(mb["advantages"] * logp)[mask].sum() / mask.sum()).backward()
    reference = grads(model)
    assert engine.keys() == reference.keys()
    for name in engine:
        torch.testing.assert_close(engine[name], reference[name], rtol=1e-5, atol=1e-7, msg=name)


def test_no_reference_model_when_beta_is_zero(tmp_path, monkeypatch):
    def no_copy(model):
        raise AssertionError("a reference copy was made although beta == 0")

    monkeypatch.setattr(online.loading, "frozen_copy", no_copy)
    trainer = grpo(tmp_path, beta=0.0)
    assert trainer.ref_model is None
    _, micro = first_batch(trainer)
    assert "ref_logp" not in micro[0]


def test_peft_reference_is_the_adapter_disabled_policy(tmp_path):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    args = GRPOConfig(**online_args(tmp_path, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                                    num_generations=4, beta=0.1))
    trainer = GRPOTrainer("posttrain/tiny-qwen2", first_token_reward, args=args, train_dataset=prompts(),
                          peft_config=config)
    assert trainer.ref_model is None  # no second copy of the weights
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # make the adapter matter
    _, micro = first_batch(trainer)
    mb = micro[0]
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
    attention = torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1)
    C = mb["completion_ids"].shape[1]
    with torch.no_grad():
        with trainer.model.disable_adapter():
            base, _, _ = token_logprobs(trainer.model, ids, attention, num_scored=C)
        adapted, _, _ = token_logprobs(trainer.model, ids, attention, num_scored=C)
    mask = mb["loss_mask"].bool()
    torch.testing.assert_close(mb["ref_logp"][mask], base[mask], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(adapted[mask], base[mask], atol=1e-3)


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_no_old_logprob_pass(tmp_path, monkeypatch, num_iterations):
    """Old log-probs are the sampler's (or = current): the policy runs once per micro-batch, never more."""
    generating = {"on": False}
    real_generate = online_sampling.generate

    def tracked_generate(*args, **kwargs):
        generating["on"] = True
        try:
            return real_generate(*args, **kwargs)
        finally:
            generating["on"] = False

    monkeypatch.setattr(online_sampling, "generate", tracked_generate)
    trainer = grpo(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
                   num_iterations=num_iterations, max_steps=num_iterations)
    from posttrain.forward.logprobs import plain_lm_head

    plain_lm_head(trainer.model, torch.tensor([[1, 2, 3]]))  # the output layer's one-off probe (cached), not counted
    calls = []
    trainer.model.register_forward_hook(lambda *a: calls.append(1) if not generating["on"] else None)
    trainer.train()
    assert trainer.old_is_current == (num_iterations == 1)
    assert len(calls) == 2 * num_iterations  # micro-batches trained; no extra old-logprob forward
    # with several passes the old log-probs are the sampler's: equal to the training forward's before any update
    assert trainer.state.log_history[0]["val/ratio"] == pytest.approx(1.0, abs=1e-4) or num_iterations == 1


@pytest.mark.parametrize("replay", [False, True])  # the training forward computes, or replays the sampler's
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_loss_and_gradient_do_not_depend_on_the_split(tmp_path, loss_type, replay, monkeypatch):
    """Same rollouts: batch 8 x accumulation 1 == 4 x 2 == 2 x 4 (sum of micro-batch losses and gradients)."""
    from posttrain.forward import completions as completions_module
    from posttrain.models.loading import load_causal_lm

    replayed = []
    monkeypatch.setattr(completions_module, "replaying",
                        lambda *a, real=completions_module.replaying: replayed.append(1) or real(*a))
    model = load_causal_lm("posttrain/tiny-qwen2")
    results = []
    rollout = scores = None
    for bs, ga in [(8, 1), (4, 2), (2, 4)]:
        trainer = grpo(tmp_path, model=model, per_device_train_batch_size=bs, gradient_accumulation_steps=ga,
                       loss_type=loss_type)
        if rollout is None:
            inputs = next(iter(trainer.get_train_dataloader()))
            trainer.replays = replay
            rollout = trainer.sample_completions(inputs["prompt_ids"])
            assert (rollout.linear_outputs is not None) == replay
            scores = torch.tensor(first_token_reward(rollout.completion_ids.tolist()))
        results.append(batch_loss_and_grads(trainer, model, rollout, scores))
    assert len(replayed) == (1 + 2 + 4 if replay else 0)  # every micro-batch's forward replayed
    (loss0, grads0), *others = results
    for loss, g in others:
        assert loss == pytest.approx(loss0, rel=1e-5, abs=1e-7)
        for name in grads0:
            torch.testing.assert_close(g[name], grads0[name], rtol=1e-4, atol=1e-7, msg=name)


def test_replayed_training_forward_gives_the_same_update(tmp_path, monkeypatch):
    """The same rollout trained with the sampler's linear outputs and without: same loss and gradients; the
    record is let go after the generation batch's last micro-batch."""
    from posttrain.forward import completions as completions_module

    replayed = []
    monkeypatch.setattr(completions_module, "replaying",
                        lambda *a, real=completions_module.replaying: replayed.append(1) or real(*a))
    results = []
    for replay in (True, False):
        trainer = grpo(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                       replay_linear_outputs=replay)
        assert trainer.replays == replay
        with torch.no_grad():  # larger weights than the seeded tiny model: activations of a real size
            g = torch.Generator().manual_seed(0)
            for p in trainer.model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
        inputs = next(iter(trainer.get_train_dataloader()))
        trainer.model.zero_grad()
        losses = []
        for index in range(2):
            losses.append(trainer.training_step(trainer.model, {**inputs, "micro_index": index}).item())
            assert trainer.holds_replay_record == (replay and index == 0)  # let go after the last forward
        results.append((losses, grads(trainer.model), trainer.experience[0]["completion_ids"]))
    assert len(replayed) == 2
    (losses1, grads1, ids1), (losses0, grads0, ids0) = results
    assert torch.equal(ids1, ids0)  # the same samples (recording does not change sampling)
    assert losses1 == pytest.approx(losses0, rel=1e-4, abs=1e-6)
    for name in grads0:
        assert grads0[name].abs().sum() > 0, name
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-3, atol=1e-4 * grads0[name].abs().max().item(),
                                   msg=name)


@pytest.mark.parametrize("overrides", [
    dict(replay_linear_outputs=False),
    dict(num_iterations=2),                                   # the policy moves between passes
    dict(steps_per_generation=2, gradient_accumulation_steps=1, per_device_train_batch_size=4),  # ... between steps
    dict(gradient_checkpointing=True),                        # the recomputation would run outside the replay
])
def test_no_replay_when_the_sampler_outputs_may_not_be_the_forwards(tmp_path, overrides):
    assert grpo(tmp_path).replays  # the default, on a supported model
    trainer = grpo(tmp_path, **overrides)
    assert not trainer.replays
    _, micro = first_batch(trainer)
    assert not trainer.holds_replay_record


def test_no_replay_with_dropout(tmp_path):
    from posttrain.models.loading import load_causal_lm

    model = load_causal_lm("posttrain/tiny-qwen2", attention_dropout=0.1)
    assert model.config.attention_dropout == 0.1
    assert not grpo(tmp_path, model=model).replays


def test_mask_truncated_completions_and_missing_eos_penalty(tmp_path):
    trainer = grpo(tmp_path, max_completion_length=2, mask_truncated_completions=True, missing_eos_penalty=1.0)
    inputs = next(iter(trainer.get_train_dataloader()))
    rollout = trainer.sample_completions(inputs["prompt_ids"])
    truncated = rollout.is_truncated
    assert truncated.any()
    micro = trainer.build_experience(rollout, torch.zeros(len(truncated)))
    mask = torch.cat([mb["loss_mask"] for mb in micro])
    assert not mask[truncated].any()
    assert trainer.recorded_metrics()["objective/scores"][-1] == pytest.approx(-truncated.float().mean().item())


def test_config_checks():
    with pytest.raises(ValueError, match="num_generations"):
        GRPOConfig(output_dir="x", per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=3)
    # accepted, as TRL accepts it (tests/trainers/test_online_fields.py trains with it)
    assert GRPOConfig(output_dir="x", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                      steps_per_generation=3, num_generations=4).steps_per_generation == 3
    with pytest.raises(ValueError, match="loss_type"):
        GRPOConfig(output_dir="x", per_device_train_batch_size=8, loss_type="nope")
    with pytest.raises(ValueError, match="beta > 0"):
        GRPOConfig(output_dir="x", per_device_train_batch_size=8, sync_ref_model=True)
    with pytest.raises(ValueError, match="num_generations >= 2"):
        OnlineConfig(output_dir="x", advantage_estimator="leave_one_out", num_generations=1)
    config = GRPOConfig(output_dir="x", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                        scale_rewards=False)
    assert config.scale_rewards == "none" and config.steps_per_generation == 2 and config.num_generations == 8
    assert GRPOConfig(output_dir="x", per_device_train_batch_size=4, generation_batch_size=16,
                      num_generations=8).steps_per_generation == 4


def test_resolve_aliases():
    from posttrain.trainers.rloo import RLOOConfig

    assert RLOOConfig(output_dir="x", per_device_train_batch_size=4, num_generations=4).rloo_k == 4
    assert RLOOConfig(output_dir="x", per_device_train_batch_size=4, rloo_k=4).num_generations == 4
    assert RLOOConfig(output_dir="x", per_device_train_batch_size=4, rloo_k=4, num_generations=4).rloo_k == 4
    with pytest.raises(ValueError, match="rloo_k=4 and num_generations=8"):
        RLOOConfig(output_dir="x", per_device_train_batch_size=8, rloo_k=4, num_generations=8)
    with pytest.raises(ValueError, match="kl_coef"):
        RLOOConfig(output_dir="x", per_device_train_batch_size=4, kl_coef=0.1, beta=0.2)
    assert callable(resolve_aliases)


def test_bad_dataset_and_missing_reward(tmp_path):
    from datasets import Dataset

    args = GRPOConfig(**online_args(tmp_path, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                                    num_generations=4))
    with pytest.raises(ValueError, match="'prompt' column"):
        GRPOTrainer("posttrain/tiny-qwen2", first_token_reward, args=args,
                    train_dataset=Dataset.from_dict({"text": ["a", "b"]}))
    with pytest.raises(ValueError, match="reward_funcs"):
        OnlineTrainer("posttrain/tiny-qwen2", None, args=args, train_dataset=prompts())
    with pytest.raises(ValueError, match="fewer than one generation batch"):
        GRPOTrainer("posttrain/tiny-qwen2", first_token_reward, args=args, train_dataset=prompts(1))
