"""BCO's generate_during_eval: each evaluation samples completions of eval prompts from the policy and from the
reference, prints them as a table and appends them to eval_completions.jsonl."""

import json

import torch
from tests.helpers.preference import TINY, config_kwargs

from posttrain.models.loading import load_causal_lm
from posttrain.rollout.generate import SamplingConfig, generate
from posttrain.tasks.builtin import zen
from posttrain.trainers.bco import BCOConfig, BCOTrainer
from posttrain.trainers.eval_samples import EVAL_COMPLETIONS_FILE


def sampled(model, tok, prompt_ids, seed, max_new_tokens):
    out = generate(model, prompt_ids, SamplingConfig(max_new_tokens=max_new_tokens), pad_token_id=tok.pad_token_id,
                   eos_token_id=tok.eos_token_id, generator=torch.Generator().manual_seed(seed))
    lengths = out.completion_mask.sum(1).tolist()
    return tok.batch_decode([ids[:n] for ids, n in zip(out.completion_ids.tolist(), lengths)], skip_special_tokens=True)


def test_evaluate_samples_policy_and_reference_completions(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    data = zen("unpaired_preference")
    args = BCOConfig(**config_kwargs(tmp_path, generate_during_eval=True, per_device_eval_batch_size=3,
                                     max_completion_length=5))
    trainer = BCOTrainer(TINY, ref_model=load_causal_lm(TINY), args=args, train_dataset=data,
                         eval_dataset=data.select(range(6)))
    with torch.no_grad():  # the policy moves away from the reference, so their samples differ
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics
    out = capsys.readouterr().out
    assert all(h in out for h in ("Prompt", "Policy", "Ref Model", "eval completions at step 0")), out
    rows = [json.loads(line) for line in open(tmp_path / EVAL_COMPLETIONS_FILE)]
    assert len(rows) == 3 and {r["step"] for r in rows} == {0} and {r["eval_set"] for r in rows} == {"eval"}
    tok = trainer.processing_class
    eval_prompts = {tok.decode(ids, skip_special_tokens=True): ids for ids in trainer.eval_dataset["prompt_ids"]}
    assert all(r["prompt"] in eval_prompts for r in rows)
    prompt_ids = [eval_prompts[r["prompt"]] for r in rows]
    # each column is what its model samples with the run's seed (+ step 0), at most max_completion_length tokens
    assert [r["policy"] for r in rows] == sampled(trainer.model, tok, prompt_ids, args.seed, 5)
    assert [r["ref_model"] for r in rows] == sampled(load_causal_lm(TINY), tok, prompt_ids, args.seed, 5)
    assert [r["policy"] for r in rows] != [r["ref_model"] for r in rows]
    trainer.evaluate(eval_dataset={"held_out": zen("unpaired_preference").select(range(6, 10))})
    rows = [json.loads(line) for line in open(tmp_path / EVAL_COMPLETIONS_FILE)]
    assert len(rows) == 6 and {r["eval_set"] for r in rows[3:]} == {"eval_held_out"}


def test_off_by_default_and_no_reference_column_without_a_reference(tmp_path):
    data = zen("unpaired_preference")
    trainer = BCOTrainer(TINY, args=BCOConfig(**config_kwargs(tmp_path)), train_dataset=data, eval_dataset=data.select(range(4)))
    trainer.evaluate()
    assert not (tmp_path / EVAL_COMPLETIONS_FILE).exists()
    trainer.needs_reference = False  # as the reference-free trainers built on the same base
    from posttrain.trainers.eval_samples import sample_eval_completions

    rows = sample_eval_completions(trainer, trainer.eval_dataset)
    assert trainer.args.per_device_eval_batch_size == 8  # more than the 4 eval rows: each is sampled once
    assert len(rows) == 4 and all("ref_model" not in r for r in rows)
    assert all(isinstance(r["policy"], str) for r in rows)
