"""One benchmark run of the PPO or BCO workload by one library: TRL 1.12 or posttrain. Started by vs_trl.py.

    python benchmarks/vs_trl_experimental_worker.py SPEC.json      # writes the result JSON to SPEC["out"]

TRL 1.16 no longer ships PPOTrainer and BCOTrainer; TRL 1.12.0 has them as trl.experimental.ppo and
trl.experimental.bco, so the TRL side of these two workloads runs in .bench-venv-trl112 (setup_trl112_env.sh).
The spec, the result and the step clock are vs_trl_worker.py's (imported from it: it imports no library at
module level), so vs_trl.py summarises these runs as it does the others. What differs:

* PPO. Both sides get the same objects built here: the policy (the causal LM), a value model and a reward
  model (two copies of the sequence-classification model vs_trl.py saved once, score head drawn with seed 0),
  and the same tokenizer, with <|endoftext|> as pad token: SmolLM2's pad token is its EOS, <|im_end|>, which
  also ends every chat turn of the prompt, and TRL's PPO takes every pad id for padding (it would mask the
  prompt's turn ends). The prompts are the token ids of the chat prompts (TRL's PPO takes only `input_ids`).
  One step here is one PPO update: sample a batch of completions, score them, then num_ppo_epochs passes of
  num_mini_batches optimizer steps. TRL's PPOTrainer ends a trainer step once per update and counts its batch
  in per_device_train_batch_size (with gradient_accumulation_steps=1, each mini-batch is one optimizer step);
  posttrain's ends a trainer step per optimizer step and counts the completions of one optimizer step there,
  so its per_device_train_batch_size is the batch / num_mini_batches and its clock keeps every
  (num_ppo_epochs * num_mini_batches)-th step end. Completions end at EOS on both (stop_token="eos").
  Samples per update are the rows the reward model scored (a hook on its score head, either side).
  TRL's PPO logs no completion length: this worker measures it from the policy's generate() output (tokens
  up to and including the first EOS, as posttrain's completions/mean_length counts them).
* BCO. The preference pairs become unpaired rows, pair i giving row 2i (chosen, desirable) and row 2i + 1
  (rejected, undesirable), so a batch of 8 rows holds 4 whole pairs; both sides read them in order
  (TRL's BCOTrainer always does; posttrain's gets train_sampling_strategy="sequential"). No UDM (neither side
  gets an embedding_func).
"""

from __future__ import annotations

import importlib
import json

from vs_trl_worker import common_args, start, train_and_measure, write_result

PAD = "<|endoftext|>"  # PPO's pad token: see the module docstring


def trainer_classes(side: str, kind: str):
    lib = importlib.import_module(f"trl.experimental.{kind}" if side == "trl" else f"posttrain.trainers.{kind}")
    return getattr(lib, f"{kind.upper()}Config"), getattr(lib, f"{kind.upper()}Trainer")


def unpaired(pairs: list[dict]) -> list[dict]:
    """Pair i -> row 2i (prompt, chosen, desirable) and row 2i + 1 (prompt, rejected, undesirable)."""
    return [{"prompt": p["prompt"], "completion": p[k], "label": k == "chosen"} for p in pairs
            for k in ("chosen", "rejected")]


def as_text(rows: list[dict], tokenizer) -> list[dict]:
    """Conversational unpaired rows as text with the chat template applied, the completion without the closing
    EOS + newline of its turn: each side then adds one EOS, and both train on the same tokens. (On chat rows
    TRL 1.12's BCO appends an EOS after the template's "<|im_end|>\\n", one token posttrain does not add.)"""
    end = tokenizer.eos_token + "\n"

    def text(row):
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)
        if not (full.startswith(prompt) and full.endswith(end)):
            raise SystemExit(f"the chat template renders a row as {full!r}: expected the prompt with its generation "
                             f"prompt first and {end!r} last")
        return {"prompt": prompt, "completion": full[len(prompt):-len(end)], "label": row["label"]}

    return [text(r) for r in rows]


