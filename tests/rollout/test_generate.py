"""The sampler: parity with transformers' greedy generate, log-probs equal to a full forward,
stop handling, filtering by hand numbers, the shared-prefill layout, PEFT."""

import pytest
import torch

from posttrain.forward import completions as completions_module
from posttrain.forward.completions import completion_logprobs
from posttrain.forward.logprobs import token_logprobs
from posttrain.models.loading import load_causal_lm
from posttrain.rollout.generate import Rollout, SamplingConfig, _sample, filter_logits, generate

PROMPTS = ["reverse 1234 =", "Beautiful is better than ugly. Explicit is", "a", "add 12 7 ="]


@pytest.fixture(scope="module")
def prompt_ids(tok):
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    assert len({len(i) for i in ids}) == len(ids)  # different lengths: left padding matters
    return ids


def hf_greedy(model, tok, ids, max_new_tokens, eos_token_id):
    tok.padding_side = "left"
    enc = tok.pad({"input_ids": ids}, return_tensors="pt")
    tok.padding_side = "right"
    out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                         eos_token_id=eos_token_id)
    return out[:, enc["input_ids"].shape[1]:]


def full_forward_logprobs(model, r: Rollout, temperature):
    ids = torch.cat([r.prompt_ids, r.completion_ids], 1)
    mask = torch.cat([r.prompt_mask, r.completion_mask], 1)
    with torch.no_grad():  # left padding: token_logprobs derives position_ids from the mask
        logps, _, _ = token_logprobs(model, ids, mask, r.completion_ids.shape[1], temperature=temperature)
    return logps


