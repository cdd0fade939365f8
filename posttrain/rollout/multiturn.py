"""Multi-turn rollouts: tools, environments and user rollout functions in the online engine.

A multi-turn rollout is the ordinary sampler (`rollout.generate`) continued. When a row stops at
EOS, `Episodes` (the sampler's `continue_turn`) decodes the turn, parses its
`<tool_call>{...}</tool_call>` blocks (`rollout.tools`), runs the calls (each with a timeout;
failures become the tool message's text), and hands back the chat template's rendering of the
tool turns and the next assistant header (`data.tokenize.continuation_ids`). The sampler feeds
those ids into the row's own KV cache, one per step, and the row samples its next turn; a row
whose turn has no tool call, or that has used `max_tool_calling_iterations`, or whose turn ended at a
stop string or stop token rather than EOS, finishes while the others go on. The fed ids are context
only: `Rollout.tool_mask` marks them and the trainer takes them out of the loss, the KL and the entropy.

`Tooling` is what a trainer keeps: the tools (`tools=`, Python functions) or the environment
factories (`environment_factory=`, TRL's protocol: a fresh instance per rollout, its public methods
are its tools, `reset(**row)` before the rollout may return text for the last user message,
`get_reward()` scores it). `rollout_from_func` turns a user `rollout_func`'s output into a `Rollout`.

`engine_turns` runs the same episodes over an engine that samples whole completions and keeps no
KV cache between calls (vLLM, colocated or behind a server): each turn is one call whose prompt is the
row's prompt, its completion so far and the fed ids; the server's prefix cache is what spares
recomputing them. With greedy decoding it gives the sampler's rollout token for token.

Departure from TRL: the sampled tokens are kept as they are and the template's continuation is
appended, rather than re-rendering the conversation; the two agree for templates that render a
conversation as a prefix of its continuation (`continuation_ids` checks it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch

from posttrain.data.collate import pad
from posttrain.data.tokenize import continuation_ids, continuation_text, encode_prompt
from posttrain.data.tools import environment_tools, tool_schemas
from posttrain.rollout.generate import Rollout
from posttrain.rollout.images import encode_tool_turn
from posttrain.rollout.tools import ToolImageError, assistant_turn, parse_tool_calls, run_tool_calls, tools_by_name, was_truncated

__all__ = ["Episodes", "Tooling", "engine_turns", "rollout_from_func"]


class Episodes:
    """The state of one batch of multi-turn rollouts (N rows), and the sampler's `continue_turn`.

    prompts: (N,) message lists; tools: (N,) {name: function} of each row; schemas: (N,) the
    schemas the chat template shows each row. After the rollout, `completions(rollout)` gives each
    episode as messages (assistant turns with their `tool_calls`, `tool` results) and `calls`,
    `failures`, `turns` count per row what happened.

    processor: a vision-language model's processor, whose rollouts take tools that return images: such a
    turn's continuation is the processor's expansion of the template's text (`images.encode_tool_turn`), handed
    to the sampler as (ids, the images' tensors); at most `max_images` tool images per episode (more: the result
    is an error text for the model). None (a text-only model): a tool returning an image raises ToolImageError.
    """

    def __init__(self, tokenizer, prompts: list[list[dict]], tools: list[Mapping[str, Callable]],
                 schemas: list[list[dict] | None], max_iterations: int, timeout: float,
                 max_call_chars: int | None = None, max_result_chars: int | None = None, processor=None,
                 max_images: int | None = None):
        self.tokenizer, self.prompts, self.tools, self.schemas = tokenizer, prompts, tools, schemas
        self.processor, self.max_images = processor, max_images
        self.max_iterations, self.timeout = max_iterations, timeout
        self.max_call_chars, self.max_result_chars = max_call_chars, max_result_chars
        N = len(prompts)
        self.turns: list[list[dict]] = [[] for _ in range(N)]  # messages after the prompt
        self.start = [0] * N  # where the current assistant turn begins in the row's completion ids
        self.calls, self.failures, self.iterations, self.truncated = [0] * N, [0] * N, [0] * N, [0] * N
        self.images = [0] * N  # tool images fed per row

    def __call__(self, rows: list[int], tokens: list[list[int]]) -> list[list[int] | tuple | None]:
        """The ids to feed after each row's finished turn ((ids, the images' processor outputs) for a turn with
        tool images), or None where the episode ends."""
        out: list[list[int] | None] = [None] * len(rows)
        jobs = []  # (position in rows, row, the turn's message, its calls, parse errors)
        eos = self.tokenizer.eos_token_id
        for j, (i, ids) in enumerate(zip(rows, tokens)):
            message, calls, errors = self.read_turn(i, self.tokenizer.decode(ids[self.start[i]:], skip_special_tokens=True))
            self.turns[i].append(message)
            # Only a turn closed by EOS continues: the template's continuation starts after that EOS, and a
            # stop string or stop token ends the completion as it does in a single-turn rollout.
            if ids and ids[-1] == eos and (calls or errors) and self.iterations[i] < self.max_iterations:
                jobs.append((j, i, calls, errors))
        results = iter(run_tool_calls([c for _, _, calls, _ in jobs for c in calls],
                                      [self.tools[i] for _, i, calls, _ in jobs for _ in calls], self.timeout,
                                      self.max_result_chars, images=self.processor is not None))
        for j, i, calls, errors in jobs:
            replies = [self._capped(i, *next(results)) for _ in calls]
            messages = [m for m, _ in replies] + [{"role": "tool", "name": "", "content": f"Error: {e}"} for e in errors]
            self.calls[i] += len(calls) + len(errors)
            self.failures[i] += sum(err is not None for _, err in replies) + len(errors)
            self.truncated[i] += sum(was_truncated(m) for m, _ in replies)
            self.iterations[i] += 1
            out[j] = self._continuation(i, messages)
            self.turns[i] += messages
            self.start[i] = len(tokens[j]) + len(out[j][0] if isinstance(out[j], tuple) else out[j])
        return out

    def read_turn(self, i: int, text: str) -> tuple[dict, list[dict], list[str]]:
        """Row i's sampled turn, as text -> (its assistant message, its well-formed tool calls, its parse errors)."""
        calls, errors = parse_tool_calls(text, self.max_call_chars)
        return assistant_turn(text, self.max_call_chars), calls, errors

    def _continuation(self, i: int, messages: list[dict]) -> list[int] | tuple[list[int], dict]:
        """Row i's ids after its turn when `messages` (tool results) follow; with images, (ids, their tensors)."""
        images = [(m["name"], p["image"]) for m in messages if not isinstance(m["content"], str)
                  for p in m["content"] if p.get("type") == "image"]
        if not images:
            return continuation_ids(self.tokenizer, self.prompts[i] + self.turns[i], messages, tools=self.schemas[i])
        text = continuation_text(self.tokenizer, self.prompts[i] + self.turns[i], messages, tools=self.schemas[i])
        return encode_tool_turn(self.processor, text, [image for _, image in images], [name for name, _ in images])

    def _capped(self, i: int, message: dict, error: str | None) -> tuple[dict, str | None]:
        """A tool message of row i, or in its place an error text when its images would take the row past
        `max_images` tool images."""
        count = 0 if isinstance(message["content"], str) else sum(p.get("type") == "image" for p in message["content"])
        if count and self.max_images is not None and self.images[i] + count > self.max_images:
            error = (f"Error: {message['name']} returned {count} image(s), but this episode already holds "
                     f"{self.images[i]} tool image(s) and may hold at most {self.max_images} (max_tool_images); "
                     "the images were not shown")
            return {"role": "tool", "name": message["name"], "content": error}, error
        self.images[i] += count
        return message, error

    def completions(self, rollout: Rollout) -> list[list[dict]]:
        """Each row's episode as messages; a row cut by the length limit gets its last, unfinished turn
        (text fed inside a tool turn that was cut is dropped)."""
        lengths = rollout.completion_mask.sum(1).tolist()
        for i, (ids, n) in enumerate(zip(rollout.completion_ids.tolist(), lengths)):
            if rollout.is_truncated[i] and self.start[i] < n:
                self.turns[i].append(assistant_turn(self.tokenizer.decode(ids[self.start[i]:n],
                                                                          skip_special_tokens=True)))
        return self.turns

    def metrics(self, gather: Callable[[torch.Tensor], torch.Tensor] = lambda x: x) -> dict[str, float]:
        """Tool metrics over the rows of every process: `gather` takes this process's (N,) per-row counts to
        all processes' (the trainer's row gather; every process must call it, in the same order)."""
        calls, failures, iterations, truncated = (gather(torch.tensor(v, dtype=torch.float32))
                                                  for v in (self.calls, self.failures, self.iterations, self.truncated))
        total = calls.sum().item()
        out = {"tools/calls_per_completion": calls.mean().item() if calls.numel() else 0.0,
               "tools/failure_rate": failures.sum().item() / total if total else 0.0,
               "tools/turns_per_episode": (iterations.mean().item() if iterations.numel() else 0.0) + 1}
        if self.max_result_chars is not None:  # results are cut only with a cap
            out["tools/truncation_rate"] = truncated.sum().item() / total if total else 0.0
        return out


