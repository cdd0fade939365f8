"""Helpers of the online-trainer tests."""

import copy
import dataclasses


def greedy_reward(model, tok, dataset, reward_func, max_new_tokens: int = 8) -> float:
    """Mean reward of greedy completions on `dataset` (held-out prompts)."""
    from posttrain.data.tokenize import encode_prompt
    from posttrain.rollout.generate import SamplingConfig, generate

    prompts = [encode_prompt(tok, p) for p in dataset["prompt"]]
    out = generate(model, prompts, SamplingConfig(max_new_tokens=max_new_tokens, do_sample=False),
                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    lengths = out.completion_mask.sum(1).tolist()
    texts = tok.batch_decode([ids[:n] for ids, n in zip(out.completion_ids.tolist(), lengths)],
                             skip_special_tokens=True)
    scores = reward_func(texts, answer=dataset["answer"])
    return sum(scores) / len(scores)


# ---------------------------------------------------------------- online trainers

ONLINE_METRICS = [
    "eps", "objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
    "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "policy/entropy_avg", "loss/policy_avg",
    "val/ratio", "val/ratio_var", "val/num_eos_tokens", "lr", "episode", "reward", "reward_std",
    "completions/mean_length", "completions/clipped_ratio", "frac_reward_zero_std",
]
CRITIC_METRICS = ["loss/value_avg", "val/clipfrac_avg"]


def first_token_reward(completion_ids, **kwargs):
    """A reward that varies between samples of a random tiny model (so group advantages are not all 0)."""
    return [float(ids[0] % 5) if ids else 0.0 for ids in completion_ids]


def prompts(n: int = 32):
    from posttrain.tasks.builtin import task_dataset

    return task_dataset("reverse", "train", size=n).remove_columns("completion")


def online_args(tmp_path, **overrides) -> dict:
    """Small, fast settings for smoke runs of the online trainers."""
    return {"output_dir": str(tmp_path), "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
            "max_completion_length": 6, "learning_rate": 1e-3, "logging_steps": 1, "max_steps": 2,
            "report_to": "none", "disable_tqdm": True, "num_sample_generations": 0, **overrides}


def train_and_check(trainer, metrics=ONLINE_METRICS, reward_names=("first_token_reward",)):
    """Train; assert every trainable parameter changed and every metric was logged, finite."""
    import math

    import torch

    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    unchanged = [n for n, p in trainer.model.named_parameters() if n in before and torch.equal(p, before[n])]
    assert not unchanged, f"parameters that did not change: {unchanged}"
    logged: dict[str, list[float]] = {}
    for entry in trainer.state.log_history:
        for key, value in entry.items():
            logged.setdefault(key, []).append(value)
    wanted = list(metrics) + [f"rewards/{n}/{s}" for n in reward_names for s in ("mean", "std")]
    missing = [m for m in wanted if m not in logged]
    assert not missing, f"metrics never logged: {missing}"
    bad = {m: logged[m] for m in wanted if not all(math.isfinite(v) for v in logged[m])}
    assert not bad, f"non-finite metrics: {bad}"
    return logged


def sampled_reward(model, tok, dataset, reward_func, num_generations: int = 4, temperature: float = 1.0,
                   max_new_tokens: int = 8, seed: int = 0) -> float:
    """Mean reward of sampled completions on `dataset` (the policy's expected reward on held-out prompts)."""
    import torch

    from posttrain.data.tokenize import encode_prompt
    from posttrain.rollout.generate import SamplingConfig, generate

    prompts = [encode_prompt(tok, p) for p in dataset["prompt"]]
    out = generate(model, prompts, SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature,
                                                  num_generations=num_generations),
                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                   generator=torch.Generator().manual_seed(seed))
    lengths = out.completion_mask.sum(1).tolist()
    texts = tok.batch_decode([ids[:n] for ids, n in zip(out.completion_ids.tolist(), lengths)],
                             skip_special_tokens=True)
    answers = [a for a in dataset["answer"] for _ in range(num_generations)]
    scores = reward_func(texts, answer=answers)
    return sum(scores) / len(scores)


def learning_args(tmp_path, **overrides) -> dict:
    """RL from the partially SFT-trained tiny model on `reverse` (shared by the four learning tests):
    100 rollouts of 8 prompts x 8 samples, lr 1e-3 constant, completions of at most 6 tokens (" dddd" + EOS)."""
    return {"output_dir": str(tmp_path), "per_device_train_batch_size": 64, "max_steps": 100, "learning_rate": 1e-3,
            "lr_scheduler_type": "constant", "max_completion_length": 6, "temperature": 1.0, "logging_steps": 10,
            "report_to": "none", "disable_tqdm": True, "num_sample_generations": 0, "seed": 42, **overrides}


def heldout_scores(trainer) -> tuple[float, float]:
    """On 100 held-out `reverse` prompts: greedy exact-match accuracy, and the mean digit_match reward
    of 4 sampled completions (T = 1) per prompt."""
    from posttrain.eval import generation_accuracy
    from posttrain.tasks.builtin import digit_match_reward, task_dataset

    test = task_dataset("reverse", "test", size=100)
    model, tok = trainer.policy, trainer.processing_class
    accuracy = generation_accuracy(model, tok, test, max_new_tokens=6)
    return accuracy, sampled_reward(model, tok, test, digit_match_reward, max_new_tokens=6)


def assert_learns(trainer, name: str):
    """Train; held-out greedy accuracy must rise by more than 0.15 and sampled reward by more than 0.15."""
    before = heldout_scores(trainer)
    trainer.train()
    after = heldout_scores(trainer)
    print(f"{name} held-out greedy accuracy {before[0]:.2f} -> {after[0]:.2f}, "
          f"sampled reward {before[1]:.3f} -> {after[1]:.3f}")
    assert after[0] > before[0] + 0.15 and after[1] > before[1] + 0.15, (before, after)


def batch_loss_and_grads(trainer, model, rollout, scores) -> tuple[float, dict]:
    """Train one generation batch's micro-batches without an optimizer step: (the summed loss, each
    parameter's accumulated gradient). The rollout can be trained on again: the last micro-batch lets the
    sampler's record go layer by layer (`accel/replay.py`), so the batch is built on a copy of it."""
    record = rollout.linear_outputs
    if record is not None:
        record = copy.copy(record)
        record.layers = [t.clone() for t in record.layers]
        rollout = dataclasses.replace(rollout, linear_outputs=record)
    micro = trainer.build_experience(rollout, scores)
    assert len(micro) == trainer.args.gradient_accumulation_steps
    model.zero_grad()
    total = 0.0
    for mb in micro:
        loss = trainer.compute_loss(model, mb)
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