def test_greedy_matches_transformers_generate(model, tok, prompt_ids):
    r = generate(model, prompt_ids, SamplingConfig(max_new_tokens=12, do_sample=False),
                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    ref = hf_greedy(model, tok, prompt_ids, 12, tok.eos_token_id)
    assert torch.equal(r.completion_ids, ref)
    assert r.is_truncated.all() and r.completion_mask.all()


def test_greedy_with_stop_matches_transformers_and_masks_the_stop(model, tok, prompt_ids):
    free = generate(model, prompt_ids, SamplingConfig(max_new_tokens=12, do_sample=False),
                    pad_token_id=tok.pad_token_id, eos_token_id=None)
    eos = int(free.completion_ids[0, 4])  # a token row 0 emits at step 4: make it the EOS
    r = generate(model, prompt_ids, SamplingConfig(max_new_tokens=12, do_sample=False),
                 pad_token_id=tok.pad_token_id, eos_token_id=[eos])
    ref = hf_greedy(model, tok, prompt_ids, 12, eos)
    C = r.completion_ids.shape[1]
    assert torch.equal(r.completion_ids, ref[:, :C])
    assert (ref[:, C:] == tok.pad_token_id).all()
    for row, ids, mask, trunc in zip(free.completion_ids, r.completion_ids, r.completion_mask, r.is_truncated):
        hits = (row == eos).nonzero().flatten().tolist()
        if hits:  # mask ends AT the first stop token; pad after; not truncated
            k = hits[0]
            assert mask.tolist() == [1] * (k + 1) + [0] * (C - k - 1)
            assert ids[k] == eos and (ids[k + 1:] == tok.pad_token_id).all() and not trunc
        else:
            assert mask.all() and trunc
    assert not r.is_truncated[0] and r.completion_mask[0].sum() <= 5
    assert (r.logprobs[r.completion_mask == 0] == 0).all()


def test_stop_token_ids_act_like_eos(model, tok, prompt_ids):
    free = generate(model, prompt_ids, SamplingConfig(max_new_tokens=12, do_sample=False),
                    pad_token_id=tok.pad_token_id, eos_token_id=None)
    stop = int(free.completion_ids[1, 3])
    a = generate(model, prompt_ids, SamplingConfig(max_new_tokens=12, do_sample=False, stop_token_ids=(stop,)),
                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    b = generate(model, prompt_ids, SamplingConfig(max_new_tokens=12, do_sample=False),
                 pad_token_id=tok.pad_token_id, eos_token_id=[tok.eos_token_id, stop])
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.completion_mask, b.completion_mask)
    assert not a.is_truncated[1]


def test_logprobs_equal_an_independent_full_forward(model, tok, prompt_ids):
    free = generate(model, prompt_ids, SamplingConfig(max_new_tokens=12, do_sample=False),
                    pad_token_id=tok.pad_token_id, eos_token_id=None)
    eos = int(free.completion_ids[2, 5])  # some rows stop early: padding inside the batch
    for temperature in (1.0, 0.7):
        r = generate(model, prompt_ids, SamplingConfig(max_new_tokens=12, temperature=temperature, top_k=50,
                                                       top_p=0.9, num_generations=2),
                     pad_token_id=tok.pad_token_id, eos_token_id=eos, generator=torch.Generator().manual_seed(1))
        ref = full_forward_logprobs(model, r, temperature)
        real = r.completion_mask.bool()
        # float32 sums taken in another order (the decoding kernels vs a full forward): logits agree to
        # ~1e-6 relative, which the log-softmax of this model's large logits turns into up to ~3e-5
        torch.testing.assert_close(r.logprobs[real], ref[real], rtol=1e-4, atol=1e-5)
        assert (r.logprobs[~real] == 0).all() and (r.logprobs[real] < 0).all()


def test_stop_strings(model, tok, prompt_ids):
    free = generate(model, prompt_ids, SamplingConfig(max_new_tokens=12, do_sample=False),
                    pad_token_id=tok.pad_token_id, eos_token_id=None)
    row = free.completion_ids[0].tolist()
    text = tok.decode(row, skip_special_tokens=True)
    stop = text[len(tok.decode(row[:3])) - 1: len(tok.decode(row[:5]))].strip() or text[-3:]
    # the first k with the stop string inside decode(row[:k]) is where the mask must end
    k = next(k for k in range(1, len(row) + 1) if stop in tok.decode(row[:k], skip_special_tokens=True))
    r = generate(model, prompt_ids, SamplingConfig(max_new_tokens=12, do_sample=False, stop_strings=(stop,)),
                 pad_token_id=tok.pad_token_id, eos_token_id=None, tokenizer=tok)
    assert 1 < k < len(row), (stop, k)
    assert r.completion_mask[0].tolist()[: k + 1] == [1] * k + [0] * (r.completion_mask.shape[1] > k)
    assert r.completion_ids[0, :k].tolist() == row[:k] and not r.is_truncated[0]
    assert (r.completion_ids[0, k:] == tok.pad_token_id).all()
    with pytest.raises(ValueError, match="tokenizer"):
        generate(model, prompt_ids, SamplingConfig(stop_strings=("x",)), pad_token_id=0, eos_token_id=None)


def test_top_k_1_equals_greedy(model, tok, prompt_ids):
    greedy = generate(model, prompt_ids, SamplingConfig(max_new_tokens=10, do_sample=False),
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    top1 = generate(model, prompt_ids, SamplingConfig(max_new_tokens=10, top_k=1, temperature=1.3),
                    pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                    generator=torch.Generator().manual_seed(3))
    assert torch.equal(greedy.completion_ids, top1.completion_ids)


def test_filter_logits_by_hand():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.2, 0.1])  # sorted: 0.5, 0.2, 0.15, 0.1, 0.05
    logits = torch.stack([probs.log(), probs.log() + 3.0])  # a shift changes nothing

    def kept(**kw):
        out = filter_logits(logits, **kw)
        assert torch.equal(torch.isfinite(out[0]), torch.isfinite(out[1]))
        finite = torch.isfinite(out[0])
        assert torch.equal(out[0][finite], logits[0][finite])  # survivors untouched
        return sorted(probs[finite].tolist(), reverse=True)

    assert kept() == pytest.approx([0.5, 0.2, 0.15, 0.1, 0.05])
    assert kept(top_k=2) == pytest.approx([0.5, 0.2])
    assert kept(top_p=0.6) == pytest.approx([0.5, 0.2])  # mass before 0.2 is 0.5 < 0.6; before 0.15 is 0.7
    assert kept(top_p=0.75) == pytest.approx([0.5, 0.2, 0.15])  # mass before 0.1 is 0.85 >= 0.75
    assert kept(top_p=0.3) == pytest.approx([0.5])  # the top token always stays
    assert kept(min_p=0.25) == pytest.approx([0.5, 0.2, 0.15])  # p >= 0.125
    assert kept(min_p=0.5) == pytest.approx([0.5])  # p >= 0.25
    # top-p acts on the top-k distribution: 0.5, 0.2, 0.15 renormalised by 0.85 -> mass before 0.15 is 0.82
    assert kept(top_k=3, top_p=0.8) == pytest.approx([0.5, 0.2])
    assert kept(top_k=3, top_p=0.85) == pytest.approx([0.5, 0.2, 0.15])


