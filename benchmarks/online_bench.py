"""Online RL throughput: GRPO and RLOO steps of the posttrain engine vs a straightforward loop.

Each step: 2 prompts x 4 generations x up to 32 new tokens, reward, advantages, one clipped-surrogate
update (fp32, AdamW). Each method runs in its own process (so peak memory is its own, and the
allocator setting of posttrain's trainers applies only to them), and the steps are interleaved:
one step of each process in turn, round after round, so that a change in machine speed hits all
methods alike. Reported: samples/s over the timed rounds and the peak
resident memory. The first rounds are warm-up (`--warmup`, default 2): every method's first steps
pay one-time costs (the optimizer's state, the heap growing to its working size; the straightforward
loop's first timed step was 2-3 s slower than its later ones with one warm-up round), and a training
run of many steps is dominated by the steady state.

  ours-grpo    GRPOTrainer.training_step. Sampling (`rollout.generate`): one prefill per prompt, the KV
               cache expanded to the group (with room for every new token), all 8 rows decoded
               together through the lean decoding step (`accel/decode.py`) whose products run in
               the few-rows kernel (`accel/few_rows.py`, each weight streamed once per step), the
               token log-probs kept. Training forward (`completion_logprobs`): each prompt and its 4
               completions form one sequence with a block attention mask, so the prompt is computed
               (and back-propagated) once per group and every weight once, logits only at the 32
               scoring positions of each completion, entropy from the same log-softmax pass; the
               policy has not moved since sampling, so every decoder layer's linear outputs are
               the sampler's, recorded while decoding, and only the backward multiplies
               (`accel/replay.py`). No old-log-prob pass (ratio = 1 from the detached current
               log-probs), no reference model (beta = 0)
  ours-rloo    RLOOTrainer.training_step, the same with the KL penalty in the reward: one extra
               no-grad reference forward (beta = 0.05), also one sequence per prompt group
  baseline-grpo  the straightforward loop: one transformers `model.generate` call for the left-padded
               batch with num_return_sequences (every row prefills its own copy of the prompt), a
               no-grad forward for the old-policy log-probs, then the forward and backward of the
               update; full-sequence logits and a full-vocabulary log_softmax in every pass
  baseline-rloo  the same plus a no-grad forward of a reference copy for the KL penalty in the
               reward (kl_coef 0.05) and the leave-one-out baseline: what RLOO has to compute
Each ours-X is compared with baseline-X.

    python benchmarks/online_bench.py [--model posttrain/smollm2-135m-instruct] [--steps 3] [--warmup 2]
"""

from __future__ import annotations

import argparse
import resource
import time

PROMPTS = ["Write a short story about a dragon who learns to cook.",
           "Explain, step by step, how a bicycle works."]
NUM_GENERATIONS, NEW_TOKENS = 4, 32


def length_reward(completions, **kwargs):
    """Characters / 100; a conversational completion is a list of messages: its text is scored."""
    return [len(c[-1]["content"] if isinstance(c, list) else c) / 100 for c in completions]


def _dataset():
    from datasets import Dataset

    return Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS] * 32)  # 32 steps


def ours(model_name: str, algo: str):
    """A function doing one GRPO or RLOO training step (sample, score, update) with posttrain."""
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
    from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

    common = dict(output_dir="/tmp/online_bench", per_device_train_batch_size=len(PROMPTS) * NUM_GENERATIONS,
                  num_generations=NUM_GENERATIONS, max_completion_length=NEW_TOKENS, learning_rate=1e-6,
                  report_to="none", disable_tqdm=True, shuffle_dataset=False, temperature=1.0)
    if algo == "grpo":
        trainer = GRPOTrainer(model_name, length_reward, args=GRPOConfig(**common), train_dataset=_dataset())
    else:
        trainer = RLOOTrainer(model_name, length_reward, args=RLOOConfig(**common, num_ppo_epochs=1),
                              train_dataset=_dataset())
    trainer.create_optimizer_and_scheduler(num_training_steps=1000)
    batches = iter(trainer.get_train_dataloader())

    def step() -> float:
        trainer.training_step(trainer.model, next(batches))
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()
        return trainer.recorded_metrics()["completions/mean_length"][-1]

    return step


