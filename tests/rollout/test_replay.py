"""The sampler's record of linear outputs (accel/replay.py): what it holds, how it is laid out, and that a
training forward that replays it gives the log-probs and gradients of the ordinary forward."""

import pytest
import torch
from tests.helpers.rollout import varied

from posttrain.accel import decode, few_rows
from posttrain.accel.decode import layer_linears
from posttrain.accel.replay import LinearRecord, _KnownLinear, replaying
from posttrain.forward import completions as completions_module
from posttrain.forward.completions import completion_logprobs
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.rollout.generate import SamplingConfig, generate

PROMPTS = ["reverse 1234 =", "Beautiful is better than ugly. Explicit is", "a"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("posttrain/tiny-qwen2")


def rollout_with_early_stops(model, tok, num_generations=4, max_new_tokens=12):
    """A recorded rollout in which some rows stop early (and are dropped from the decoding batch): the tokens
    that the first row of each group samples at step 3 are made stop tokens, and the same seed samples again."""
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, num_generations=num_generations, temperature=1.5)
    args = dict(pad_token_id=tok.pad_token_id, eos_token_id=None)
    free = generate(model, ids, sampling, generator=torch.Generator().manual_seed(5), **args)
    sampling.stop_token_ids = tuple(free.completion_ids[::num_generations, 3].tolist())
    return generate(model, ids, sampling, generator=torch.Generator().manual_seed(5), record_linears=True, **args)


def module_outputs(model, ids, attention, positions):
    """Every recorded module's output in a plain no-grad forward: per layer, per kind (B, T, width)."""
    outputs = [[None] * 7 for _ in layer_linears(model)]
    hooks = [module.register_forward_hook(lambda m, i, o, l=l, j=j: outputs[l].__setitem__(j, o.detach()))
             for l, modules in enumerate(layer_linears(model)) for j, module in enumerate(modules)]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False)
    for hook in hooks:
        hook.remove()
    return outputs


def close(got, want):
    """Equal up to float32 rounding, relative to the size of the values (summation orders differ)."""
    scale = float(want.abs().amax()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * max(1.0, scale))