def torch_sort_top_p(logits, top_p):
    """filter_logits' top-p as it was written on torch.sort alone: the reference of the radix sort's."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    drop_sorted = probs.cumsum(-1) - probs >= top_p
    drop_sorted[..., 0] = False
    return logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


def test_top_p_by_radix_sort_equals_torch_sort():
    from posttrain.accel import few_rows

    if few_rows.stable_sort_descending(torch.zeros(1, 4)) is None:
        pytest.skip("no compiled kernels here: filter_logits sorts with torch.sort itself")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4096, generator=gen) * 3
    values, indices = few_rows.stable_sort_descending(x)
    assert torch.equal(values, torch.sort(x, dim=-1, descending=True).values)
    assert torch.equal(indices, torch.sort(x, dim=-1, descending=True, stable=True).indices)
    for top_p in (0.3, 0.9, 0.95, 0.999):
        assert torch.equal(filter_logits(x, top_p=top_p), torch_sort_top_p(x, top_p))
        assert torch.equal(filter_logits(x, top_k=50, top_p=top_p), torch_sort_top_p(filter_logits(x, top_k=50),
                                                                                     top_p))
    # logits on a coarse grid: many equal values, some on both sides of the cut (then torch.sort's order decides),
    # infinities, signed zeros; a row with a NaN is sorted by torch
    coarse = (x * 2).round() / 2
    coarse[:, ::97] = float("-inf")
    with_nan = coarse.clone()
    with_nan[3, 5] = float("nan")
    assert few_rows.stable_sort_descending(with_nan) is None
    for top_p in (0.5, 0.8, 0.9, 0.95):
        for logits in (coarse, with_nan):
            assert torch.equal(filter_logits(logits, top_p=top_p).isfinite(),
                               torch_sort_top_p(logits, top_p).isfinite())


def test_top_p_samples_equal_those_of_torch_sort(model, tok, prompt_ids, monkeypatch):
    from posttrain.rollout import generate as generate_module

    sampling = SamplingConfig(max_new_tokens=12, temperature=1.3, top_p=0.9, num_generations=3)
    kw = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    radix = [generate(model, prompt_ids, sampling, generator=torch.Generator().manual_seed(s), **kw) for s in range(3)]
    monkeypatch.setattr(generate_module, "sort_descending",
                        lambda x: (*torch.sort(x, dim=-1, descending=True), False))
    for s, r in enumerate(radix):
        ref = generate(model, prompt_ids, sampling, generator=torch.Generator().manual_seed(s), **kw)
        assert torch.equal(r.completion_ids, ref.completion_ids) and torch.equal(r.logprobs, ref.logprobs)


def test_sampler_frequencies_follow_the_distribution():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    logits = probs.log().expand(20000, 4)
    draws = _sample(logits, torch.rand(len(logits), generator=torch.Generator().manual_seed(0)))
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    assert freq[1] == 0
    assert torch.allclose(freq, probs, atol=0.015)


def test_num_generations_layout_and_shared_prefill(model, tok, prompt_ids):
    G = 3
    kw = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    sampling = SamplingConfig(max_new_tokens=8, num_generations=G, temperature=1.2)
    r = generate(model, prompt_ids, sampling, generator=torch.Generator().manual_seed(7), **kw)
    N = len(prompt_ids) * G
    assert r.prompt_ids.shape[0] == r.completion_ids.shape[0] == r.logprobs.shape[0] == N
    for i, ids in enumerate(prompt_ids):
        rows = slice(i * G, (i + 1) * G)
        for g in range(G):  # prompt-major: rows i*G .. i*G+G-1 hold prompt i
            assert r.prompt_ids[i * G + g][r.prompt_mask[i * G + g].bool()].tolist() == ids
        assert len({tuple(c.tolist()) for c in r.completion_ids[rows]}) > 1  # samples differ
    # one prefill per prompt then an expanded cache == prefilling every repeated row
    repeated = [ids for ids in prompt_ids for _ in range(G)]
    s1 = SamplingConfig(max_new_tokens=8, num_generations=1, temperature=1.2)
    ref = generate(model, repeated, s1, generator=torch.Generator().manual_seed(7), **kw)
    assert torch.equal(r.completion_ids, ref.completion_ids)
    assert torch.allclose(r.logprobs, ref.logprobs, atol=1e-5)


def test_repeated_prompts_anywhere_in_the_batch_are_prefilled_once(model, tok, prompt_ids):
    """Prompts that repeat wherever they sit (alternating here, as a data set of few prompts gives) are prefilled
    once each and their cache copied to every row: the rollout equals the one that prefills every prompt (a backend
    without `gathers_rows`) up to the prefill's float rounding, and its log-probs equal a full forward's."""
    from posttrain.rollout.backends import ModelForward

    class Spy(ModelForward):
        def __init__(self, model, gathers):
            super().__init__(model)
            self.gathers_rows, self.prefilled = gathers, []

        def prefill(self, prompt_ids, *args, **kw):
            self.prefilled.append(prompt_ids.shape[0])
            return super().prefill(prompt_ids, *args, **kw)

    alternating = [prompt_ids[0], prompt_ids[1], prompt_ids[0], prompt_ids[3], prompt_ids[1], prompt_ids[0]]
    kw = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    sampling = SamplingConfig(max_new_tokens=8, num_generations=2, temperature=1.2)
    once, every = Spy(model, True), Spy(model, False)
    r = generate(once, alternating, sampling, generator=torch.Generator().manual_seed(3), **kw)
    ref = generate(every, alternating, sampling, generator=torch.Generator().manual_seed(3), **kw)
    assert once.prefilled == [3] and every.prefilled == [6]
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"):
        assert torch.equal(getattr(r, name), getattr(ref, name)), name
    torch.testing.assert_close(r.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5)
    real = r.completion_mask.bool()
    torch.testing.assert_close(r.logprobs[real], full_forward_logprobs(model, r, 1.2)[real], rtol=1e-4, atol=1e-5)


def test_seeded_sampling_is_reproducible(model, tok, prompt_ids):
    kw = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    s = SamplingConfig(max_new_tokens=8, num_generations=2, min_p=0.05)
    a = generate(model, prompt_ids, s, generator=torch.Generator().manual_seed(5), **kw)
    b = generate(model, prompt_ids, s, generator=torch.Generator().manual_seed(5), **kw)
    c = generate(model, prompt_ids, s, generator=torch.Generator().manual_seed(6), **kw)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.completion_ids, c.completion_ids)


def test_eval_mode_during_generation_and_restored(tok, prompt_ids):
    from transformers import AutoConfig, AutoModelForCausalLM

    from posttrain.models.loading import resolve

    config = AutoConfig.from_pretrained(resolve("posttrain/tiny-qwen2"), attention_dropout=0.5)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(config)
    m.train()
    m.model.norm.eval()  # a submodule kept in eval on purpose stays so
    kw = dict(pad_token_id=tok.pad_token_id, eos_token_id=None)
    a = generate(m, prompt_ids, SamplingConfig(max_new_tokens=6, do_sample=False), **kw)
    assert m.training and m.model.layers[0].self_attn.training and not m.model.norm.training
    m.eval()
    b = generate(m, prompt_ids, SamplingConfig(max_new_tokens=6, do_sample=False), **kw)
    assert not m.training
    assert torch.equal(a.logprobs, b.logprobs)  # no dropout while sampling


def test_peft_model_generation(model, tok, prompt_ids):
    peft = pytest.importorskip("peft")
    import copy

    base = copy.deepcopy(model)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1))
    lora.train()
    kw = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    s = SamplingConfig(max_new_tokens=8, do_sample=False)
    out = generate(lora, prompt_ids, s, **kw)
    assert lora.training
    assert torch.equal(out.completion_ids, generate(model, prompt_ids, s, **kw).completion_ids)  # B = 0 at init
    with torch.no_grad():  # a moved adapter changes the samples, and log-probs still match a full forward
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    moved = generate(lora, prompt_ids, SamplingConfig(max_new_tokens=8, num_generations=2), **kw,
                     generator=torch.Generator().manual_seed(0))
    lora.eval()
    ref = full_forward_logprobs(lora, moved, 1.0)
    real = moved.completion_mask.bool()
    assert torch.allclose(moved.logprobs[real], ref[real], atol=1e-5)


def test_bad_input_errors(model, tok):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1, 2], []], SamplingConfig(), pad_token_id=0, eos_token_id=None)
    with pytest.raises(ValueError, match="no prompts"):
        generate(model, [], SamplingConfig(), pad_token_id=0, eos_token_id=None)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)


def test_absolute_position_model(tok, prompt_ids):
    # GPT-2 adds absolute position embeddings: left padding must not shift positions, in the
    # sampler and in token_logprobs (which derives position_ids from a left-padded mask).
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=128,
                                   initializer_range=0.3, bos_token_id=tok.eos_token_id,
                                   eos_token_id=tok.eos_token_id)).eval()
    r = generate(m, prompt_ids, SamplingConfig(max_new_tokens=8, do_sample=False),
                 pad_token_id=tok.pad_token_id, eos_token_id=None)
    assert torch.equal(r.completion_ids, hf_greedy(m, tok, prompt_ids, 8, None))
    assert torch.allclose(r.logprobs, full_forward_logprobs(m, r, 1.0), atol=1e-5)


def test_completion_logprobs_equal_the_plain_forward_with_gradients(tok, prompt_ids, monkeypatch):
    """One sequence per distinct prompt with a block mask: same log-probs, entropies and parameter
    gradients as the plain per-row forward, with left padding, a temperature, uneven completion
    lengths, shuffled rows and a group split across micro-batches; for sdpa and eager attention
    (the plain eager forward itself gives NaN on left-padded float64 rows, so sdpa is the reference)."""
    models = {attn: load_causal_lm("posttrain/tiny-qwen2", dtype=torch.float64, attn_implementation=attn).train()
              for attn in ("sdpa", "eager")}
    m = models["sdpa"]
    g = torch.Generator().manual_seed(1)
    r = generate(m, prompt_ids[:3], SamplingConfig(max_new_tokens=7, num_generations=3), pad_token_id=tok.pad_token_id,
                 eos_token_id=tok.eos_token_id, generator=g)
    order = torch.tensor([4, 0, 8, 1, 5, 2, 7])  # prompt 0 thrice, 1 twice, 2 twice (row 6 left out)
    pi, pm, ci, cm = r.prompt_ids[order], r.prompt_mask[order], r.completion_ids[order], r.completion_mask[order]
    cm[1, 3:] = 0  # uneven lengths, whatever the tiny model sampled
    ci[1, 3:] = tok.pad_token_id
    weights = torch.randn(ci.shape, generator=g, dtype=torch.float64)

    def run(model, fn):
        model.zero_grad()
        logp, entropy = fn(model)
        (logp * weights * cm).sum().backward()
        return logp.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}

    def plain(model):
        ids, attention = torch.cat([pi, ci], 1), torch.cat([pm, cm], 1)
        logp, entropy, _ = token_logprobs(model, ids, attention, ci.shape[1], temperature=0.7, with_entropy=True)
        return logp, entropy

    reference = run(m, plain)
    real = cm.bool()

    def no_plain_forward(*args, **kwargs):
        raise AssertionError("completion_logprobs fell back to the plain forward")

    monkeypatch.setattr(completions_module, "token_logprobs", no_plain_forward)
    for model in models.values():
        shared = run(model, lambda mm: completion_logprobs(mm, pi, pm, ci, cm, temperature=0.7, with_entropy=True))
        torch.testing.assert_close(shared[0][real], reference[0][real], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(shared[1][real], reference[1][real], rtol=1e-6, atol=1e-6)
        for name, grad in reference[2].items():
            # float32-level agreement: the tiny model's RMSNorm computes in float32 even for float64 weights
            torch.testing.assert_close(shared[2][name], grad, rtol=1e-6, atol=1e-6 * float(grad.abs().max()), msg=name)


def test_transposed_head_matches_the_plain_head_and_is_removed(model):
    """The decoding head computed as (W x^T)^T gives the plain logits; the head gets its own forward back."""
    from posttrain.accel.decode import transposed_head

    ids = torch.randint(0, 1000, (8, 3))
    head = model.get_output_embeddings()
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with transposed_head(model) as used:
            swapped = model(input_ids=ids).logits
            assert "forward" in head.__dict__
    assert used and "forward" not in head.__dict__
    assert swapped.shape == plain.shape and swapped.is_contiguous()
    torch.testing.assert_close(swapped, plain, rtol=1e-5, atol=1e-5)