def straightforward(model_name: str, algo: str):
    """A function doing one step of the straightforward loop; returns the mean completion length."""
    import torch

    from posttrain.models.loading import load_causal_lm, load_tokenizer

    model = load_causal_lm(model_name)
    ref = load_causal_lm(model_name).eval().requires_grad_(False) if algo == "rloo" else None
    tok = load_tokenizer(None, model=model_name)
    tok.padding_side = "left"
    optim = torch.optim.AdamW(model.parameters(), lr=1e-6)
    prompts = tok.apply_chat_template([[{"role": "user", "content": p}] for p in PROMPTS], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True, padding=True)
    P = prompts["input_ids"].shape[1]

    def token_logprobs(net, ids, attention):  # full-vocabulary log_softmax, then the taken tokens
        logps = torch.log_softmax(net(input_ids=ids, attention_mask=attention).logits[:, :-1], -1)
        return logps.gather(-1, ids[:, 1:, None]).squeeze(-1)

    def step() -> float:
        model.eval()
        with torch.no_grad():  # one generate call for the batch; the group via num_return_sequences
            ids = model.generate(**prompts, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=NEW_TOKENS,
                                 num_return_sequences=NUM_GENERATIONS, pad_token_id=tok.pad_token_id)
        completion = ids[:, P:]
        done = (completion == tok.eos_token_id).int().cumsum(1)
        comp_mask = ((done == 0) | ((done == 1) & (completion == tok.eos_token_id))).long()
        texts = tok.batch_decode([c[m.bool()] for c, m in zip(completion, comp_mask)], skip_special_tokens=True)
        scores = torch.tensor(length_reward(texts))
        attention = torch.cat([prompts["attention_mask"].repeat_interleave(NUM_GENERATIONS, 0), comp_mask], 1)
        mask = torch.cat([torch.zeros(len(ids), P - 1), comp_mask.float()], 1)  # scores the completion tokens
        model.train()
        with torch.no_grad():  # old-policy log-probs: a separate pass
            old = token_logprobs(model, ids, attention)
            if ref is not None:  # RLOO: -kl_coef * sum KL(pi || ref) joins the score
                kl = ((old - token_logprobs(ref, ids, attention)) * mask).sum(1)
                scores = scores - 0.05 * kl
        rewards = scores.view(len(PROMPTS), NUM_GENERATIONS)
        if ref is None:  # GRPO: group-normalised advantages
            adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
        else:  # RLOO: leave-one-out baseline
            adv = rewards - (rewards.sum(1, keepdim=True) - rewards) / (NUM_GENERATIONS - 1)
        adv = adv.flatten()[:, None]
        ratio = torch.exp(token_logprobs(model, ids, attention) - old)
        loss_tok = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        loss = (loss_tok * mask).sum() / mask.sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        return float(comp_mask.sum(1).float().mean())

    return step


def worker(method: str, model_name: str, conn):
    import torch

    torch.manual_seed(0)
    kind, algo = method.split("-")
    step = straightforward(model_name, algo) if kind == "baseline" else ours(model_name, algo)
    conn.send("ready")
    while conn.recv():
        start = time.perf_counter()
        length = step()
        conn.send({"seconds": time.perf_counter() - start, "length": length,
                   "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="posttrain/smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per method, after the warm-up")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    args = parser.parse_args()
    import multiprocessing as mp

    methods = ("baseline-grpo", "baseline-rloo", "ours-grpo", "ours-rloo")
    context = mp.get_context("spawn")
    conns, procs = {}, []
    for method in methods:  # loaded one after another, so that loading does not overlap the steps
        parent, child = context.Pipe()
        proc = context.Process(target=worker, args=(method, args.model, child), daemon=True)
        proc.start()
        procs.append(proc)
        if parent.recv() != "ready":
            raise SystemExit(f"{method} failed to start")
        conns[method] = parent
    rows = {m: {"seconds": [], "lengths": [], "peak_rss_mib": 0.0} for m in methods}
    for round_ in range(args.warmup + args.steps):
        for method in methods:  # one step of each in turn: a change in machine speed hits all alike
            conns[method].send(True)
            r = conns[method].recv()
            if round_ >= args.warmup:
                rows[method]["seconds"].append(r["seconds"])
                rows[method]["lengths"].append(r["length"])
            rows[method]["peak_rss_mib"] = r["peak_rss_mib"]
    for conn, proc in zip(conns.values(), procs):
        conn.send(False)
        proc.join()
    from rich.console import Console
    from rich.table import Table

    samples = len(PROMPTS) * NUM_GENERATIONS
    table = Table(title=f"online RL step on {args.model}: {len(PROMPTS)} prompts x {NUM_GENERATIONS} generations x "
                        f"<= {NEW_TOKENS} new tokens, fp32, {args.steps} timed steps each, interleaved")
    for col in ("method", "samples/s", "s/step", "mean completion tokens", "peak RSS (MiB)", "vs baseline"):
        table.add_column(col, justify="right" if col != "method" else "left", no_wrap=col == "method")
    rate = {m: samples * args.steps / sum(r["seconds"]) for m, r in rows.items()}
    for method, r in rows.items():
        table.add_row(method, f"{rate[method]:.2f}", f"{samples / rate[method]:.2f}",
                      f"{sum(r['lengths']) / args.steps:.1f}", f"{r['peak_rss_mib']:.0f}",
                      f"{rate[method] / rate['baseline-' + method.split('-')[1]]:.2f}x")
    Console().print(table)
    print("seconds per step:", {m: [round(x, 2) for x in r["seconds"]] for m, r in rows.items()})


if __name__ == "__main__":
    main()