def ppo_trainer(side: str, spec: dict, common: dict, tokenizer):
    """The PPO trainer of `side` and, per update, the rows its reward model scored, the optimizer steps of one
    update and (TRL) the completion lengths of each generate() call."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    Config, Trainer = trainer_classes(side, "ppo")
    cfg = dict(spec["config"])
    if cfg.get("gradient_accumulation_steps", 1) != 1:
        raise SystemExit("the PPO workload needs gradient_accumulation_steps=1 (TRL's PPOTrainer then makes each "
                         "mini-batch one optimizer step)")
    batch, epochs, minis = cfg["per_device_train_batch_size"], cfg["num_ppo_epochs"], cfg["num_mini_batches"]
    if side == "trl":
        cfg["response_length"] = cfg.pop("max_completion_length")
        steps_per_update = 1
    else:
        cfg["per_device_train_batch_size"] = batch // minis
        steps_per_update = epochs * minis
    args = Config(**{**common, "max_steps": spec["steps"] * steps_per_update}, total_episodes=spec["steps"] * batch,
                  **cfg)

    tokenizer.pad_token, tokenizer.padding_side = PAD, "left"
    rows = json.load(open(spec["data"]))
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"] for r in rows]
    data = Dataset.from_list([{"input_ids": ids} for ids in prompts])
    policy = AutoModelForCausalLM.from_pretrained(spec["models"]["causal"], dtype=torch.float32)
    value, reward = (AutoModelForSequenceClassification.from_pretrained(spec["models"]["seqcls"], num_labels=1,
                                                                        dtype=torch.float32) for _ in range(2))
    trainer = Trainer(args=args, processing_class=tokenizer, model=policy, ref_model=None, reward_model=reward,
                      value_model=value, train_dataset=data)

    scored: list[int] = []
    reward.score.register_forward_hook(lambda module, inputs, output: scored.append(output.shape[0]))
    lengths: list[float] = []
    if side == "trl":
        generate, eos = policy.generate, tokenizer.eos_token_id

        def measured_generate(*a, **kw):
            out = generate(*a, **kw)
            new = out.sequences[:, kw["input_ids"].shape[1]:]
            ends = new == eos
            n = torch.where(ends.any(1), ends.int().argmax(1) + 1, new.shape[1])
            lengths.append(n.float().mean().item())
            return out

        policy.generate = measured_generate
    return trainer, scored, steps_per_update, lengths


def main():
    spec = start()
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    side, kind = spec["side"], spec["trainer"]
    common = common_args(spec)
    tokenizer = AutoTokenizer.from_pretrained(spec["models"]["causal"])
    scored, steps_per_update, lengths = [], 1, []
    if kind == "ppo":
        trainer, scored, steps_per_update, lengths = ppo_trainer(side, spec, common, tokenizer)
    elif kind == "bco":
        Config, Trainer = trainer_classes(side, "bco")
        extra = {} if side == "trl" else {"train_sampling_strategy": "sequential"}  # TRL's BCO is always sequential
        args = Config(**common, **spec["config"], **extra)
        data = Dataset.from_list(as_text(unpaired(json.load(open(spec["data"]))), tokenizer))
        trainer = Trainer(model=spec["models"]["causal"], args=args, train_dataset=data, processing_class=tokenizer)
    else:
        raise SystemExit(f"vs_trl_experimental_worker runs PPO and BCO, not {kind!r}")
    scored_at_end: list[int] = []

    class ScoredRows(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            scored_at_end.append(sum(scored))

    trainer.add_callback(ScoredRows())
    result = train_and_measure(trainer, spec)

    # one entry per update: the last optimizer step's end of each
    k = steps_per_update
    cumulative = scored_at_end[k - 1::k]
    samples = [b - a for a, b in zip([0] + cumulative, cumulative)] if kind == "ppo" else []
    write_result(spec, {**result, "step_begin": result["step_begin"][::k], "step_end": result["step_end"][k - 1::k],
                        "step_cpu_end": result["step_cpu_end"][k - 1::k], "optimizer_steps_per_step": k,
                        "samples": samples, "logs": result["logs"] + [{"completions/mean_length": n} for n in lengths]})


if __name__ == "__main__":
    main()