@pytest.mark.parametrize("name", ["posttrain/tiny-llama", "posttrain/tiny-qwen2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("compiled", [True, False])  # the C step, or its torch-ops twin
def test_record_holds_what_each_linear_layer_returns(name, compiled, tok, monkeypatch):
    if compiled and not few_rows.available():
        pytest.skip("no C compiler: the compiled step cannot be built")
    if not compiled:
        monkeypatch.setattr(decode, "_c_step_function", lambda: None)
    model = varied(name)
    G = 4
    out = rollout_with_early_stops(model, tok, num_generations=G)
    record = out.linear_outputs
    assert record is not None and record.group == G
    lengths = out.completion_mask.sum(1)
    assert lengths.min() < lengths.max()  # rows stopped at different steps (and were dropped)
    N, C = out.completion_ids.shape
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    # the sampler's view: the prompt's real tokens, then every new position
    attention = torch.cat([out.prompt_mask, torch.ones_like(out.completion_ids)], 1)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    expected = module_outputs(model, ids, attention, positions)
    P = out.prompt_ids.shape[1]
    checked = 0
    for layer in range(len(expected)):
        for kind in range(7):
            want = expected[layer][kind]
            for row in range(N):
                real = out.prompt_mask[row].bool()
                got = record.prompt(layer, kind)[row // G]
                close(got[real], want[row, :P][real])
                # completion tokens fed back: every token before the row's stop (its stop token may have been
                # dropped with the row, and the last step's token is never fed)
                fed = min(int(lengths[row]) - 1, C - 1)
                close(record.completion(layer, kind)[row, :fed], want[row, P:P + fed])
                checked += fed
            assert torch.all(record.completion(layer, kind)[:, C - 1:] == 0)  # never fed: zeros
    assert checked > 0


def test_no_record_unless_asked_or_possible(tok):
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    args = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model = load_causal_lm("posttrain/tiny-llama")
    assert generate(model, ids, SamplingConfig(max_new_tokens=3), **args).linear_outputs is None
    double = load_causal_lm("posttrain/tiny-llama").double()  # no lean step for float64 weights
    assert generate(double, ids, SamplingConfig(max_new_tokens=3), record_linears=True, **args).linear_outputs is None
    assert not any(m._forward_hooks for m in model.modules())  # the prefill's hooks are gone


def _subset_like_a_micro_batch(out, rows):
    """Rows of a rollout with all-padding prompt columns and completion columns past the longest dropped."""
    p_ids, p_mask = out.prompt_ids[rows], out.prompt_mask[rows]
    c_ids, c_mask = out.completion_ids[rows], out.completion_mask[rows]
    start = int(p_mask.any(0).nonzero()[0])
    width = int(c_mask.sum(1).max())
    return p_ids[:, start:], p_mask[:, start:], c_ids[:, :width], c_mask[:, :width]


@pytest.mark.parametrize("name", ["posttrain/tiny-llama", "posttrain/tiny-qwen2"])
@pytest.mark.parametrize("rows, packed, trimmed", [
    (list(range(12)), True, False),          # every group whole: one packed sequence per prompt
    ([8, 9, 10, 11, 0, 1], True, True),      # prompt 1 (the longest) left out: padding columns dropped
    ([0, 9, 3], False, True),                # a pair sharing a prompt, a row alone: the plain forward is cheaper
    ([0, 4, 8], False, False),               # no shared prompt: the plain (rows, prompt + completion) forward
])
def test_replayed_forward_gives_the_same_logprobs_and_gradients(name, rows, packed, trimmed, tok, monkeypatch):
    model = varied(name)
    out = rollout_with_early_stops(model, tok)
    rows = torch.tensor(rows)
    batch = _subset_like_a_micro_batch(out, rows)
    assert (batch[0].shape[1] < out.prompt_ids.shape[1]) == trimmed
    plain_calls = []
    monkeypatch.setattr(completions_module, "token_logprobs",
                        lambda *a, real=completions_module.token_logprobs, **k: plain_calls.append(1) or real(*a, **k))
    model.train()
    results = []
    for replay in (None, (out.linear_outputs, rows)):
        logp, entropy = completion_logprobs(model, *batch, temperature=0.9, with_entropy=True, replay=replay)
        weights = torch.linspace(-1, 1, logp.numel()).view_as(logp)  # a loss that weighs every token differently
        (logp * weights * batch[3]).sum().backward()
        results.append((logp.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}))
        model.zero_grad(set_to_none=True)
    (logp0, ent0, grads0), (logp1, ent1, grads1) = results
    assert len(plain_calls) == (0 if packed else 2)
    mask = batch[3].bool()
    torch.testing.assert_close(logp1[mask], logp0[mask], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ent1[mask], ent0[mask], rtol=1e-4, atol=1e-4)
    for n in grads0:
        assert grads0[n].abs().sum() > 0, n
        torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-3, atol=1e-4 * grads0[n].abs().max().item(),
                                   msg=lambda m, n=n: f"{n}: {m}")


def test_known_linear_backward_is_the_linear_layers_float64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, generator=g, requires_grad=True)
    upstream = torch.randn(3, 5, 6, dtype=torch.float64, generator=g)
    with torch.no_grad():
        y = x @ w.t() + b
    out = _KnownLinear.apply(x, w, b, y)
    assert out.data_ptr() == y.data_ptr()  # nothing computed: the given output
    out.backward(upstream)
    got = x.grad.clone(), w.grad.clone(), b.grad.clone()
    # by hand: dx = g W, dW = sum over rows of g^T x, db = sum of g
    flat_g, flat_x = upstream.reshape(-1, 6), x.detach().reshape(-1, 4)
    want = upstream @ w.detach(), flat_g.t() @ flat_x, flat_g.sum(0)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    x.grad = None
    _KnownLinear.apply(x, w.detach(), None, y).backward(upstream)  # no bias, frozen weight
    torch.testing.assert_close(x.grad, upstream @ w.detach(), rtol=1e-12, atol=1e-12)


