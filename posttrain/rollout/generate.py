"""The sampler of the online engine: prompts in, completions with their log-probs out.

`generate` is one loop over a backend (`backends.SamplerBackend`; docs/sampler.md), in numbered phases:

1. prefill: each distinct prompt once, whatever the number of samples per prompt and wherever a prompt's
   repeats sit in the batch (rows that alternate prompts included);
2. expand: the KV cache is copied to every row that continues a prompt (the `num_generations` samples of each
   prompt, and its repeats), so a group of G samples costs one prompt forward, not G, and gets room for the
   whole completion;
3. step: the decoded rows' last tokens in, their next-token logits out;
4. sample: one token per row (filtered, penalised), with its log-prob under the unfiltered distribution;
5. stop: EOS, a stop token or a stop string ends a row, or only its turn when `continue_turn` feeds it more;
6. drop: rows that have stopped leave the decoding batch (and their KV cache) once they are a quarter of
   it, so long-tail samples do not keep the whole group computing.

The backend computes logits and holds the model's state; the loop owns the rest, so a sampling or
stopping rule is read and changed in one place whatever computes the logits. `default_backend` picks
the built-in one: off the CPU (and for any model) `backends.ModelForward`, the model's own forward with
`logits_to_keep=1`; on CPU `cpu_backend.CPUDecoder`, the same forward with the few-rows kernels, or for
Llama- and Qwen2-style models a lean compiled step, optionally recording every linear output for
the training forward to replay (`record_linears`, `accel/replay.py`). A third backend (an inference server,
vLLM) is passed in place of the model.

We do not call `model.generate`: the trainer needs the log-prob of every sampled token under the
sampling distribution (before any filtering), the exact stop mask, and a sampler whose randomness
depends only on the seed and the row. With sharded weights (FSDP, ZeRO-3) every forward is a
collective, so the processes decode in lock-step until all have stopped (`backends.decodes_in_lockstep`,
`_keep_pace`); a rollout is the same as without it.

Image prompts (a vision-language model, `generate(..., vision=...)`: per prompt, its processor's outputs
besides the ids, {} for a prompt without images): the prefill takes each prompt's pixel values, so the
vision tower encodes a prompt's images once whatever num_generations, the steps read the image tokens
from the cache, and the rollout keeps each row's images (`Rollout.vision`, `forward/vision.py`) for the
training forward. A VLM's image tokens are suppressed (`SamplingConfig.suppress_token_ids`).

Tool images: for a tool result with images `continue_turn` returns (ids, the images' processor outputs). The
backend computes the images' features once (`SamplerBackend.image_embeddings`) and each image token is fed as
its feature, where the model's forward would place it; the rollout's `vision` then holds each row's prompt
images followed by its tool images, in the order fed, for the training forward, so the log-probs of sampling and
training agree. Such a turn that does not fit whole in the row's remaining `max_new_tokens` is not fed (a cut
would leave features without their tokens): the row ends there, truncated.

`forward.completions.completion_logprobs` is the teacher-forced counterpart the trainers use: the
log-probs of given completions, computing each distinct prompt once per forward (with gradients under
autograd). With `generate(..., record_linears=True)` the sampler also keeps every decoder layer's linear
outputs (prefill and decoding steps), and `completion_logprobs(..., replay=...)` takes them instead of
multiplying again, for a policy that has not moved since sampling (`accel/replay.py`).

Log-probs are those of softmax(logits / temperature) *before* top-k / top-p / min-p filtering,
i.e. the same quantity `forward.logprobs.token_logprobs(..., temperature=T)` recomputes; a trainer
can therefore use them as the "old policy" log-probs when the policy has not moved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from posttrain.core.log_softmax import selective_log_softmax
from posttrain.data.collate import pad
from posttrain.forward.vision import prompt_inputs, row_inputs
from posttrain.models.modes import unwrap
from posttrain.rollout.backends import ModelForward, SamplerBackend, model_device
from posttrain.rollout.cpu_backend import cpu_backend, sort_descending, top_p_filter

if TYPE_CHECKING:
    from posttrain.accel.replay import LinearRecord


@dataclass
class SamplingConfig:
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0            # 0 = off
    min_p: float = 0.0        # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; as transformers: logits of seen tokens / p if > 0, * p if < 0
    do_sample: bool = True    # False = greedy
    num_generations: int = 1  # samples per prompt
    stop_token_ids: tuple[int, ...] = ()   # besides EOS
    stop_strings: tuple[str, ...] = ()     # decoded-text stops (needs the tokenizer)
    suppress_token_ids: tuple[int, ...] = ()  # never sampled (a VLM's image tokens: no image stands behind them)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature} (use do_sample=False for greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1) (0 = off), got {self.min_p}")
        if self.num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {self.num_generations}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1.0 = off), got {self.repetition_penalty}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self.suppress_token_ids = tuple(int(t) for t in self.suppress_token_ids)
        self.stop_strings = (self.stop_strings,) if isinstance(self.stop_strings, str) else tuple(self.stop_strings)
        if any(not s for s in self.stop_strings):
            raise ValueError("stop_strings must not contain an empty string")


@dataclass
class Rollout:
    """Generated samples. N = num_prompts * num_generations, rows prompt-major: [p0g0, p0g1, ..., p1g0, ...]."""

    prompt_ids: Tensor        # (N, P) left-padded with pad_token_id
    prompt_mask: Tensor       # (N, P) 1 on real prompt tokens
    completion_ids: Tensor    # (N, C) right-padded with pad_token_id; C <= max_new_tokens (the loop stops when all rows stop)
    completion_mask: Tensor   # (N, C) 1 up to AND including the stop token (EOS / stop token / last token of a stop string)
    logprobs: Tensor          # (N, C) float32 log-prob of each sampled token under softmax(logits / temperature), before filtering; 0 on padding
    is_truncated: Tensor      # (N,) bool: no stop was produced within max_new_tokens
    linear_outputs: LinearRecord | None = None  # with record_linears, where the lean step ran (`accel/replay.py`)
    # with continue_turn: (N, C) 1 on tokens fed rather than sampled (tool results, the template between
    # turns); they are context (completion_mask 1) with log-prob 0, never trained on
    tool_mask: Tensor | None = None
    # with image prompts: the rows' images and image group (`forward.vision.row_inputs`), for the training forward
    vision: dict[str, Tensor] | None = None


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> Tensor:
    """Set the logits of tokens outside the sampling support to -inf. (..., V) -> (..., V).

    Applied in this order: top-k (ties with the k-th value are kept), top-p on the distribution
    left by top-k (keep the smallest prefix of the sorted tokens whose mass reaches top_p; the most
    likely token always stays), min-p (drop tokens with p < min_p * p_max). min-p is a ratio test,
    p_i / p_max = exp(l_i - l_max), so it does not depend on renormalisation and its place in the
    order does not matter.

    On CPU the kernels find each row's top-p cut from a histogram and a sort of the largest logits only
    (`top_p_filter`); the whole row is sorted where they cannot say (equal logits across the cut, a NaN).
    """
    V = logits.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        got = top_p_filter(logits, top_p)
        if got is None:
            logits = _top_p_by_sort(logits, top_p)
        else:  # the kernels' cut; the rows they leave undecided are cut by sorting
            logits, undecided = got
            if bool(undecided.any()):
                logits[undecided] = _top_p_by_sort(logits[undecided], top_p)
    if min_p > 0.0:
        top = logits.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(logits < top + math.log(min_p), float("-inf"))
    return logits


def _top_p_by_sort(logits: Tensor, top_p: float) -> Tensor:
    """`filter_logits`'s top-p cut of (..., V) logits by sorting each row whole."""
    sorted_logits, order, by_radix = sort_descending(logits)
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # mass of the strictly more likely tokens
    drop_sorted = mass_before >= top_p
    drop_sorted[..., 0] = False
    if by_radix and bool((drop_sorted[..., 1:] != drop_sorted[..., :-1]).logical_and_(
            sorted_logits[..., 1:] == sorted_logits[..., :-1]).any()):
        # equal logits on both sides of the cut: which of them is kept follows the sort's order of equal values,
        # so it is torch.sort's (a radix sort's values and masses are the same, its order of ties may not be)
        order = torch.sort(logits, dim=-1, descending=True).indices
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _sample(logits: Tensor, u: Tensor) -> Tensor:
    """One token per row from softmax(logits) by inverse CDF: (N, V) logits, (N,) uniforms -> (N,) ids.

    The caller draws one uniform per row and step from the generator (on the generator's own
    device, so a CPU generator drives a GPU model), so a row's sample depends only on the seed,
    its index and its distribution, not on which other rows are still being decoded.
    """
    cdf = logits.softmax(-1).cumsum(-1)
    # side="right": the first token whose cdf exceeds u, never a zero-probability token
    idx = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)
    return idx.clamp_(max=logits.shape[-1] - 1).squeeze(-1)


