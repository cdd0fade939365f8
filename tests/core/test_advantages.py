import math

import pytest
import torch

from posttrain.core.advantages import (
    ADVANTAGES,
    AdvantageInput,
    compute_advantages,
    group_view,
    register_advantage,
)

# --- float64 references written as plain Python loops ---------------------------------


def prompt_of(i, num_prompts, k, layout):
    return i // k if layout == "prompt_major" else i % num_prompts


def groups(scores, k, layout):
    """index lists of each prompt's completions"""
    n = len(scores) // k
    return [[i for i in range(len(scores)) if prompt_of(i, n, k, layout) == p] for p in range(n)]


def sample_std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def ref_group_norm(scores, k, layout, scale):
    out = [0.0] * len(scores)
    for idx in groups(scores, k, layout):
        rs = [scores[i] for i in idx]
        mean = sum(rs) / k
        std = {"group": sample_std(rs), "batch": sample_std(scores), "none": None}[scale]
        for i in idx:
            out[i] = scores[i] - mean if std is None else (scores[i] - mean) / (std + 1e-4)
    return out


def ref_leave_one_out(scores, k, layout):
    out = [0.0] * len(scores)
    for idx in groups(scores, k, layout):
        for i in idx:
            others = [scores[j] for j in idx if j != i]
            out[i] = scores[i] - sum(others) / len(others)
    return out


def ref_rewards(scores, lengths, token_rewards):
    """per-row reward lists over the valid tokens: token rewards + score at the last token"""
    rows = []
    for b, n in enumerate(lengths):
        r = [token_rewards[b][t] if token_rewards else 0.0 for t in range(n)]
        r[-1] += scores[b]
        rows.append(r)
    return rows


def ref_gae(rewards, values, gamma, lam):
    advs, rets = [], []
    for r, v in zip(rewards, values):
        n, a, last = len(r), [0.0] * len(r), 0.0
        for t in reversed(range(n)):
            next_v = v[t + 1] if t + 1 < n else 0.0
            last = r[t] + gamma * next_v - v[t] + gamma * lam * last
            a[t] = last
        advs.append(a)
        rets.append([a[t] + v[t] for t in range(n)])
    return advs, rets


def ref_whiten(rows):
    flat = [x for row in rows for x in row]
    m = sum(flat) / len(flat)
    var = sum((x - m) ** 2 for x in flat) / (len(flat) - 1)
    return [[(x - m) / math.sqrt(var + 1e-8) for x in row] for row in rows]


def ref_return_to_go(rewards, gamma):
    out = []
    for r in rewards:
        g, running = [0.0] * len(r), 0.0
        for t in reversed(range(len(r))):
            running = r[t] + gamma * running
            g[t] = running
        out.append(g)
    return out


def padded(rows, T):
    return torch.tensor([row + [0.0] * (T - len(row)) for row in rows], dtype=torch.float64)


def right_mask(lengths, T):
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


LAYOUTS = ["prompt_major", "completion_major"]

# --- group helpers ------------------------------------------------------------------------


def test_group_view():
    x = torch.arange(6)
    assert group_view(x, 3, "prompt_major").tolist() == [[0, 1, 2], [3, 4, 5]]
    # completion-major rows are [p0c0, p1c0, p0c1, p1c1, p0c2, p1c2]
    assert group_view(x, 3, "completion_major").tolist() == [[0, 2, 4], [1, 3, 5]]
    assert group_view(torch.zeros(6, 5), 2, "completion_major").shape == (3, 2, 5)
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_view(x, 4, "prompt_major")
    with pytest.raises(ValueError, match="layout"):
        group_view(x, 3, "rows")


# --- RLOO ---------------------------------------------------------------------------------


