"""Multi-turn rollouts: fed tool turns masked token by token, the KV cache continued (not prefilled
again), log-probs equal to one teacher-forced forward, the tool-running `Episodes`, rollout_func
outputs, and advantages that ignore masked holes in the middle of a completion."""

import pytest
import torch

from posttrain.core.advantages import AdvantageInput, compute_advantages
from posttrain.data.tokenize import continuation_ids
from posttrain.data.tools import tool_schemas
from posttrain.forward.completions import completion_logprobs
from posttrain.forward.logprobs import token_logprobs
from posttrain.rollout import cpu_backend
from posttrain.rollout.generate import SamplingConfig, generate
from posttrain.rollout.multiturn import Episodes, Tooling, rollout_from_func

FED = [5, 6, 7, 8, 9]  # what the scripted "tool" answers: any ids, fed after a row's first turn


class Script:
    """continue_turn that feeds FED after each row's first turn and ends the row after its second."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []  # (row, length of its tokens when it stopped)

    def __call__(self, rows, tokens):
        out = []
        for i, ids in zip(rows, tokens):
            first = all(r != i for r, _ in self.calls)
            self.calls.append((i, len(ids)))
            out.append(list(FED) if first else None)
        return out


def _rollout(model, tok, script, **kwargs):
    prompts = [tok("add 12 7 =")["input_ids"], tok("a")["input_ids"]]
    # a quarter of the vocabulary ends a turn, so the random model's turns end within a few tokens
    stops = tuple(range(10, tok.vocab_size if hasattr(tok, "vocab_size") else 200, 4))
    sampling = SamplingConfig(max_new_tokens=40, num_generations=2, stop_token_ids=stops)
    return prompts, generate(model, prompts, sampling, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                             generator=torch.Generator().manual_seed(3), continue_turn=script, **kwargs)


def test_fed_turns_are_masked_token_by_token(model, tok):
    script = Script()
    _, r = _rollout(model, tok, script)
    assert r.tool_mask is not None and r.tool_mask.shape == r.completion_ids.shape
    continued = 0
    for i in range(r.completion_ids.shape[0]):
        stops = [n for row, n in script.calls if row == i]
        expected = torch.zeros(r.completion_ids.shape[1], dtype=torch.long)
        if stops:  # the first turn ended at stops[0] tokens; FED follows at once, then the row samples again
            first = stops[0]
            fed = slice(first, min(first + len(FED), r.completion_ids.shape[1]))
            expected[fed] = 1
            assert r.completion_ids[i, fed].tolist() == FED[: fed.stop - fed.start]
            continued += 1
        assert r.tool_mask[i].tolist() == expected.tolist(), f"row {i}"
        # fed tokens: attended (completion_mask 1), log-prob 0; the sampled ones keep their log-probs
        assert (r.completion_mask[i][expected.bool()] == 1).all()
        assert (r.logprobs[i][expected.bool()] == 0).all()
        sampled = r.completion_mask[i].bool() & ~expected.bool()
        assert (r.logprobs[i][sampled] < 0).all()
        loss_mask = r.completion_mask[i] * (1 - r.tool_mask[i])  # what the trainer trains on
        assert loss_mask.tolist() == sampled.long().tolist()
    assert continued == 4  # every row had a second turn


def test_kv_cache_is_continued_across_turns(model, tok, monkeypatch):
    """Only the prompt is prefilled: every later forward takes one token per row, fed tokens included."""
    monkeypatch.setattr(cpu_backend, "lean_decoder", lambda net: None)  # count the model's own forwards
    widths = []
    original = type(model).forward

    def counting(self, *args, **kwargs):
        widths.append(kwargs["input_ids"].shape[1])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", counting)
    script = Script()
    prompts, r = _rollout(model, tok, script)
    P = max(len(p) for p in prompts)
    assert widths[0] == P  # the one prefill
    assert all(w == 1 for w in widths[1:])  # after it, no turn is prefilled again
    assert len(widths) == r.completion_ids.shape[1]  # one forward per step, the last step needs none
    assert r.tool_mask.sum() > 0


def test_lean_decoder_takes_fed_tokens_too(model, tok, monkeypatch):
    _, lean = _rollout(model, tok, Script())
    monkeypatch.setattr(cpu_backend, "lean_decoder", lambda net: None)
    _, plain = _rollout(model, tok, Script())
    assert torch.equal(lean.completion_ids, plain.completion_ids)
    assert torch.equal(lean.tool_mask, plain.tool_mask)
    torch.testing.assert_close(lean.logprobs, plain.logprobs, atol=1e-4, rtol=1e-4)


def test_multi_turn_logprobs_equal_one_teacher_forced_forward(model, tok):
    _, r = _rollout(model, tok, Script())
    ids = torch.cat([r.prompt_ids, r.completion_ids], 1)
    attention = torch.cat([r.prompt_mask, r.completion_mask], 1)
    with torch.no_grad():
        full, _, _ = token_logprobs(model, ids, attention, num_scored=r.completion_ids.shape[1], exact_positions=True)
        shared, _ = completion_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
    sampled = (r.completion_mask * (1 - r.tool_mask)).bool()
    assert sampled.sum() > 0 and r.tool_mask.sum() > 0
    torch.testing.assert_close(r.logprobs[sampled], full[sampled], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(r.logprobs[sampled], shared[sampled], atol=1e-4, rtol=1e-4)


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def test_episodes_run_calls_and_build_the_conversation(tok):
    prompt = [{"role": "user", "content": "2 + 3?"}]
    schemas = tool_schemas([add])
    episodes = Episodes(tok, [prompt, prompt], [{"add": add}] * 2, [schemas] * 2, max_iterations=1, timeout=5)
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    bad = '<tool_call>{"name": "add", "arguments": {"a": 2</tool_call>'
    turn = [tok(call, add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
            tok(bad, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    fed = episodes([0, 1], turn)
    first = {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
    result = {"role": "tool", "name": "add", "content": "5"}
    assert fed[0] == continuation_ids(tok, prompt + [first], [result], tools=schemas)
    assert episodes.turns[0] == [first, result]
    assert episodes.turns[1][1]["role"] == "tool" and episodes.turns[1][1]["content"].startswith("Error: tool call 0")
    assert fed[1] is not None  # the error goes back to the model as the tool message
    assert episodes.calls == [1, 1] and episodes.failures == [0, 1]
    # the next turn of row 0 starts after the fed ids: its text is read from there
    answer = tok("5", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert episodes([0], [turn[0] + fed[0] + answer]) == [None]
    assert episodes.turns[0][-1] == {"role": "assistant", "content": "5"}
    # row 1 used its one iteration: another call ends the episode instead of running
    assert episodes([1], [turn[1] + fed[1] + turn[0]]) == [None] and episodes.calls[1] == 1
    assert episodes.metrics() == {"tools/calls_per_completion": 1.0, "tools/failure_rate": 0.5,
                                  "tools/turns_per_episode": 2.0}


def test_a_turn_ended_by_a_stop_string_or_token_ends_the_episode(tok):
    """The template's continuation follows the EOS that closes a turn; a turn cut at a stop string (here
    right after its call) or at another stop token has no EOS, so it ends the episode: no tool runs,
    nothing is fed, the turn is kept as it was written. The same turn closed by EOS is continued."""
    prompt = [{"role": "user", "content": "2 + 3?"}]
    ran = []

    def add(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: The first.
            b: The second.
        """
        ran.append((a, b))
        return a + b

    schemas = tool_schemas([add])
    call = tok('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
               add_special_tokens=False)["input_ids"]
    other_stop = tok("\n", add_special_tokens=False)["input_ids"]
    episodes = Episodes(tok, [prompt] * 3, [{"add": add}] * 3, [schemas] * 3, max_iterations=3, timeout=5)
    fed = episodes([0, 1, 2], [call, call + other_stop, call + [tok.eos_token_id]])
    assert fed[0] is None and fed[1] is None
    assert fed[2] == continuation_ids(tok, prompt + [episodes.turns[2][0]], [{"role": "tool", "name": "add",
                                                                             "content": "5"}], tools=schemas)
    assert ran == [(2, 3)]  # only the EOS-closed turn's call ran
    assert episodes.calls == [0, 0, 1] and episodes.iterations == [0, 0, 1]
    for i in (0, 1):
        assert episodes.turns[i] == [{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}]


