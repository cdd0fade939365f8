"""The one packer of [prompt | completion 1 | ... | completion k] sequences (online groups, preference pairs)."""

import pytest
import torch

from posttrain.forward.logprobs import pack_groups, pack_pairs, packed_logps, plain_lm_head, token_logprobs
from posttrain.models.loading import load_causal_lm

# two groups of two completions: a left-padded prompt with a 3-token and a 1-token completion; a
# right-padded prompt with a 1-token completion and an empty slot
PROMPTS = torch.tensor([[0, 7, 8], [5, 6, 0]])
PROMPT_MASK = torch.tensor([[0, 1, 1], [1, 1, 0]])
COMPLETIONS = torch.tensor([[[1, 2, 3], [4, 0, 0]], [[9, 0, 0], [0, 0, 0]]])
COMPLETION_MASK = torch.tensor([[[1, 1, 1], [1, 0, 0]], [[1, 0, 0], [0, 0, 0]]])


def test_tight_layout_by_hand():
    p = pack_groups(PROMPTS, PROMPT_MASK, COMPLETIONS, COMPLETION_MASK)
    # group 0: 3 prompt columns (its pad included), blocks at 3..5 and 6; group 1: 2 prompt columns, a block at 2
    assert p.input_ids.tolist() == [[0, 7, 8, 1, 2, 3, 4], [5, 6, 9, 0, 0, 0, 0]]
    assert p.position_ids.tolist() == [[0, 0, 1, 2, 3, 4, 2], [0, 1, 2, 0, 0, 0, 0]]
    assert p.segment.tolist() == [[0, 0, 0, 1, 1, 1, 2], [0, 0, 1, 3, 3, 3, 3]]
    assert p.valid.int().tolist() == [[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0]]
    # token 0 is scored at the prompt's last column, token t at its block's token t - 1; past the end: 0
    assert p.score_at.tolist() == [[[2, 3, 4], [2, 6, 0]], [[1, 2, 0], [1, 0, 0]]]
    assert p.last_at.tolist() == [[5, 6], [2, 1]]  # an empty completion: the prompt's last column
    assert torch.equal(p.targets, COMPLETIONS)
    mask = p.attention_mask()[:, 0]
    assert mask[0, 6].nonzero().flatten().tolist() == [1, 2, 6]  # block 2 sees the real prompt and itself
    assert mask[0, 5].nonzero().flatten().tolist() == [1, 2, 3, 4, 5]


def test_fixed_block_layout_by_hand():
    p = pack_groups(PROMPTS, PROMPT_MASK, COMPLETIONS, COMPLETION_MASK, block=2)
    assert p.input_ids.tolist() == [[0, 7, 8, 1, 2, 4, 0], [5, 6, 0, 9, 0, 0, 0]]
    assert p.position_ids.tolist() == [[0, 0, 1, 2, 3, 2, 3], [0, 1, 1, 2, 3, 2, 3]]
    assert p.segment.tolist() == [[0, 0, 0, 1, 1, 2, 2]] * 2
    assert p.valid.int().tolist() == [[0, 1, 1, 1, 1, 1, 0], [1, 1, 0, 1, 0, 0, 0]]
    # the right-padded prompt's token 0 is scored at its last real column
    assert p.score_at.tolist() == [[[2, 3, 4], [2, 5, 6]], [[1, 3, 4], [1, 5, 6]]]
    assert p.last_at.tolist() == [[4, 5], [3, 1]]  # a 3-token completion keeps 2 columns
    left = pack_groups(PROMPTS[:1].expand(2, 3), PROMPT_MASK[:1].expand(2, 3), COMPLETIONS, COMPLETION_MASK, block=2)
    assert left.score_at.tolist() == [[[2, 3, 4], [2, 5, 6]]]  # left-padded prompts: one layout for every group


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("prompt_mask", [PROMPT_MASK, torch.tensor([[0, 1, 1], [0, 0, 1]])], ids=["mixed", "left"])
def test_packed_logps_equal_each_row_alone(attn, prompt_mask):
    """Every layout and head path gives each completion token the log-prob of its own unpadded
    [prompt | completion] row (left-padded prompts in fixed blocks: logits at the shared scoring
    columns only); `by_slot` only reorders the rows."""
    model = load_causal_lm("posttrain/tiny-qwen2", dtype=torch.float64, attn_implementation=attn).eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 200, PROMPTS.shape, generator=g) * prompt_mask
    completions = torch.randint(3, 200, COMPLETIONS.shape, generator=g) * COMPLETION_MASK
    head = plain_lm_head(model, prompts[:, 1:])
    want = torch.zeros(COMPLETIONS.shape, dtype=torch.float64)
    for u in range(2):
        for j in range(2):
            n = int(COMPLETION_MASK[u, j].sum())
            if n:
                row = torch.cat([prompts[u][prompt_mask[u].bool()], completions[u, j, :n]])[None]
                want[u, j, :n] = token_logprobs(model, row, torch.ones_like(row), num_scored=n)[0][0]
    real = COMPLETION_MASK.bool()
    with torch.no_grad():
        for block in (None, 2):
            packed = pack_groups(prompts, prompt_mask, completions, COMPLETION_MASK, block=block)
            assert packed.score_at.shape[0] == (1 if block and prompt_mask[:, -1].all() else 2)
            for with_head in (head, None):
                logps, _, hidden = packed_logps(model, packed, with_head)
                assert (hidden is None) == (with_head is None)
                torch.testing.assert_close(logps.view(2, 2, 3)[real], want[real], rtol=1e-9, atol=1e-9)
                by_slot, _, _ = packed_logps(model, packed, with_head, by_slot=True)
                assert torch.equal(by_slot, logps.view(2, 2, 3).transpose(0, 1).reshape(4, 3))