def test_rloo_seed_check():
    # 3 prompts x 4 completions, completion-major: view(4, 3) has prompt p's rewards in column p
    scores = torch.tensor([1, 2, 3, 2, 3, 4, 5, 6, 7, 8, 9, 10], dtype=torch.float64)
    mask = torch.ones(12, 2)
    inp = AdvantageInput(scores, mask, group_size=4, layout="completion_major")
    adv, returns = compute_advantages("leave_one_out", inp)
    assert returns is None
    # prompt 0 has rewards 1, 2, 5, 8: the first completion's baseline is (2 + 5 + 8) / 3 = 5
    assert adv[0, 0].item() == pytest.approx(1 - (2 + 5 + 8) / 3)  # -4
    # last entry (prompt 2, reward 10) against 3, 4, 7
    assert adv[11, 1].item() == pytest.approx(10 - (3 + 4 + 7) / 3)
    expected = ref_leave_one_out(scores.tolist(), 4, "completion_major")
    assert torch.allclose(adv[:, 0], torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_leave_one_out_matches_loop(layout):
    torch.manual_seed(0)
    scores = torch.randn(12, dtype=torch.float64)
    mask = right_mask([3, 5, 1, 4, 2, 5, 5, 3, 1, 2, 4, 5], 5)
    adv, _ = compute_advantages("leave_one_out", AdvantageInput(scores, mask, 3, layout))
    expected = torch.tensor(ref_leave_one_out(scores.tolist(), 3, layout), dtype=torch.float64)
    assert torch.allclose(adv, expected[:, None] * mask)
    assert (adv[~mask] == 0).all()
    # normalize_advantage whitens the (B,) advantages, each sequence counting once
    adv_n, _ = compute_advantages(
        "leave_one_out", AdvantageInput(scores, mask, 3, layout), normalize_advantage=True
    )
    m, s = expected.mean(), expected.std()
    assert torch.allclose(adv_n, ((expected - m) / s)[:, None] * mask, atol=1e-7)


def test_leave_one_out_needs_two_completions():
    with pytest.raises(ValueError, match="group_size >= 2"):
        compute_advantages("leave_one_out", AdvantageInput(torch.ones(4), torch.ones(4, 2)))


# --- GRPO ---------------------------------------------------------------------------------


def test_group_norm_by_hand():
    # one prompt, rewards 0, 0, 1, 1: mean 0.5, sample std sqrt(1/3)
    scores = torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    adv, _ = compute_advantages("group_norm", AdvantageInput(scores, torch.ones(4, 1), 4))
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert adv[:, 0].tolist() == pytest.approx([-a, -a, a, a])
    # Dr. GRPO: no division
    adv, _ = compute_advantages(
        "group_norm", AdvantageInput(scores, torch.ones(4, 1), 4), scale_rewards="none"
    )
    assert adv[:, 0].tolist() == [-0.5, -0.5, 0.5, 0.5]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_norm_matches_loop(layout, scale):
    torch.manual_seed(1)
    scores = torch.randn(12, dtype=torch.float64)
    mask = right_mask([3, 5, 1, 4, 2, 5, 5, 3, 1, 2, 4, 5], 5)
    adv, returns = compute_advantages(
        "group_norm", AdvantageInput(scores, mask, 4, layout), scale_rewards=scale
    )
    expected = torch.tensor(ref_group_norm(scores.tolist(), 4, layout, scale), dtype=torch.float64)
    assert returns is None
    assert torch.allclose(adv, expected[:, None] * mask)


def test_group_norm_bool_scale_and_k1():
    scores = torch.tensor([1.0, 3.0, 2.0, 2.0])
    mask = torch.ones(4, 3)
    on, _ = compute_advantages("group_norm", AdvantageInput(scores, mask, 2), scale_rewards=True)
    group, _ = compute_advantages("group_norm", AdvantageInput(scores, mask, 2))
    off, _ = compute_advantages("group_norm", AdvantageInput(scores, mask, 2), scale_rewards=False)
    assert torch.equal(on, group)
    assert off[:, 0].tolist() == [-1.0, 1.0, 0.0, 0.0]
    # one completion per prompt: nothing to compare with, advantage 0 (not NaN)
    k1, _ = compute_advantages("group_norm", AdvantageInput(scores, mask, 1))
    assert torch.equal(k1, torch.zeros(4, 3))
    # identical rewards in a group: 0, not NaN
    same, _ = compute_advantages("group_norm", AdvantageInput(torch.ones(4), mask, 2))
    assert torch.equal(same, torch.zeros(4, 3))


# --- GAE ----------------------------------------------------------------------------------


def test_gae_by_hand():
    # γ = 1, λ = 0.95, V = [0.5, 0.2, 0.1], score 1 on the last token
    # t=2: δ = 1 - 0.1 = 0.9;            A = 0.9
    # t=1: δ = 0.1 - 0.2 = -0.1;         A = -0.1 + 0.95 * 0.9 = 0.755
    # t=0: δ = 0.2 - 0.5 = -0.3;         A = -0.3 + 0.95 * 0.755 = 0.41725
    # right-padded to T=5 with garbage values on the padding
    values = torch.tensor([[0.5, 0.2, 0.1, 100.0, -3.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    inp = AdvantageInput(torch.tensor([1.0], dtype=torch.float64), mask, values=values)
    adv, returns = compute_advantages("gae", inp, whiten_advantages=False)
    assert adv[0].tolist() == pytest.approx([0.41725, 0.755, 0.9, 0.0, 0.0])
    assert returns[0].tolist() == pytest.approx([0.91725, 0.955, 1.0, 0.0, 0.0])


@pytest.mark.parametrize("with_token_rewards", [False, True])
def test_gae_matches_reverse_loop_on_padded_batch(with_token_rewards):
    torch.manual_seed(2)
    lengths, T = [6, 1, 4, 3], 6
    mask = right_mask(lengths, T)
    scores = torch.randn(4, dtype=torch.float64)
    values = torch.randn(4, T, dtype=torch.float64)
    token_rewards = -0.1 * torch.rand(4, T, dtype=torch.float64) if with_token_rewards else None
    inp = AdvantageInput(scores, mask, values=values, token_rewards=token_rewards)
    adv, returns = compute_advantages("gae", inp, gamma=0.9, lam=0.8, whiten_advantages=False)
    tr = token_rewards.tolist() if with_token_rewards else None
    rewards = ref_rewards(scores.tolist(), lengths, tr)
    vs = [values[b, :n].tolist() for b, n in enumerate(lengths)]
    ref_adv, ref_ret = ref_gae(rewards, vs, 0.9, 0.8)
    assert torch.allclose(adv, padded(ref_adv, T))
    assert torch.allclose(returns, padded(ref_ret, T))
    # whitening is over the masked tokens of the batch; returns are not whitened
    adv_w, returns_w = compute_advantages("gae", inp, gamma=0.9, lam=0.8)
    assert torch.allclose(adv_w, padded(ref_whiten(ref_adv), T))
    assert torch.equal(returns_w, returns)


def test_gae_skips_holes_in_the_mask():
    # a masked-out position inside a completion (e.g. tool output) is stepped over
    values = torch.tensor([[0.5, 9.0, 0.2, 0.1], [0.5, 0.2, 0.1, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 0]])
    inp = AdvantageInput(torch.tensor([1.0, 1.0], dtype=torch.float64), mask, values=values)
    adv, returns = compute_advantages("gae", inp, whiten_advantages=False)
    assert adv[0, [0, 2, 3]].tolist() == pytest.approx(adv[1, :3].tolist())
    assert adv[0, 1].item() == 0.0
    assert adv[1, :3].tolist() == pytest.approx([0.41725, 0.755, 0.9])


def test_gae_needs_values_and_detaches():
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", AdvantageInput(torch.ones(2), torch.ones(2, 3)))
    values = torch.randn(2, 3, requires_grad=True)
    adv, returns = compute_advantages(
        "gae", AdvantageInput(torch.ones(2), torch.ones(2, 3), values=values)
    )
    assert not adv.requires_grad and not returns.requires_grad


# --- REINFORCE++ --------------------------------------------------------------------------


def test_reinforce_pp_by_hand():
    # two sequences, γ = 1, no token rewards: every token's return is its sequence's score.
    # tokens: two with return 1, one with -1 -> mean 1/3,
    # unbiased var (2 * (2/3)^2 + (4/3)^2) / 2 = 4/3
    scores = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    adv, returns = compute_advantages("reinforce_pp", AdvantageInput(scores, mask))
    std = math.sqrt(4 / 3 + 1e-8)
    assert returns is None
    a, b = (2 / 3) / std, (-4 / 3) / std
    assert adv.flatten().tolist() == pytest.approx([a, a, b, 0.0])


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_loop(gamma):
    torch.manual_seed(3)
    lengths, T = [5, 2, 3, 1], 5
    mask = right_mask(lengths, T)
    scores = torch.randn(4, dtype=torch.float64)
    token_rewards = torch.randn(4, T, dtype=torch.float64) * 0.1
    inp = AdvantageInput(scores, mask, token_rewards=token_rewards)
    adv, _ = compute_advantages("reinforce_pp", inp, gamma=gamma)
    rewards = ref_rewards(scores.tolist(), lengths, token_rewards.tolist())
    expected = ref_whiten(ref_return_to_go(rewards, gamma))
    assert torch.allclose(adv, padded(expected, T))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reinforce_pp_baseline_matches_loop(layout):
    torch.manual_seed(4)
    lengths, T = [5, 2, 3, 1, 4, 4], 5
    mask = right_mask(lengths, T)
    scores = torch.randn(6, dtype=torch.float64)
    token_rewards = torch.randn(6, T, dtype=torch.float64) * 0.1
    inp = AdvantageInput(scores, mask, group_size=3, layout=layout, token_rewards=token_rewards)
    adv, _ = compute_advantages("reinforce_pp_baseline", inp)
    s = scores.tolist()
    centred = list(s)
    for idx in groups(s, 3, layout):
        mean = sum(s[i] for i in idx) / 3
        for i in idx:
            centred[i] = s[i] - mean
    rewards = ref_rewards(centred, lengths, token_rewards.tolist())
    assert torch.allclose(adv, padded(ref_whiten(ref_return_to_go(rewards, 1.0)), T))


# --- OPO ---------------------------------------------------------------------------------


def test_opo_by_hand():
    # one prompt, 3 completions of 2, 4 and 1 trained tokens with rewards 1, 0, 0.5:
    # baseline = (2 * 1 + 4 * 0 + 1 * 0.5) / (2 + 4 + 1) = 2.5 / 7
    scores = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    mask = right_mask([2, 4, 1], 4)
    adv, returns = compute_advantages("opo", AdvantageInput(scores, mask, group_size=3))
    assert returns is None
    b = 2.5 / 7
    expected = [[1 - b, 1 - b, 0, 0], [-b, -b, -b, -b], [0.5 - b, 0, 0, 0]]
    assert adv.tolist() == [pytest.approx(row) for row in expected]
    # the length-weighted advantages sum to 0 over the group's trained tokens
    assert adv.sum().item() == pytest.approx(0.0, abs=1e-12)


def ref_opo(scores, lengths, k, layout):
    out = [0.0] * len(scores)
    for idx in groups(scores, k, layout):
        total = sum(lengths[i] for i in idx)
        baseline = sum(lengths[i] * scores[i] for i in idx) / max(total, 1)
        for i in idx:
            out[i] = scores[i] - baseline
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_opo_matches_loop(layout):
    torch.manual_seed(0)
    scores = torch.randn(12, dtype=torch.float64)
    # a hole in row 0 (tool output) does not count towards its length; row 5 is empty
    mask = right_mask([3, 5, 1, 4, 2, 0, 5, 3, 1, 2, 4, 5], 5)
    mask[0, 1] = False
    lengths = mask.sum(1).tolist()
    adv, _ = compute_advantages("opo", AdvantageInput(scores, mask, group_size=4, layout=layout))
    expected = torch.tensor(ref_opo(scores.tolist(), lengths, 4, layout), dtype=torch.float64)
    assert torch.allclose(adv, torch.where(mask, expected[:, None], 0.0))


def test_opo_equal_lengths_is_the_group_mean_and_singletons_get_zero():
    scores = torch.tensor([3.0, 1.0, 2.0, 6.0], dtype=torch.float64)
    adv, _ = compute_advantages("opo", AdvantageInput(scores, torch.ones(4, 3), group_size=2))
    assert adv[:, 0].tolist() == pytest.approx([1.0, -1.0, -2.0, 2.0])  # r - mean of its pair
    adv, _ = compute_advantages("opo", AdvantageInput(scores, torch.ones(4, 3), group_size=1))
    assert (adv == 0).all()


# --- registry -----------------------------------------------------------------------------


def test_registry():
    assert {"group_norm", "leave_one_out", "gae", "reinforce_pp", "reinforce_pp_baseline"} <= set(
        ADVANTAGES
    )
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages("vtrace", AdvantageInput(torch.ones(2), torch.ones(2, 2)))
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("gae", per_token=True, critic=True, min_group=1)(lambda inp: None)
    with pytest.raises(TypeError):  # options are checked by the estimator's signature
        compute_advantages("group_norm", AdvantageInput(torch.ones(2), torch.ones(2, 2), 2), lam=1)


def test_registered_facts_match_what_each_estimator_reads():
    """per_token / critic / min_group are read by the engine instead of the estimators' code: check them
    against the estimators' behaviour, so a wrong fact at registration fails here."""
    torch.manual_seed(0)
    scores, mask = torch.randn(8, dtype=torch.float64), right_mask([3, 5, 1, 4, 2, 5, 5, 3], 5)
    values = torch.randn(8, 5, dtype=torch.float64)
    token_rewards = torch.randn(8, 5, dtype=torch.float64)
    for name, estimator in ADVANTAGES.items():
        inp = AdvantageInput(scores, mask, group_size=4, values=values)
        base, _ = compute_advantages(name, inp)
        with_tokens, _ = compute_advantages(name, AdvantageInput(scores, mask, 4, token_rewards=token_rewards,
                                                                 values=values))
        assert torch.equal(base, with_tokens) != estimator.per_token, name
        if not estimator.critic:
            without_values, _ = compute_advantages(name, AdvantageInput(scores, mask, group_size=4))
            assert torch.equal(base, without_values), name
        else:
            with pytest.raises(ValueError, match="values"):
                compute_advantages(name, AdvantageInput(scores, mask, group_size=4))
        if estimator.min_group >= 2:  # a group of one has no baseline: no signal, or refused
            try:
                single, _ = compute_advantages(name, AdvantageInput(scores, mask, group_size=1, values=values))
            except ValueError:
                continue
            assert torch.allclose(single, torch.zeros_like(single)), name


def test_register_advantage_requires_every_fact():
    def estimator(inp):
        return None, None

    for missing in ("per_token", "critic", "min_group"):
        facts = {"per_token": False, "critic": False, "min_group": 1}
        del facts[missing]
        with pytest.raises(TypeError, match=missing):
            register_advantage("test_missing_fact", **facts)
    with pytest.raises(TypeError, match="positional"):  # facts are keyword-only
        register_advantage("test_missing_fact", False, False, 1)
    with pytest.raises(TypeError, match="per_token must be True or False"):
        register_advantage("test_bad_fact", per_token=None, critic=False, min_group=1)
    with pytest.raises(ValueError, match="min_group must be an int >= 1"):
        register_advantage("test_bad_fact", per_token=False, critic=False, min_group=0)
    assert "test_missing_fact" not in ADVANTAGES and "test_bad_fact" not in ADVANTAGES


def test_register_advantage_refuses_options_the_config_cannot_pass():
    def positional_option(inp, gamma=1.0):
        return None, None

    def extra_kwargs(inp, **options):
        return None, None

    for fn in (positional_option, extra_kwargs):
        with pytest.raises(TypeError, match="keyword-only"):
            register_advantage("test_loose_option", per_token=False, critic=False, min_group=1)(fn)
    assert "test_loose_option" not in ADVANTAGES
    assert ADVANTAGES["gae"].options == ("gamma", "lam", "whiten_advantages")
    assert ADVANTAGES["opo"].options == ()


def test_reverse_kl_return_by_hand():
    from posttrain.core.advantages import reverse_kl_return

    # one completion of 3 tokens (the 4th is padding); per-token rewards log q_T - log q_S = (1, 2, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    rewards = torch.tensor([[1.0, 2.0, 4.0, 9.0]], dtype=torch.float64)
    inp = AdvantageInput(scores=torch.tensor([5.0], dtype=torch.float64), mask=mask, group_size=1,
                         token_rewards=rewards)
    # group of one: the score's advantage is 0; gamma = 1, all steps, length-normalised: (7/3, 6/2, 4/1)
    adv, _ = reverse_kl_return(inp, gamma=1.0, length_normalization=True, single_step_decomposition=False)
    torch.testing.assert_close(adv, torch.tensor([[7 / 3, 3.0, 4.0, 0.0]], dtype=torch.float64))
    # single-step decomposition: the later steps only, R_{t+1} = (6, 4, 0), divided by the 2, 1, (1) steps summed
    adv, _ = reverse_kl_return(inp, gamma=1.0, length_normalization=True, single_step_decomposition=True)
    torch.testing.assert_close(adv, torch.tensor([[3.0, 4.0, 0.0, 0.0]], dtype=torch.float64))
    # gamma = 0.5, no normalisation: G_t = r_t + 0.5 G_{t+1} = (1 + 0.5 * 4, 2 + 0.5 * 4, 4) = (3, 4, 4)
    adv, _ = reverse_kl_return(inp, gamma=0.5, length_normalization=False, single_step_decomposition=False)
    torch.testing.assert_close(adv, torch.tensor([[3.0, 4.0, 4.0, 0.0]], dtype=torch.float64))
    # the default gamma = 0 with single-step decomposition leaves the group-centred scores: two samples 5 and 1
    two = AdvantageInput(scores=torch.tensor([5.0, 1.0], dtype=torch.float64), mask=mask.repeat(2, 1), group_size=2,
                         token_rewards=rewards.repeat(2, 1))
    adv, _ = reverse_kl_return(two, gamma=0.0)
    torch.testing.assert_close(adv, torch.tensor([[2.0, 2.0, 2.0, 0.0], [-2.0, -2.0, -2.0, 0.0]], dtype=torch.float64))
