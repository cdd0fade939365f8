"""The sampler is one loop over a backend: a backend written outside posttrain (here, in this file, and the
example of docs/sampler.md) plugs into `generate` and gives the built-in path's rollout for the same seed,
with the loop calling it as docs/sampler.md says; lock-step decoding makes as many `step` calls on a
process whose rows stopped early as on one that decodes to the end."""

import re
from pathlib import Path

import pytest
import torch

from posttrain.models import compat
from posttrain.rollout import generate as generate_module
from posttrain.rollout.backends import ModelForward, SamplerBackend
from posttrain.rollout.generate import SamplingConfig, generate

PROMPTS = ["reverse 1234 =", "Beautiful is better than ugly. Explicit is", "a"]
DOC = Path(__file__).resolve().parents[2] / "docs" / "sampler.md"


class CachedForward(SamplerBackend):
    """The model's forward over transformers' own DynamicCache, written against the interface only; it logs
    every call the loop makes."""

    def __init__(self, model):
        self.model, self.calls = model, []
        self.device = next(model.parameters()).device

    def __enter__(self):
        self.was_training = self.model.training
        self.model.eval()
        return self

    def __exit__(self, *exc):
        self.model.train(self.was_training)

    def prefill(self, prompt_ids, prompt_mask, positions):
        self.calls.append(("prefill", tuple(prompt_ids.shape)))
        out = self.model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True)
        self.cache = compat.output_cache(self.model, out)
        return out.logits[:, -1]

    def expand(self, group, capacity):
        self.calls.append(("expand", group, capacity))
        self.cache.batch_repeat_interleave(group)

    def step(self, tokens, t, attention, positions):
        self.calls.append(("step", t, len(tokens), attention.shape[1], positions[:, 0].tolist()))
        out = self.model(input_ids=tokens[:, None], attention_mask=attention, position_ids=positions,
                         **compat.cache_kwargs(self.model, self.cache), use_cache=True)
        self.cache = compat.output_cache(self.model, out)
        return out.logits[:, -1]

    def select(self, keep):
        self.calls.append(("select", keep.tolist()))
        self.cache.batch_select_indices(keep)


def _run(model_or_backend, tok, sampling, **kwargs):
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    return generate(model_or_backend, ids, sampling, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                    tokenizer=tok, generator=torch.Generator().manual_seed(7), **kwargs)


def _same_rollout(a, b):
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_mask, b.completion_mask)
    assert torch.equal(a.is_truncated, b.is_truncated)
    assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.prompt_mask, b.prompt_mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-5)


def _frequent_token(model, tok):
    """A token the model often produces greedily: as a stop token, rows stop at different steps."""
    greedy = _run(model, tok, SamplingConfig(max_new_tokens=16, do_sample=False))
    return torch.mode(greedy.completion_ids.flatten()).values.item()


STOPS = tuple(range(10, 1000, 7))  # a seventh of the tiny vocabulary: the random model's rows stop within a few tokens


@pytest.mark.parametrize("options", [
    dict(top_p=0.9, top_k=20, min_p=0.02, temperature=0.8),
    dict(repetition_penalty=1.3, temperature=1.3),
    dict(do_sample=False, repetition_penalty=1.2),
])
def test_a_backend_defined_here_gives_the_built_in_rollout(model, tok, options):
    sampling = SamplingConfig(max_new_tokens=14, num_generations=3, stop_token_ids=STOPS, **options)
    custom = CachedForward(model)
    mine = _run(custom, tok, sampling)
    built_in = _run(model, tok, sampling)  # on CPU: cpu_backend.CPUDecoder, the lean step for this Qwen2 model
    generic = _run(ModelForward(model), tok, sampling)
    _same_rollout(mine, built_in)
    _same_rollout(mine, generic)
    lengths = mine.completion_mask.sum(1)
    assert lengths.min() < lengths.max()  # rows stopped at different steps

    # the calls docs/sampler.md describes: one prefill of the B prompts, one expand, a step per token but the last
    B, P, G, C = len(PROMPTS), mine.prompt_ids.shape[1], 3, mine.completion_ids.shape[1]
    assert custom.calls[:2] == [("prefill", (B, P)), ("expand", G, P + 14)]
    steps = [c for c in custom.calls if c[0] == "step"]
    assert [c[1] for c in steps] == list(range(C - 1))  # token t is fed at step t
    first_new = [len(tok(p)["input_ids"]) for p in PROMPTS for _ in range(G)]  # each row's first new position
    live = list(range(B * G))  # the output rows being decoded
    for call in custom.calls[2:]:
        if call[0] == "select":  # dropped rows leave the batch
            assert len(call[1]) < len(live)
            live = [live[i] for i in call[1]]
        else:  # cache position P + t: the prompt and t earlier tokens visible, the row's own position id
            _, t, decoded, width, positions = call
            assert decoded == len(live) and width == P + t + 1
            assert positions == [first_new[row] + t for row in live]
    assert any(c[0] == "select" for c in custom.calls)