@pytest.mark.parametrize("prompt_len", [[2, 3], [0, 0]])
def test_pack_pairs_gives_a_reward_model_the_last_token_states(prompt_len):
    """Without the LM head: the backbone on the packed pairs gives each row's last real token the
    hidden state of its own two-row forward (chosen rows first, as the preference collators lay
    them out), with or without a prompt."""
    model = load_causal_lm("posttrain/tiny-qwen2", dtype=torch.float64).eval()
    g = torch.Generator().manual_seed(1)
    lengths = [3, 1, 2, 4]  # chosen 0, chosen 1, rejected 0, rejected 1
    T = 8
    ids, mask, cmask = (torch.zeros(4, T, dtype=torch.long) for _ in range(3))
    prompts = [torch.randint(3, 200, (n,), generator=g) for n in prompt_len]
    for row, n in enumerate(lengths):
        p = prompts[row % 2]
        ids[row, :len(p) + n] = torch.cat([p, torch.randint(3, 200, (n,), generator=g)])
        mask[row, :len(p) + n], cmask[row, len(p):len(p) + n] = 1, 1
    packed = pack_pairs(ids, mask, cmask)
    assert packed.input_ids.shape == (2, max(prompt_len[0] + 3 + 2, prompt_len[1] + 1 + 4))
    with torch.no_grad():
        last = packed.at_last(model.model(**packed.model_inputs(model)).last_hidden_state, by_slot=True)  # (4, H)
        for row in range(4):
            n = int(mask[row].sum())
            alone = model.model(input_ids=ids[row:row + 1, :n]).last_hidden_state[0, -1]
            torch.testing.assert_close(last[row], alone, rtol=1e-9, atol=1e-9)


def test_distillation_forward_packs_repeated_prompts_and_matches_the_plain_forward():
    """`completion_logits` (the distillation trainers' forward of student and teacher) takes rows that repeat a
    prompt, in any order, as one packed sequence per distinct prompt: the model sees each prompt once, and every
    completion token gets the hidden state of the plain padded forward, gradients included."""
    from posttrain.core.divergences import LinearLogits
    from posttrain.forward.completions import completion_logits, shared_prompts

    model = load_causal_lm("posttrain/tiny-qwen2", dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    P, C = 5, 4
    prompts, prompt_mask = torch.randint(3, 200, (2, P), generator=g), torch.tensor([[1] * P, [0, 0, 1, 1, 1]])
    rows = torch.tensor([0, 1, 0, 1, 0])  # as a batch of num_generations=1 over a data set that repeats prompts
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    mb = {"prompt_ids": prompts[rows] * prompt_mask[rows], "prompt_mask": prompt_mask[rows],
          "completion_ids": torch.randint(3, 200, (5, C), generator=g) * completion_mask,
          "completion_mask": completion_mask}
    shared = shared_prompts(model, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"])
    assert (shared.prompts, shared.slots) == (2, 3)
    plain_lm_head(model, mb["prompt_ids"])  # its one-row check, made (and kept) before counting the forwards
    seen = []
    hook = model.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape), with_kwargs=True)
    got = completion_logits(model, mb)
    hook.remove()
    assert isinstance(got, LinearLogits) and seen == [(2, P + 3 * (C - 1))]  # one row per distinct prompt
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
    attention = torch.cat([mb["prompt_mask"], completion_mask], 1)
    plain = model(input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
                  output_hidden_states=True).hidden_states[-1][:, P - 1:P + C - 1]
    real = completion_mask.bool()
    torch.testing.assert_close(got.hidden[real], plain[real], rtol=1e-9, atol=1e-9)
    w = torch.randn(real.shape + (plain.shape[-1],), generator=g, dtype=torch.float64) * real[..., None]
    (grad_got,) = torch.autograd.grad((got.hidden * w).sum(), model.model.embed_tokens.weight)
    (grad_want,) = torch.autograd.grad((plain * w).sum(), model.model.embed_tokens.weight)
    # float32-level agreement: the tiny model's RMSNorm computes in float32 even for float64 weights, and the packed
    # backward sums a shared prompt's gradients in another order
    torch.testing.assert_close(grad_got, grad_want, rtol=1e-6, atol=1e-6 * float(grad_want.abs().max()))