def test_layout_by_hand():
    """One layer, kinds of widths 1 and 2; prompt positions p hold 10 * prompt + p, completion positions
    t hold 100 * (row + 1) + t (second kind: the same plus 0.5)."""
    modules = [[torch.nn.Linear(2, 1), torch.nn.Linear(2, 2)]]
    record = LinearRecord(modules, prompts=2, prompt_length=3, rows=4, steps=3, group=2)
    for kind, offset in ((0, 0.0), (1, 0.5)):
        for b in range(2):
            record.prompt(0, kind)[b] = (10 * b + torch.arange(3.0))[:, None] + offset
        for n in range(4):
            record.completion(0, kind)[n] = (100 * (n + 1) + torch.arange(3.0))[:, None] + offset
    # two sequences: rows 3 and (empty) of prompt 1, then row 0 alone; last 2 prompt columns, 2 completion positions
    layout = record.layout(torch.tensor([[3, -1], [0, -1]]), prompt_width=2, completion_width=2)
    assert layout.shape == (2, 6)
    first, second = record.output(0, 0, layout), record.output(1, 0, layout)
    assert first.shape == (2, 6, 1) and second.shape == (2, 6, 2)
    want = torch.tensor([[11, 12, 400, 401, 0, 0], [1, 2, 100, 101, 0, 0]], dtype=torch.float32)
    assert torch.equal(first[:, :, 0], want)
    want_second = torch.where(want == 0, 0.0, want + 0.5)
    assert torch.equal(second[:, :, 0], want_second) and torch.equal(second[:, :, 1], want_second)
    with pytest.raises(ValueError, match="holds 3 prompt and 3 completion positions"):
        record.layout(torch.tensor([[0]]), prompt_width=4, completion_width=1)
    with pytest.raises(ValueError, match="sequence 1 has no filled block"):
        record.layout(torch.tensor([[0, 1], [-1, -1]]), prompt_width=1, completion_width=1)


def test_replaying_refuses_a_forward_of_another_layout():
    model = load_causal_lm("posttrain/tiny-llama")
    record = LinearRecord(layer_linears(model), prompts=1, prompt_length=4, rows=1, steps=2, group=1)
    layout = record.layout(torch.tensor([[0]]), prompt_width=4, completion_width=2)
    with replaying(record, layout), pytest.raises(RuntimeError, match="does not match the record's layout"):
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert not any("forward" in m.__dict__ for modules in record.modules for m in modules)  # restored


def test_last_use_lets_each_layer_go_as_the_forward_reads_it(tok):
    """With the last-use flag, each decoder layer's part of the record is freed once the forward has read it
    (the record's bytes fall layer by layer while the forward runs, to none at its end), and the log-probs,
    entropies and gradients are bit for bit those of a replay that keeps the record."""
    from torch.multiprocessing.reductions import StorageWeakRef

    model = varied("posttrain/tiny-llama")
    out = rollout_with_early_stops(model, tok)
    record, rows = out.linear_outputs, torch.arange(12)
    batch = _subset_like_a_micro_batch(out, rows)
    full = record.nbytes
    per_layer = full // len(record.layers)
    assert full == sum(t.nbytes for t in record.layers) > 0
    completion_logprobs(model, *batch)  # the output layer's one-off check (`plain_lm_head`) runs here, unhooked
    held = []  # the record's bytes as each decoder layer starts its forward
    hooks = [layer.register_forward_pre_hook(lambda m, a: held.append(record.nbytes)) for layer in model.model.layers]
    model.train()
    results = []
    for last in (False, True):
        held.clear()
        storages = [StorageWeakRef(t.untyped_storage()) for t in record.layers]
        logp, entropy = completion_logprobs(model, *batch, temperature=0.9, with_entropy=True,
                                            replay=(record, rows, last))
        weights = torch.linspace(-1, 1, logp.numel()).view_as(logp)
        (logp * weights * batch[3]).sum().backward()
        results.append((logp.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}))
        model.zero_grad(set_to_none=True)
        if not last:
            assert held == [full] * len(model.model.layers) and record.nbytes == full  # kept for a later use
        else:
            # layer l starts with layers 0..l-1 gone; after the forward nothing is left, and no view keeps it alive
            assert held == [full - l * per_layer for l in range(len(model.model.layers))]
            assert record.nbytes == 0 and all(s.expired() for s in storages)
    for hook in hooks:
        hook.remove()
    (logp0, ent0, grads0), (logp1, ent1, grads1) = results
    assert torch.equal(logp1, logp0) and torch.equal(ent1, ent0)
    for n in grads0:
        assert torch.equal(grads1[n], grads0[n]), n
    with pytest.raises(RuntimeError, match="layer 0 of the record was let go after its last use"):
        record.output(0, 0, record.layout(rows[:1, None], 1, 1))


