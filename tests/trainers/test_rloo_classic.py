"""RLOO as the classic trainer behaved: reward_clip_range clips only normalised scores (and takes a (min, max)
pair), a classic callable reward model gets query + response texts, val/clipfrac_avg is logged, and the
completions table has the classic headings."""

import pytest
import torch
from tests.helpers.online import online_args, prompts

from posttrain.core.shaping import clip_scores
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

MODEL = "posttrain/tiny-qwen2"


def big_reward(completion_ids, **kwargs):
    """Scores far above the default clip range of 10 that still differ between completions."""
    return [100.0 + float(ids[0] % 5) if ids else 100.0 for ids in completion_ids]


def test_raw_scores_are_not_clipped_without_normalize_reward(tmp_path):
    args = RLOOConfig(**online_args(tmp_path, rloo_k=4, num_ppo_epochs=1, kl_coef=0.0, max_steps=1))
    assert args.reward_clip_range == 10.0 and not args.normalize_reward
    trainer = RLOOTrainer(MODEL, big_reward, args=args, train_dataset=prompts(16))
    scores = torch.tensor([20.0, 30.0, -15.0, 5.0])
    torch.testing.assert_close(clip_scores(scores, trainer.reward_shaping().clip_range), scores)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    # clipped to 10, every score would be equal, every advantage 0 and (no KL) no parameter would move
    assert all(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    clipfrac = [e["val/clipfrac_avg"] for e in trainer.state.log_history if "val/clipfrac_avg" in e]
    assert clipfrac == [0.0]


def test_normalised_scores_are_clipped_to_a_bound_or_a_pair(tmp_path):
    scores = torch.tensor([20.0, 30.0, -15.0, 5.0])
    args = RLOOConfig(**online_args(tmp_path, normalize_reward=True))
    trainer = RLOOTrainer(MODEL, big_reward, args=args, train_dataset=prompts(16))
    torch.testing.assert_close(clip_scores(scores, trainer.reward_shaping().clip_range),
                               torch.tensor([10.0, 10.0, -10.0, 5.0]))
    trainer.args.reward_clip_range = RLOOConfig(**online_args(tmp_path, reward_clip_range=[-1, 25])).reward_clip_range
    assert trainer.args.reward_clip_range == (-1.0, 25.0)
    torch.testing.assert_close(clip_scores(scores, trainer.reward_shaping().clip_range),
                               torch.tensor([20.0, 25.0, -1.0, 5.0]))
    with pytest.raises(ValueError, match="min <= max"):
        RLOOConfig(**online_args(tmp_path, reward_clip_range=(3, 1)))
    with pytest.raises(ValueError, match="must be >= 0"):
        RLOOConfig(**online_args(tmp_path, reward_clip_range=-2.0))


def test_classic_callable_reward_model_gets_query_and_response(tmp_path):
    from posttrain.models.loading import load_causal_lm, load_tokenizer

    seen = []

    def reward_model(texts):  # the classic form: one list of decoded query + response strings
        seen.extend(texts)
        return [float(len(t) % 7) for t in texts]

    tok = load_tokenizer(None, model=MODEL)
    data = prompts(16)
    data = data.map(lambda row: {"input_ids": tok(row["prompt"])["input_ids"]}).remove_columns("prompt")
    config = RLOOConfig(**online_args(tmp_path, rloo_k=2, num_ppo_epochs=1, max_steps=1))
    trainer = RLOOTrainer(config=config, processing_class=tok, policy=load_causal_lm(MODEL), ref_policy=None,
                          reward_model=reward_model, train_dataset=data)
    trainer.train()
    queries = set(tok.batch_decode(list(data["input_ids"]), skip_special_tokens=True))
    assert len(seen) == 8
    assert all(any(text.startswith(q) and len(text) > len(q) for q in queries) for text in seen), seen[:2]
    assert trainer.reward_scorer.names == ["reward_model"]


def test_completions_table_has_the_classic_headings(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")

    def other(completion_ids, **kwargs):
        return [1.0] * len(completion_ids)

    trainer = RLOOTrainer(MODEL, [big_reward, other], args=RLOOConfig(**online_args(tmp_path)),
                          train_dataset=prompts(16))
    trainer.completions_table.write(0, ["p1"], ["c1"], {"big_reward": [101.0], "other": [1.0]})
    out = capsys.readouterr().out
    for heading in ("query", "model response", "score (big_reward)", "score (other)"):
        assert heading in out, out
    trainer.completions_table.write(1, ["p1"], ["c1"], {"big_reward": [101.0]})
    out = capsys.readouterr().out
    assert "score" in out and "score (" not in out and "big_reward" not in out


def test_ref_policy_that_is_the_policy_becomes_a_frozen_copy(tmp_path):
    from posttrain.models.loading import load_causal_lm

    policy = load_causal_lm(MODEL)
    config = RLOOConfig(**online_args(tmp_path))
    trainer = RLOOTrainer(config=config, policy=policy, ref_policy=policy, reward_model=big_reward,
                          train_dataset=prompts(16))
    assert trainer.ref_model is not None and trainer.ref_model is not policy
    assert all(p.requires_grad for p in policy.parameters())
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())


def test_classic_form_takes_tokenizer_and_config_fields(tmp_path):
    """The older docs' call: config=, tokenizer=, policy=, ref_policy=, reward_model=, and RLOOConfig fields given
    to the trainer (one name of an alias pair sets both, even when the config set the pair to another value)."""
    from posttrain.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer(None, model=MODEL)
    policy = load_causal_lm(MODEL)
    config = RLOOConfig(**online_args(tmp_path, rloo_k=2, num_ppo_epochs=1, max_steps=1))
    with pytest.warns(FutureWarning, match=r"\['kl_coef', 'rloo_k'\] to RLOOTrainer is deprecated.*RLOOConfig fields"):
        trainer = RLOOTrainer(config=config, tokenizer=tok, policy=policy, ref_policy=policy, reward_model=big_reward,
                              train_dataset=prompts(16), rloo_k=4, kl_coef=0.1)
    assert trainer.processing_class is tok
    assert (trainer.args.rloo_k, trainer.args.num_generations, trainer.sampling.num_generations) == (4, 4, 4)
    assert (trainer.args.kl_coef, trainer.args.beta) == (0.1, 0.1)
    assert (config.rloo_k, config.kl_coef) == (2, 0.05)  # the caller's config is unchanged
    trainer.train()
    assert trainer.state.global_step == 1


def test_classic_form_without_config_and_unknown_keywords(tmp_path):
    with pytest.warns(FutureWarning, match=r"\['max_steps', 'output_dir'\]"):
        trainer = RLOOTrainer(policy=MODEL, reward_model=big_reward, train_dataset=prompts(16),
                              output_dir=str(tmp_path), max_steps=1)
    assert isinstance(trainer.args, RLOOConfig) and trainer.args.output_dir == str(tmp_path)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['rlook'\]"):
        RLOOTrainer(config=RLOOConfig(**online_args(tmp_path)), policy=MODEL, reward_model=big_reward,
                    train_dataset=prompts(16), rlook=4)


def test_fields_given_to_the_trainer_derive_the_others_again(tmp_path):
    """steps_per_generation left unset follows gradient_accumulation_steps (x num_mini_batches), also when that is
    given to the trainer rather than the config; one the user set stays."""
    config = RLOOConfig(**online_args(tmp_path, rloo_k=2, num_ppo_epochs=1, max_steps=1))
    assert config.steps_per_generation == 2
    with pytest.warns(FutureWarning, match="gradient_accumulation_steps"):
        trainer = RLOOTrainer(config=config, policy=MODEL, reward_model=big_reward, train_dataset=prompts(16),
                              gradient_accumulation_steps=4)
    assert (trainer.args.gradient_accumulation_steps, trainer.args.steps_per_generation) == (4, 4)
    assert config.steps_per_generation == 2  # the caller's config is unchanged
    fixed = RLOOConfig(**online_args(tmp_path, rloo_k=2, num_ppo_epochs=1, max_steps=1, steps_per_generation=2))
    with pytest.warns(FutureWarning):
        trainer = RLOOTrainer(config=fixed, policy=MODEL, reward_model=big_reward, train_dataset=prompts(16),
                              gradient_accumulation_steps=1)
    assert (trainer.args.gradient_accumulation_steps, trainer.args.steps_per_generation) == (1, 2)