class Tooling:
    """A trainer's tools: functions (`tools=`) or environment factories (`environment_factory=`).

    environment_factory: a callable returning a fresh environment, or {name: callable} with an
    `environment` column naming each row's. `schemas_for(row)` gives the chat template's tools for a
    dataset row; `episodes(...)` starts a batch of rollouts (fresh environments, `reset(**row)`);
    `reset_dataset(args)` stands in for a missing train_dataset (reset() then writes every prompt).
    """

    def __init__(self, tools: Sequence[Callable] | None = None, environment_factory=None,
                 max_iterations: int = 10, timeout: float = 10.0, max_call_chars: int | None = None,
                 max_result_chars: int | None = None, max_images: int | None = None):
        if tools and environment_factory is not None:
            raise ValueError("give tools= or environment_factory= (an environment's methods are its tools), not both")
        self.tools = tools_by_name(list(tools or []))
        self.factories = (environment_factory if isinstance(environment_factory, Mapping)
                          else None if environment_factory is None else {None: environment_factory})
        for name, factory in (self.factories or {}).items():
            if not callable(factory):
                raise TypeError(f"environment_factory[{name!r}] must be a callable returning an environment, "
                                f"got {factory!r}")
        self.max_iterations, self.timeout = max_iterations, timeout
        self.max_call_chars, self.max_result_chars, self.max_images = max_call_chars, max_result_chars, max_images
        self.prompt_from_reset = False  # set by `reset_dataset`: no train_dataset, reset() writes each prompt
        # the schemas of each environment kind, from one probe instance (same methods on every instance)
        self._schemas = ({name: tool_schemas(environment_tools(factory())) for name, factory in self.factories.items()}
                         if self.factories else {None: tool_schemas(list(self.tools.values()))})

    def _kind(self, row: Mapping):
        if self.factories is None or None in self.factories:
            return None
        kind = row.get("environment")
        if kind not in self.factories:
            raise ValueError(f"the 'environment' column must name one of {sorted(self.factories)} "
                             f"(the keys of environment_factory), got {kind!r}")
        return kind

    def reset_dataset(self, args):
        """The prompts of a run without a train_dataset: one generation batch of empty user messages, which
        each environment's `reset()` (called without a `prompt`) fills with its text; `max_steps` (required)
        says how long to train, cycling over them."""
        from datasets import Dataset

        if self.factories is None or None not in self.factories:
            raise ValueError("train_dataset is required with tools= or a dict environment_factory (its "
                             "'environment' column chooses each row's environment); only a single "
                             "environment_factory can supply the prompts through reset()")
        if args.max_steps <= 0:
            raise ValueError("environment_factory without a train_dataset: set max_steps (the number of training "
                             "steps), since reset() supplies the prompts and there is no dataset to count epochs over")
        self.prompt_from_reset = True
        size = max(1, args.per_process_generation // args.num_generations) * max(1, args.world_size)
        return Dataset.from_list([{"prompt": [{"role": "user", "content": ""}]} for _ in range(size)])

    def schemas_for(self, row: Mapping) -> list[dict]:
        return self._schemas[self._kind(row)]

    def environment_rewards(self) -> list[Callable]:
        """One reward function per environment kind with `get_reward`, named after its class; it reads
        the `environments` the trainer passes with the columns, and abstains (None) on other kinds' rows."""
        funcs = []
        for name, factory in (self.factories or {}).items():
            probe = factory()
            if not callable(getattr(probe, "get_reward", None)):
                continue
            kind = type(probe)

            def reward(completions, environments, _kind=kind, **kwargs):
                return [env.get_reward() if type(env) is _kind else None for env in environments]

            reward.__name__ = kind.__name__
            funcs.append(reward)
        return funcs

    def episodes(self, tokenizer, prompts: list, columns: dict[str, list], num_generations: int,
                 max_prompt_length: int | None, processor=None) -> tuple[Episodes, list | None, list[list[int]] | None]:
        """(episodes, environments or None, prompt ids per prompt or None when unchanged) for N rows
        (prompt-major, `num_generations` per prompt). Each row gets a fresh environment, `reset` with
        the row's columns (and `prompt`); text it returns is appended to the last user message, which
        must then be the same across a group (its rows share one prefill). processor: a vision-language
        model's, whose tools may return images (`Episodes`)."""
        N = len(prompts)
        if any(not isinstance(p, list) for p in prompts):
            raise ValueError("tools and environments need conversational prompts (lists of messages): the chat "
                             "template is what shows the tools to the model and renders the tool turns")
        rows = [{**{k: v[i] for k, v in columns.items()}, "prompt": prompts[i]} for i in range(N)]
        kinds = [self._kind(row) for row in rows]
        if self.factories is None:
            env_list, tools = None, [self.tools] * N
        else:
            env_list = [self.factories[kind]() for kind in kinds]
            tools = [tools_by_name(environment_tools(env)) for env in env_list]
        prompts = [list(p) for p in prompts]
        new_ids = None
        if env_list is not None:
            for i, (env, row) in enumerate(zip(env_list, rows)):
                reset = getattr(env, "reset", None)
                if self.prompt_from_reset:  # no dataset: the row is a stand-in, reset() writes the prompt
                    text = reset(**{k: v for k, v in row.items() if k != "prompt"}) if callable(reset) else None
                    if not text or not isinstance(text, str):
                        raise ValueError(f"without a train_dataset, {type(env).__name__}.reset() must return the "
                                         f"prompt (a non-empty string, the user message); it returned {text!r}")
                else:
                    text = reset(**row) if callable(reset) else None
                if text:
                    last = max(j for j, m in enumerate(prompts[i]) if m.get("role") == "user")
                    prompts[i][last] = {**prompts[i][last], "content": f"{prompts[i][last]['content']}{text}"}
            firsts = prompts[::num_generations]
            for i, p in enumerate(prompts):
                if p != firsts[i // num_generations]:
                    raise ValueError(f"row {i}: reset() returned text that differs within a group of "
                                     f"{num_generations} rollouts of one prompt; return the same text for the "
                                     "same row (the group shares one prompt)")
            if any(p != q for p, q in zip(prompts, (r["prompt"] for r in rows))):
                if processor is not None:
                    raise ValueError("an environment's reset() returned text for a vision-language model's prompt: "
                                     "the prompt would have to be encoded again with its images; put the text in "
                                     "the dataset's prompt instead")
                new_ids = [encode_prompt(tokenizer, p, tools=self._schemas[k])
                           for p, k in zip(firsts, kinds[::num_generations])]
                if max_prompt_length:
                    new_ids = [ids[-max_prompt_length:] for ids in new_ids]
        episodes = Episodes(tokenizer, prompts, tools, [self._schemas[k] for k in kinds], self.max_iterations,
                            self.timeout, self.max_call_chars, self.max_result_chars, processor, self.max_images)
        return episodes, env_list, new_ids


def engine_turns(generate_turn: Callable, prompt_ids: list[list[int]], sampling, continue_turn,
                 pad_token_id: int, eos_token_id) -> Rollout:
    """A multi-turn rollout (`continue_turn`: an `Episodes`) over an engine that samples whole completions.

    generate_turn(prompt_ids, sampling) -> Rollout (as `vllm_engine` engines' `generate`). The first call
    samples `num_generations` rows per prompt; then, while some row's turn ended with a stop,
    `continue_turn(rows, tokens)` gives each such row the ids to feed (or None: it finishes), and every
    row that goes on samples its next turn in one call (n=1) from prompt + completion + fed ids, with the
    completion budget it has left. As in `generate`, fed ids count against `max_new_tokens`, take log-prob 0
    and `tool_mask` 1, and a row whose budget runs out is truncated."""
    max_new, G = sampling.max_new_tokens, sampling.num_generations
    prompts = [list(p) for p in prompt_ids for _ in range(G)]
    N = len(prompts)
    ids, logps, fed = [[] for _ in range(N)], [[] for _ in range(N)], [[] for _ in range(N)]
    truncated = [False] * N

    def take(rows: list[int], rollout: Rollout) -> list[int]:  # append each row's new turn; the rows that stopped
        lengths = rollout.completion_mask.sum(1).tolist()
        for j, i in enumerate(rows):
            ids[i] += rollout.completion_ids[j, :lengths[j]].tolist()
            logps[i] += rollout.logprobs[j, :lengths[j]].tolist()
            fed[i] += [0] * lengths[j]
            truncated[i] = bool(rollout.is_truncated[j])
        return [i for i in rows if not truncated[i]]

    ended = take(list(range(N)), generate_turn([list(p) for p in prompt_ids], sampling))
    while ended:
        going = []
        for i, more in zip(ended, continue_turn(ended, [list(ids[i]) for i in ended])):
            if isinstance(more, tuple):  # (ids, images): a tool returned an image
                raise ToolImageError("a tool returned an image, but this engine samples from token ids only and "
                                     "cannot be fed the image's features; posttrain's own sampler can "
                                     "(use_vllm=False)")
            if not more:
                continue
            room = max_new - len(ids[i])
            ids[i] += list(more[:room])
            logps[i] += [0.0] * len(more[:room])
            fed[i] += [1] * len(more[:room])
            if len(more) >= room:  # no room left to sample: cut, as the sampler's length limit cuts
                truncated[i] = True
            else:
                going.append(i)
        ended = []
        by_budget: dict[int, list[int]] = {}  # one call per budget: max_tokens is per request
        for i in going:
            by_budget.setdefault(max_new - len(ids[i]), []).append(i)
        for budget, rows in by_budget.items():
            turn = dataclasses.replace(sampling, num_generations=1, max_new_tokens=budget)
            ended += take(rows, generate_turn([prompts[i] + ids[i] for i in rows], turn))
    rollout, _ = rollout_from_func({"prompt_ids": prompts, "completion_ids": ids, "logprobs": logps, "tool_mask": fed},
                                   N, pad_token_id, eos_token_id)
    rollout.is_truncated = torch.tensor(truncated)
    return rollout


def rollout_from_func(output: Mapping, num_rows: int, pad_token_id: int, eos_token_id) -> tuple[Rollout, dict]:
    """(Rollout, extra columns for the reward functions) from a `rollout_func`'s output.

    output: {"prompt_ids": N lists, "completion_ids": N lists, "logprobs": N lists (one per
    completion token, under the sampling temperature), optional "tool_mask": N lists (1 on tokens
    not to train on), any other key: N values for the reward functions}. N = num_rows.
    """
    missing = [k for k in ("prompt_ids", "completion_ids", "logprobs") if k not in output]
    if missing:
        raise ValueError(f"rollout_func must return a dict with prompt_ids, completion_ids and logprobs "
                         f"(one list per completion); {missing} missing from its keys {sorted(output)}")
    for key, value in output.items():
        if len(value) != num_rows:
            raise ValueError(f"rollout_func returned {len(value)} {key!r} values; expected {num_rows} "
                             "(num_generations per prompt, prompt-major)")
    prompt_ids = [list(map(int, p)) for p in output["prompt_ids"]]
    completion_ids = [list(map(int, c)) for c in output["completion_ids"]]
    for i, (c, lp) in enumerate(zip(completion_ids, output["logprobs"])):
        if len(lp) != len(c):
            raise ValueError(f"rollout_func row {i}: {len(lp)} logprobs for {len(c)} completion tokens")
        if not c:
            raise ValueError(f"rollout_func row {i}: the completion is empty; give at least one token")
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id or [])
    lengths = torch.tensor([len(p) for p in prompt_ids])
    prompts = pad(prompt_ids, pad_token_id, side="left")
    P = prompts.shape[1]
    completions = pad(completion_ids, pad_token_id)
    C = completions.shape[1]
    mask = (torch.arange(C) < torch.tensor([len(c) for c in completion_ids])[:, None]).long()
    tool_mask = None
    if "tool_mask" in output:
        tool_mask = pad([list(map(int, m)) for m in output["tool_mask"]], 0)
    rollout = Rollout(
        prompt_ids=prompts, prompt_mask=(torch.arange(P) >= (P - lengths)[:, None]).long(),
        completion_ids=completions, completion_mask=mask,
        logprobs=pad([[float(x) for x in lp] for lp in output["logprobs"]], 0, dtype=torch.float32),
        is_truncated=torch.tensor([c[-1] not in eos for c in completion_ids]), tool_mask=tool_mask)
    extra = {k: list(v) for k, v in output.items() if k not in ("prompt_ids", "completion_ids", "logprobs", "tool_mask")}
    return rollout, extra
