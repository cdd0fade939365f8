"""Win rate of a model's completions against a dataset's reference completions, decided by a judge.

The classic evaluation of a summarisation (TL;DR) policy:

    python examples/scripts/evals/judge_tldr.py --model_name_or_path out/rloo \
        --dataset_name tldr_folder --judge_model gpt-4o-mini --num_examples 1000

Here nothing is downloaded: `--dataset_name` is a built-in dataset (e.g. `reverse`) or a local file
or folder (see `posttrain.cli.load_dataset_arg`) with a `prompt` column and a reference column
(`completion`, or `--reference_column`). The judge is

* a reward model (a local folder or a built-in name such as `posttrain/tiny-qwen2-seqcls`): the
  completion it scores higher wins (`posttrain.judges.RewardModelJudge`);
* `openai:<model>`: an OpenAI-compatible chat endpoint (`--judge_base_url`, key in
  `OPENAI_API_KEY`), asked which of two answers is better (`posttrain.judges.OpenAIPairwiseJudge`).

Completions are greedy, `--max_new_tokens` long. Prints the win rate and writes the per-row
completions to `--output_file` (JSON lines) when given.
"""

from __future__ import annotations

import argparse
import json
import sys


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_name_or_path", required=True, help="Model whose completions are judged.")
    parser.add_argument("--dataset_name", required=True, help="Built-in dataset, local file or local folder.")
    parser.add_argument("--dataset_split", default="test", help="Split to evaluate on (default: test).")
    parser.add_argument("--reference_column", default="completion", help="Column of the reference completions.")
    parser.add_argument("--judge_model", required=True,
                        help="A reward model (folder or built-in name), or 'openai:<model>' for an HTTP judge.")
    parser.add_argument("--judge_base_url", default=None, help="Base URL of the OpenAI-compatible endpoint.")
    parser.add_argument("--num_examples", type=int, default=None, help="Evaluate the first N rows (default: all).")
    parser.add_argument("--max_new_tokens", type=int, default=64, help="Length budget of each completion.")
    parser.add_argument("--output_file", default=None, help="JSON lines file of prompt, completion, reference.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the judge's order shuffling.")
    return parser.parse_args(argv)


def make_judge(name: str, base_url: str | None, seed: int):
    from posttrain.judges import OpenAIPairwiseJudge, RewardModelJudge

    if name.startswith("openai:"):
        return OpenAIPairwiseJudge(name.split(":", 1)[1], base_url=base_url, seed=seed)
    return RewardModelJudge(name, seed=seed)


def main(argv=None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from posttrain.cli import load_dataset_arg
    from posttrain.eval import generate_completions
    from posttrain.judges import win_rate
    from posttrain.models.loading import load_causal_lm, load_tokenizer

    dataset = load_dataset_arg(args.dataset_name, args.dataset_split)
    missing = [c for c in ("prompt", args.reference_column) if c not in dataset.column_names]
    if missing:
        raise SystemExit(f"judge_tldr: dataset {args.dataset_name!r} has no column(s) {missing}; "
                         f"its columns are {dataset.column_names}")
    if args.num_examples is not None:
        dataset = dataset.select(range(min(args.num_examples, len(dataset))))
    prompts, references = list(dataset["prompt"]), list(dataset[args.reference_column])
    model = load_causal_lm(args.model_name_or_path)
    tokenizer = load_tokenizer(None, model=args.model_name_or_path)
    completions = generate_completions(model, tokenizer, prompts, args.max_new_tokens)
    result = win_rate(make_judge(args.judge_model, args.judge_base_url, args.seed), prompts, completions, references)
    if args.output_file:
        with open(args.output_file, "w") as handle:
            for p, c, r in zip(prompts, completions, references):
                handle.write(json.dumps({"prompt": p, "completion": c, "reference": r}) + "\n")
    print(f"model win rate: {result['win_rate'] * 100:.2f}% ({result['num_judged']} judged, "
          f"{result['num_ties']} ties, {result['num_failed']} failed)")
    return result


if __name__ == "__main__":
    main()