def _stop_string_hits(tokenizer, rows: list[list[int]], stop_strings: tuple[str, ...], window: int) -> list[bool]:
    """Whether each row's decoded tail contains one of the stop strings.

    Only the last `window` tokens are decoded: a stop string first completed at this step must
    overlap the newest token, and `window` covers the longest stop string even at 4 bytes per char.
    """
    texts = tokenizer.batch_decode([r[-window:] for r in rows], skip_special_tokens=True)
    return [any(s in text for s in stop_strings) for text in texts]


def default_backend(model, record: tuple[int, int, Tensor, int] | None = None) -> SamplerBackend:
    """The built-in backend for `model`: on CPU `cpu_backend.CPUDecoder` (`cpu_backend.cpu_backend`);
    elsewhere `backends.ModelForward`.

    record: (prefilled prompts, prompt width, (N,) the prefilled prompt of each rollout row, max_new_tokens) of a
    call whose linear outputs the lean step should record (`accel.replay.LinearRecord`), or None."""
    net = unwrap(model)
    if model_device(net).type != "cpu":
        return ModelForward(net)
    return cpu_backend(net, record)


def _any_rank(flag: bool, device: torch.device) -> bool:
    """`flag` or-ed over the processes (one all-reduce)."""
    value = torch.tensor([int(flag)], device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


def _keep_pace(backend: SamplerBackend, tokens: Tensor, t: int, attention: Tensor, positions: Tensor,
               max_new: int) -> None:
    """Lock-step decoding once this process's rows have all stopped at step t: the steps the other processes
    still run, with their outputs discarded, until every process has stopped (the flag each step, as in the
    decoding loop) or the length limit is reached. tokens (A,) the last ones sampled, positions (A, 1) the
    position of each row's first new token."""
    P = attention.shape[1] - max_new
    while True:
        backend.step(tokens, t, attention[:, : P + t + 1], positions + t)
        t += 1
        if t == max_new - 1 or not _any_rank(False, backend.device):
            return


@torch.no_grad()
def generate(model, prompt_ids: list[list[int]], sampling: SamplingConfig, *, pad_token_id: int,
             eos_token_id: int | list[int] | None, tokenizer=None,
             generator: torch.Generator | None = None, record_linears: bool = False,
             continue_turn=None, vision: list[dict[str, Tensor]] | None = None) -> Rollout:
    """Sample `sampling.num_generations` completions for each prompt (token-id lists, no padding).

    model: a causal LM, decoded by `default_backend(model)` and put in eval mode for the duration (then
    restored); or a `SamplerBackend` to decode through (docs/sampler.md). Greedy decoding
    (`do_sample=False`) picks the argmax; log-probs are still those of softmax(logits / temperature).
    With `record_linears`, the rollout keeps every decoder layer's linear outputs (`replay.LinearRecord`)
    when the lean decoding step runs (Llama/Qwen2-style models on CPU), else `linear_outputs` is None.

    continue_turn: multi-turn rollouts (`rollout.multiturn`). Called as `continue_turn(rows, tokens)` with
    the rows that stopped at this step and each one's tokens so far; returns per row None (the row
    finishes) or the ids to feed next (a tool result and the next assistant header; images: "Tool images"
    above), fed one per step, as if sampled, into the row's own KV cache (nothing is prefilled again); `tool_mask`.
    """
    _check_inputs(prompt_ids, sampling, tokenizer, vision)
    eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    G, max_new, B = sampling.num_generations, sampling.max_new_tokens, len(prompt_ids)
    P, N = max(len(p) for p in prompt_ids), B * G
    gathers = model.gathers_rows if isinstance(model, SamplerBackend) else True  # default_backend's do
    lead, source = _distinct_prompts(prompt_ids, vision, G, gathers)
    backend = model if isinstance(model, SamplerBackend) else default_backend(
        model, (len(lead), P, source, max_new) if record_linears else None)
    device = backend.device
    pad_token_id = _embeddable_pad(backend.input_vocab_size, pad_token_id, eos)
    prompts, prompt_mask, attention, next_position = _prompt_batch(prompt_ids, pad_token_id, G, max_new, device)
    stop_ids = torch.tensor(eos + list(sampling.stop_token_ids), dtype=torch.long, device=device)
    gen_device = generator.device if generator is not None else device

    rows = torch.arange(N, device=device)  # (A,) output row of each decoded row; A shrinks as rows are dropped
    finished = torch.zeros(N, dtype=torch.bool, device=device)
    tokens, logps, masks, fed_masks = [], [], [], []
    history: list[list[int]] = [[] for _ in range(N)]  # only filled for stop strings and continue_turn
    feeds = _Feeds(N, backend, max_new)  # ids (and tool images' features) still to feed (continue_turn)
    with backend:
        # 1. prefill: each distinct prompt once; 2. expand: each row gets its prompt's state, with room for the
        # whole completion -> (A, V) logits after each row's prompt
        logits = _prefill_and_expand(backend, prompts, prompt_mask, vision, lead, source, P + max_new)
        seen = None if sampling.repetition_penalty == 1.0 else _prompt_tokens_seen(
            prompts.repeat_interleave(G, dim=0), attention[:, :P], logits.shape[-1])
        for t in range(max_new):
            if t:  # 3. step: feed each decoded row its last token (t - 1), for the logits of token t
                logits = backend.step(tokens[-1][rows], t - 1, attention[:, : P + t], next_position + (t - 1),
                                      **feeds.fed_embeddings(rows))

            # 4. sample: from the penalised, filtered distribution; the log-prob is under softmax(logits / T)
            # one uniform per row, decoded or not: a row's draws depend only on the seed
            u = torch.rand(N, generator=generator, device=gen_device).to(device)[rows] if sampling.do_sample else None
            alive = ~finished
            token, logp, fed = _sample_step(logits, sampling, seen, u, rows, alive, pad_token_id, feeds)
            if seen is not None:
                seen[rows, token[rows]] = True
            tokens.append(token)
            logps.append(logp.masked_fill_(fed | finished, 0.0))
            masks.append(alive)
            fed_masks.append(fed)

            # 5. stop: EOS, a stop token or a stop string; a fed EOS closes a tool turn, not the completion, and
            # a row whose turn ended goes on when continue_turn gives it ids to feed
            stopped = _stopped(token, alive, fed, stop_ids, history, t, sampling, tokenizer, continue_turn, feeds)
            finished = finished | (stopped & alive)
            num_finished = int(finished.sum())  # the loop's one host sync per step
            if t == max_new - 1 or not (_any_rank(num_finished < N, device) if backend.lockstep else num_finished < N):
                break
            if num_finished == N:  # lock-step: stopped here, not everywhere
                _keep_pace(backend, token[rows], t, attention, next_position, max_new)
                break

            # 6. drop finished rows once they are a quarter of the batch (the copy of the cache this costs is
            # then paid back within a few steps)
            done_in_batch = num_finished - (N - len(rows))
            if done_in_batch and 4 * done_in_batch >= len(rows):
                keep = (~finished[rows]).nonzero().flatten()
                backend.select(keep)
                rows, attention, next_position = rows[keep], attention[keep], next_position[keep]

    return Rollout(
        prompt_ids=prompts.repeat_interleave(G, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(G, dim=0),
        completion_ids=torch.stack(tokens, dim=1),
        completion_mask=torch.stack(masks, dim=1).long(),
        logprobs=torch.stack(logps, dim=1),
        is_truncated=~finished | feeds.cut.to(device),
        linear_outputs=backend.linear_outputs,
        tool_mask=torch.stack(fed_masks, dim=1).long() if continue_turn is not None else None,
        vision=feeds.row_images(vision, B, G),
    )


class _Feeds:
    """What `continue_turn` gave rows to feed, one id per step: the ids and, for a tool turn with images (a
    vision-language model), the input embedding that replaces each image token's (its image's features,
    `SamplerBackend.image_embeddings`, computed once when the turn is given); each row's tool images (their
    processor outputs, in order) are kept for the training forward (`forward.vision.row_inputs`)."""

    def __init__(self, N: int, backend: SamplerBackend, max_new: int):
        self.backend, self.max_new = backend, max_new  # what computes tool images' features; max_new_tokens
        self.ids: dict[int, list[int]] = {}
        self.embeds: dict[int, list[Tensor | None]] = {}
        self.last: dict[int, Tensor] = {}  # row -> the embedding of the tool image token fed at the last step
        self.images: list[list[dict[str, Tensor]]] = [[] for _ in range(N)]
        self.cut = torch.zeros(N, dtype=torch.bool)  # rows ended because a tool turn's images did not fit

    def give(self, row: int, more, t: int) -> bool:
        """Queue `more` (ids, or (ids, the tool images' processor outputs)) for `row`, whose turn ended at step t;
        returns whether the row goes on. A tool turn with images that does not fit whole in the completion is not
        fed (the cut would leave image features without their tokens): the row ends there, truncated."""
        ids, images = more if isinstance(more, tuple) else (more, None)
        if not ids:
            return False
        if images:
            if len(ids) > self.max_new - t - 1:
                self.cut[row] = True
                return False
            self.embeds[row] = self.backend.image_embeddings(list(ids), images)
            self.images[row].append(images)
        self.ids[row] = list(ids)
        return True

    def row_images(self, vision: list[dict[str, Tensor]] | None, B: int, G: int) -> dict[str, Tensor] | None:
        """`Rollout.vision`: each row's prompt images (`vision`, per prompt) and then its tool images; None when
        there are neither."""
        if vision is None and not any(self.images):
            return None
        return row_inputs(vision or [{}] * B, G, tool_images=self.images)

    def pop(self, row: int) -> int:
        """The row's next id to feed; its embedding, when it is fed as one (a tool image's token), goes to `last`."""
        token = self.ids[row].pop(0)
        embed = self.embeds[row].pop(0) if row in self.embeds else None
        if embed is not None:
            self.last[row] = embed
        if not self.ids[row]:
            del self.ids[row]
            self.embeds.pop(row, None)
        return token

    def fed_embeddings(self, rows: Tensor) -> dict:
        """`SamplerBackend.step`'s `embeds` for the tokens fed at the last step ({} when none is a tool image's):
        which of the decoded rows `rows` (A,) take an embedding instead of their token's, and those embeddings in
        the rows' order."""
        last, self.last = self.last, {}
        if not last:
            return {}
        which = torch.isin(rows, torch.tensor(list(last), device=rows.device))
        return {"embeds": (which, torch.stack([last[r] for r in rows[which].tolist()]))}


def _distinct_prompts(prompt_ids: list[list[int]], vision: list[dict[str, Tensor]] | None, G: int,
                      gathers: bool) -> tuple[list[int], Tensor]:
    """(lead, source): the first prompt index of each distinct prompt (U,), and (B * G,) the distinct prompt each
    rollout row continues. Prompts are the same when their ids and images are. A backend without `gathers_rows`
    prefills every prompt: lead is 0..B-1 and source each prompt's G rows."""
    first: dict[tuple[int, ...], list[int]] = {}  # ids -> the distinct prompts (lead indices) with these ids
    lead, of = [], []
    for b, ids in enumerate(prompt_ids):
        same = next((u for u in first.get(tuple(ids), ()) if _same_images(vision, lead[u], b)), None) if gathers \
            else None
        if same is None:
            same = len(lead)
            lead.append(b)
            first.setdefault(tuple(ids), []).append(same)
        of.append(same)
    return lead, torch.tensor(of).repeat_interleave(G)


def _same_images(vision: list[dict[str, Tensor]] | None, a: int, b: int) -> bool:
    """Whether prompts a and b have the same images (processor outputs), or neither has any (`vision` None)."""
    if vision is None:
        return True
    x, y = vision[a], vision[b]
    return x.keys() == y.keys() and all(
        x[k].shape == y[k].shape and x[k].dtype == y[k].dtype and bool(torch.equal(x[k], y[k]))
        if isinstance(x[k], Tensor) else x[k] == y[k] for k in x)


def _prefill_and_expand(backend: SamplerBackend, prompts: Tensor, prompt_mask: Tensor, vision, lead: list[int],
                        source: Tensor, capacity: int) -> Tensor:
    """Phases 1 and 2 of `generate`: the backend's prefill of the distinct prompts `lead` (U,) of the (B, P) batch,
    then each of the N rows given its prompt's state (`source` (N,)) -> (N, V) logits after each row's prompt."""
    B, N = len(prompts), len(source)
    if len(lead) < B:
        index = torch.tensor(lead, device=prompts.device)
        prompts, prompt_mask = prompts[index], prompt_mask[index]
        vision = None if vision is None else [vision[i] for i in lead]
    logits = backend.prefill(prompts, prompt_mask, (prompt_mask.cumsum(-1) - 1).clamp_(min=0),
                             **({} if vision is None else {"vision": prompt_inputs(vision)}))
    if len(lead) == B:  # every prompt distinct: prompt-major groups of G
        backend.expand(N // B, capacity)
        return logits.repeat_interleave(N // B, dim=0)
    backend.expand_rows(source.to(backend.device), capacity)
    return logits[source.to(logits.device)]


def _prompt_batch(prompt_ids: list[list[int]], pad_token_id: int, G: int, max_new: int, device: torch.device):
    """The prompts (B, P) left-padded and their mask (B, P), from the lengths (pad may equal EOS or occur in
    prompts); the attention mask (B * G, P + max_new) of the rows, allocated once (the step that feeds token t
    sees its first P + t + 1 columns); and (B * G, 1) the position of each row's first new token."""
    lengths = torch.tensor([len(p) for p in prompt_ids], device=device)
    prompts = pad(prompt_ids, pad_token_id, side="left").to(device)
    P = prompts.shape[1]
    prompt_mask = (torch.arange(P, device=device) >= (P - lengths)[:, None]).long()
    attention = torch.ones(len(prompt_ids) * G, P + max_new, dtype=prompt_mask.dtype, device=device)
    attention[:, :P] = prompt_mask.repeat_interleave(G, dim=0)
    return prompts, prompt_mask, attention, lengths.repeat_interleave(G)[:, None]


def _check_inputs(prompt_ids: list[list[int]], sampling: SamplingConfig, tokenizer, vision) -> None:
    if not prompt_ids:
        raise ValueError("generate() got no prompts")
    if vision is not None and len(vision) != len(prompt_ids):
        raise ValueError(f"generate() got {len(vision)} prompts' images (vision=) for {len(prompt_ids)} prompts: "
                         "give one dict per prompt ({} for a prompt without images)")
    for i, ids in enumerate(prompt_ids):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
    if sampling.stop_strings and tokenizer is None:
        raise ValueError("stop_strings need the tokenizer: pass tokenizer= to generate()")


def _prompt_tokens_seen(prompt_rows: Tensor, prompt_mask: Tensor, V: int) -> Tensor:
    """(N, V) bool: the tokens of each row's prompt, the start of `repetition_penalty`'s record of seen tokens."""
    ids = torch.where(prompt_mask.bool(), prompt_rows, V)  # padding is sent to an extra column, dropped after
    return torch.zeros(len(ids), V + 1, dtype=torch.bool, device=ids.device).scatter_(1, ids, True)[:, :V]


def _sample_step(logits: Tensor, sampling: SamplingConfig, seen: Tensor | None, u: Tensor | None, rows: Tensor,
                 alive: Tensor, pad_token_id: int, feeds: _Feeds) -> tuple[Tensor, Tensor, Tensor]:
    """Phase 4 of `generate`: (N,) token of every row (pad where finished; the next fed id where `feeds` has
    one), its log-prob under softmax(logits / T) (the decoded rows' `logits` (A, V)), and which rows were fed."""
    N, device = len(alive), logits.device
    scaled = logits.float()
    if sampling.temperature != 1.0:
        scaled = scaled / sampling.temperature
    picked = _pick(scaled, sampling, None if seen is None else seen[rows], u)
    token = torch.full((N,), pad_token_id, dtype=torch.long, device=device).index_copy_(0, rows, picked)
    token = torch.where(alive, token, pad_token_id)
    logp = torch.zeros(N, device=device).index_copy_(0, rows, selective_log_softmax(scaled, picked))
    fed = torch.zeros(N, dtype=torch.bool, device=device)
    for i in list(feeds.ids):  # rows inside a tool result take its next id instead of their sample
        token[i], fed[i] = feeds.pop(i), True
    return token, logp, fed


def _stopped(token: Tensor, alive: Tensor, fed: Tensor, stop_ids: Tensor, history: list[list[int]], t: int,
             sampling: SamplingConfig, tokenizer, continue_turn, feeds: _Feeds) -> Tensor:
    """Phase 5 of `generate`: (N,) rows whose completion ends at step t (EOS, a stop token, a stop string; not
    a fed token). Appends each row's token to `history` where that is kept; a row whose turn ended and that
    `continue_turn` gives ids to feed goes on, its ids queued in `feeds`."""
    stopped = torch.isin(token, stop_ids) if len(stop_ids) else torch.zeros_like(alive)
    if sampling.stop_strings or continue_turn is not None:
        for row, tok in zip(history, token.tolist()):
            row.append(tok)
    if sampling.stop_strings:
        window = 4 * max(len(s) for s in sampling.stop_strings) + 4
        live = alive.nonzero().flatten().tolist()
        hits = _stop_string_hits(tokenizer, [history[i] for i in live], sampling.stop_strings, window)
        hit_rows = [i for i, hit in zip(live, hits) if hit]
        if hit_rows:
            stopped[hit_rows] = True
    stopped &= ~fed
    if continue_turn is not None and bool((stopped & alive).any()):
        ended = (stopped & alive).nonzero().flatten().tolist()
        for i, more in zip(ended, continue_turn(ended, [history[i][:t + 1] for i in ended])):
            if feeds.give(i, more, t):
                stopped[i] = False
    return stopped


def _embeddable_pad(input_vocab_size: int | None, pad_token_id: int | None, eos: list[int]) -> int:
    """The id padding is written with: the tokenizer's pad id, unless the backend cannot take it (a `[PAD]`
    added past the embedding matrix), then the first EOS (or 0). Masks mark padding, so its id is never read."""
    if pad_token_id is not None and (input_vocab_size is None or 0 <= pad_token_id < input_vocab_size):
        return pad_token_id
    return eos[0] if eos else 0


def _pick(scaled: Tensor, sampling: SamplingConfig, seen: Tensor | None, u: Tensor | None) -> Tensor:
    """Each row's token from its (A, V) logits / temperature: the suppressed tokens out, the repetition penalty on
    the tokens `seen` (A, V), then top-k / top-p / min-p, then inverse-CDF sampling with the uniforms u (A,); the
    argmax for greedy."""
    if sampling.suppress_token_ids:  # a filter like top-k: the log-probs stay those of the whole distribution
        scaled = scaled.index_fill(-1, torch.tensor(sampling.suppress_token_ids, device=scaled.device), float("-inf"))
    if seen is not None:
        scaled = _penalise(scaled, seen, sampling.repetition_penalty)
    if not sampling.do_sample:
        return scaled.argmax(-1)
    return _sample(filter_logits(scaled, sampling.top_k, sampling.top_p, sampling.min_p), u)


def _penalise(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """transformers' repetition penalty: (A, V) logits of seen tokens divided by `penalty` where positive,
    multiplied where negative (sampling only; log-probs stay the policy's own)."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
