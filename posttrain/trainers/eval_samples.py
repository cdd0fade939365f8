"""`generate_during_eval` (BCO, as TRL's BCOConfig / DPOConfig field): at each evaluation, sample completions
of a few eval prompts from the policy and from the reference, and show them side by side.

The offline preference trainers call `sample_eval_completions` from their `evaluation_loop`. TRL logs the
table to Weights & Biases or Comet only; here the main process prints it (Prompt | Policy | Ref Model) and
appends its rows to `<output_dir>/eval_completions.jsonl`, so no logging service is needed.
"""

from __future__ import annotations

import itertools
import json
import os
import random

import torch

EVAL_COMPLETIONS_FILE = "eval_completions.jsonl"  # one JSON row per sampled prompt
HEADINGS = {"prompt": "Prompt", "policy": "Policy", "ref_model": "Ref Model"}


@torch.no_grad()
def sample_eval_completions(trainer, dataset, name: str = "eval") -> list[dict]:
    """Sample one completion for each of `per_device_eval_batch_size` prompts of a prepared eval dataset (a
    random choice seeded by seed + global step; the first rows of a stream) from the policy and, when the
    trainer has one, from the reference (a precomputed reference was freed: no column then).

    Returns the rows {"step", "eval_set", "prompt", "policy"[, "ref_model"]}. Completions are sampled at
    temperature 1 for at most `max_completion_length` tokens (else what `max_length` leaves after the longest
    prompt, else 128), with the same seed for both models. Every process samples the same rows (so sharded
    models run the same forwards); the main process prints and writes them.
    """
    from posttrain.rollout.generate import SamplingConfig, generate

    args, tok, step = trainer.args, trainer.processing_class, trainer.state.global_step
    k = args.per_device_eval_batch_size
    if hasattr(dataset, "__len__"):
        picks = random.Random(args.seed + step).sample(range(len(dataset)), min(k, len(dataset)))
        rows = [dataset[i] for i in picks]
    else:
        rows = list(itertools.islice(dataset, k))
    prompts = [list(row["prompt_ids"]) for row in rows]
    room = args.max_completion_length or (args.max_length - max(map(len, prompts)) if args.max_length else 128)
    sampling = SamplingConfig(max_new_tokens=max(1, room))

    def sample(model) -> list[str]:
        out = generate(model, prompts, sampling, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                       generator=torch.Generator().manual_seed(args.seed + step))
        lengths = out.completion_mask.sum(1).tolist()
        return tok.batch_decode([ids[:n] for ids, n in zip(out.completion_ids.tolist(), lengths)],
                                skip_special_tokens=True)

    policy = trainer.accelerator.unwrap_model(trainer.model)
    columns = {"policy": sample(policy)}
    if trainer.needs_reference and not trainer.ref_precomputed:
        ref = trainer.accelerator.unwrap_model(trainer.ref_model) if trainer.ref_model is not None else policy
        with trainer.reference_context(trainer.ref_model):  # PEFT without ref_model: the adapter disabled
            columns["ref_model"] = sample(ref)
    texts = tok.batch_decode(prompts, skip_special_tokens=True)
    samples = [{"step": step, "eval_set": name, "prompt": text, **{c: v[i] for c, v in columns.items()}}
               for i, text in enumerate(texts)]
    if trainer.is_world_process_zero():
        from posttrain.callbacks import print_table

        print_table(f"{name} completions at step {step}", [HEADINGS[c] for c in ["prompt", *columns]],
                    [[row[c] for c in ["prompt", *columns]] for row in samples])
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, EVAL_COMPLETIONS_FILE), "a", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in samples)
    return samples