class Counter:
    def __init__(self):
        self.n = 0

    def reset(self, start: int = 0, **row):
        self.n = start
        return f" Start at {start}."

    def bump(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much.
        """
        self.n += by
        return self.n

    def get_reward(self) -> float:
        return float(self.n)


def test_tooling_environments_reset_and_reward(tok):
    tooling = Tooling(environment_factory={"count": Counter}, max_iterations=3)
    assert [s["function"]["name"] for s in tooling.schemas_for({"environment": "count"})] == ["bump"]
    prompt = [{"role": "user", "content": "Count."}]
    episodes, envs, prompt_ids = tooling.episodes(tok, [prompt] * 2, {"environment": ["count"] * 2, "start": [4, 4]},
                                                  num_generations=2, max_prompt_length=None)
    assert [e.n for e in envs] == [4, 4] and envs[0] is not envs[1]  # a fresh environment per rollout
    assert episodes.prompts[0][-1]["content"] == "Count. Start at 4."  # reset's text joins the last user message
    assert len(prompt_ids) == 1  # one prompt per group
    (reward,) = tooling.environment_rewards()
    assert reward.__name__ == "Counter" and reward(None, environments=envs) == [4.0, 4.0]
    with pytest.raises(ValueError, match="'environment' column"):
        tooling.schemas_for({"environment": "other"})
    with pytest.raises(ValueError, match="differs within a group"):
        tooling.episodes(tok, [prompt] * 2, {"environment": ["count"] * 2, "start": [1, 2]}, 2, None)


def test_rollout_from_func():
    out = {"prompt_ids": [[1, 2], [3]], "completion_ids": [[4, 2], [5, 6, 7]], "logprobs": [[-0.5, -1.0], [-1, -2, -3]],
           "tool_mask": [[0, 0], [0, 1, 0]], "hint": ["a", "b"]}
    r, extra = rollout_from_func(out, 2, pad_token_id=0, eos_token_id=2)
    assert r.prompt_ids.tolist() == [[1, 2], [0, 3]] and r.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert r.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1]] and r.tool_mask.tolist() == [[0, 0, 0], [0, 1, 0]]
    assert r.is_truncated.tolist() == [False, True] and extra == {"hint": ["a", "b"]}
    with pytest.raises(ValueError, match="logprobs"):
        rollout_from_func({"prompt_ids": [[1]], "completion_ids": [[2]]}, 1, 0, 2)
    with pytest.raises(ValueError, match="expected 2"):
        rollout_from_func({**out, "hint": ["a"]}, 2, 0, 2)


@pytest.mark.parametrize("estimator", ["group_norm", "leave_one_out", "reinforce_pp", "reinforce_pp_baseline"])
def test_advantages_ignore_masked_holes(estimator):
    """A completion with a tool result in its middle (mask 0 there) gets, on its trained tokens, the
    advantages of the same completion without the hole."""
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0])
    holey = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 0, 1, 0, 1, 0]])
    compact = torch.zeros_like(holey)
    for i, row in enumerate(holey):
        compact[i, : int(row.sum())] = 1
    a, _ = compute_advantages(estimator, AdvantageInput(scores, holey, group_size=2))
    b, _ = compute_advantages(estimator, AdvantageInput(scores, compact, group_size=2))
    for i in range(4):
        torch.testing.assert_close(a[i][holey[i].bool()], b[i][compact[i].bool()])
        assert (a[i][~holey[i].bool()] == 0).all()


def test_gae_steps_over_masked_holes():
    """PPO's GAE over a completion with a tool result in its middle: the critic's values on the hole are
    never read (garbage there changes nothing), and the trained tokens get the advantages and returns of
    the same completion without the hole (KL rewards per token included)."""
    scores = torch.tensor([1.0, -0.5, 2.0])
    holey = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 1, 0], [1, 1, 1, 0, 1, 0]])
    g = torch.Generator().manual_seed(0)
    values = torch.randn(3, 6, generator=g)
    kl = torch.randn(3, 6, generator=g) * 0.1
    compact, c_values, c_kl = torch.zeros_like(holey), torch.zeros(3, 6), torch.zeros(3, 6)
    for i, row in enumerate(holey):
        n = int(row.sum())
        compact[i, :n] = 1
        c_values[i, :n], c_kl[i, :n] = values[i][row.bool()], kl[i][row.bool()]
    garbage = torch.where(holey.bool(), values, 100.0)
    a, ra = compute_advantages("gae", AdvantageInput(scores, holey, group_size=1, values=garbage,
                                                     token_rewards=torch.where(holey.bool(), kl, 50.0)),
                               gamma=0.9, lam=0.8, whiten_advantages=False)
    b, rb = compute_advantages("gae", AdvantageInput(scores, compact, group_size=1, values=c_values,
                                                     token_rewards=c_kl),
                               gamma=0.9, lam=0.8, whiten_advantages=False)
    for i in range(3):
        torch.testing.assert_close(a[i][holey[i].bool()], b[i][compact[i].bool()])
        torch.testing.assert_close(ra[i][holey[i].bool()], rb[i][compact[i].bool()])
        assert (a[i][~holey[i].bool()] == 0).all()
    # by hand, row 1 (trained tokens 0, 3, 4; its score -0.5 joins the last one's reward): A_t = delta_t + 0.72 A_t+1
    v, r = c_values[1, :3].tolist(), (c_kl[1, :3] + torch.tensor([0.0, 0.0, -0.5])).tolist()
    d2 = r[2] - v[2]
    d1 = r[1] + 0.9 * v[2] - v[1]
    d0 = r[0] + 0.9 * v[1] - v[0]
    a2, a1 = d2, d1 + 0.72 * d2
    assert a[1, [0, 3, 4]].tolist() == pytest.approx([d0 + 0.72 * a1, a1, a2], abs=1e-6)


def test_replayed_linear_outputs_of_a_multi_turn_rollout(model, tok):
    """The trainer's forward may take the sampler's recorded linear outputs (fed tokens included):
    it must give the log-probs of the plain forward."""
    _, r = _rollout(model, tok, Script(), record_linears=True)
    assert r.linear_outputs is not None and r.tool_mask.sum() > 0
    rows = torch.arange(r.completion_ids.shape[0])
    with torch.no_grad():
        plain, _ = completion_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
        replayed, _ = completion_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                                          replay=(r.linear_outputs, rows))
    attended = r.completion_mask.bool()
    torch.testing.assert_close(replayed[attended], plain[attended], atol=1e-4, rtol=1e-4)