def test_the_cpu_backend_keeps_the_record_until_its_last_rows_are_read(tok):
    """The record is the sampler backend's (`cpu_backend.keep_record`): it serves rollout rows until every row has
    been read once, the read of the last rows is the last use (the forward lets it go), and a new keep or None
    replaces it; another model's record is separate."""
    from posttrain.rollout.cpu_backend import holds_record, keep_record, replay_rows

    model, other = varied("posttrain/tiny-llama"), varied("posttrain/tiny-qwen2")
    out = rollout_with_early_stops(model, tok)  # 3 prompts x 4 samples: 12 rollout rows
    record = out.linear_outputs
    assert replay_rows(model, torch.arange(4)) is None and not holds_record(model)  # nothing kept yet
    keep_record(model, record)
    assert holds_record(model) and not holds_record(other)
    first = replay_rows(model, torch.arange(0, 8))
    assert first[0] is record and torch.equal(first[1], torch.arange(0, 8)) and first[2] is False
    assert holds_record(model)  # 4 rows left to read
    last = replay_rows(model, torch.arange(8, 12))
    assert last[0] is record and last[2] is True  # the last use: the forward lets the record go layer by layer
    assert not holds_record(model) and replay_rows(model, torch.arange(4)) is None  # no longer kept
    keep_record(model, record)
    keep_record(model, None)  # a new generation batch (or a restored one) lets the kept record go
    assert not holds_record(model)


@pytest.mark.parametrize("name", ["posttrain/tiny-llama", "posttrain/tiny-qwen2"])
def test_record_of_prompts_repeated_anywhere_replays_the_same_logprobs(name, tok):
    """Alternating prompts (each prefilled once, its cache copied to its rows): the record holds each distinct
    prompt once with each row's prompt (`source`), and the replayed forward gives the ordinary one's log-probs."""
    model = varied(name)
    a, b = (tok(p)["input_ids"] for p in PROMPTS[:2])
    sampling = SamplingConfig(max_new_tokens=8, num_generations=1, temperature=1.5)
    out = generate(model, [a, b, a, b, a], sampling, pad_token_id=tok.pad_token_id, eos_token_id=None,
                   generator=torch.Generator().manual_seed(2), record_linears=True)
    record = out.linear_outputs
    assert record.shape[:3] == (2, out.prompt_ids.shape[1], 5) and record.source.tolist() == [0, 1, 0, 1, 0]
    assert record.group is None
    batch = (out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask)
    plain, _ = completion_logprobs(model, *batch, temperature=1.5)
    replayed, _ = completion_logprobs(model, *batch, temperature=1.5, replay=(record, torch.arange(5)))
    mask = out.completion_mask.bool()
    torch.testing.assert_close(replayed[mask], plain[mask], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.logprobs[mask], plain[mask], rtol=1e-4, atol=1e-4)  # the sampler's own