def test_stop_strings_and_tool_turns_go_through_any_backend(model, tok):
    """Stop strings and continue_turn are the loop's: a backend that knows nothing of them gets them too."""
    def continue_turn(rows, tokens):  # feed three ids after each even row's first turn
        return [[5, 6, 7] if i % 2 == 0 and len(ids) < 8 else None for i, ids in zip(rows, tokens)]

    sampling = SamplingConfig(max_new_tokens=16, num_generations=2, temperature=1.2, stop_strings=("e",))
    mine = _run(CachedForward(model), tok, sampling, continue_turn=continue_turn)
    built_in = _run(model, tok, sampling, continue_turn=continue_turn)
    _same_rollout(mine, built_in)
    assert torch.equal(mine.tool_mask, built_in.tool_mask) and mine.tool_mask.sum() > 0
    assert mine.completion_mask.sum(1).min() < mine.completion_ids.shape[1]  # some row stopped on the string


def test_the_documented_example_backend(model, tok):
    """docs/sampler.md's FullSequenceBackend (no cache: the whole sequence each step) samples what the built-in
    path samples."""
    (code,) = [block for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
               if "class FullSequenceBackend" in block]
    namespace = {}
    exec(compile(code, str(DOC), "exec"), namespace)
    sampling = SamplingConfig(max_new_tokens=10, num_generations=2, do_sample=False, stop_token_ids=(
        _frequent_token(model, tok),))
    mine = _run(namespace["FullSequenceBackend"](model), tok, sampling)
    _same_rollout(mine, _run(model, tok, sampling))
    sampled = SamplingConfig(max_new_tokens=10, num_generations=2, top_k=30)
    _same_rollout(_run(namespace["FullSequenceBackend"](model), tok, sampled), _run(model, tok, sampled))


def test_record_linears_is_the_backends_own(model, tok):
    """A backend that records nothing gives no record, whatever generate was asked."""
    out = _run(CachedForward(model), tok, SamplingConfig(max_new_tokens=3), record_linears=True)
    assert out.linear_outputs is None


class CountingForward(ModelForward):
    def __init__(self, model, lockstep):
        super().__init__(model)
        self.lockstep, self.steps = lockstep, 0

    def step(self, tokens, t, attention, positions):
        self.steps += 1
        return super().step(tokens, t, attention, positions)


@pytest.mark.parametrize("other_process_stops_at", [None, 3])
def test_lockstep_keeps_pace_with_a_process_still_decoding(model, tok, monkeypatch, other_process_stops_at):
    """One process, the other simulated by the flag's all-reduce: this process's rows all stop at their first
    token (the stop token is the greedy one), the other's decode to `other_process_stops_at` (None: the limit).
    This process keeps calling `step` (outputs discarded) until the other stops; its rollout is unchanged."""
    flags = []

    def any_rank(flag, device):  # this process's flag or-ed with the simulated other process's
        flags.append(flag)
        return flag or other_process_stops_at is None or len(flags) <= other_process_stops_at

    monkeypatch.setattr(generate_module, "_any_rank", any_rank)
    greedy = SamplingConfig(max_new_tokens=8, num_generations=2, do_sample=False)
    first = _run(model, tok, greedy).completion_ids[:, 0].unique().tolist()
    sampling = SamplingConfig(max_new_tokens=8, num_generations=2, do_sample=False, stop_token_ids=tuple(first))
    alone = _run(CountingForward(model, lockstep=False), tok, sampling)
    assert alone.completion_ids.shape[1] == 1 and not flags  # every row stopped at once; no flag without lock-step
    paced = CountingForward(model, lockstep=True)
    out = _run(paced, tok, sampling)
    _same_rollout(out, alone)
    if other_process_stops_at is None:
        assert paced.steps == 8 - 1  # as many as a process that decodes to max_new_tokens: all but the last token
    else:  # the other process stopped after its token `other_process_stops_at`, so its steps fed tokens 0..that - 1
        assert paced.steps == other_process_stops_at
    assert flags[0] is False and not any(flags)  # this process had stopped from the first token on
