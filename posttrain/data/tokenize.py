"""Per-format tokenisation: rows of text or chat messages -> token ids and masks.

Every trainer tokenises through `encode_prompt` and `encode_prompt_completion`, so the rules
live in one place:

* standard rows: the prompt is tokenised with the tokenizer's special tokens (BOS where the
  model has one), the completion without, followed by EOS;
* conversational rows: the chat template renders prompt (with the generation prompt) and
  prompt + completion; the completion is what the second adds to the first;
* a row's tools (its `tools` column: schemas, functions or a JSON string) go to the chat
  template as transformers' `tools=` argument, and need conversational rows;
* `template_kwargs` (e.g. a row's `chat_template_kwargs` such as `{"enable_thinking": False}`)
  go to every chat-template call for the row, as extra template variables;
* a prompt that leaves no room for a completion under `max_length` is an error that names the
  row; a long completion is cut to fit (and the caller is told, so it can report how many).
"""

from __future__ import annotations

from posttrain.core.process_rewards import IGNORE
from posttrain.data import formats
from posttrain.data.chat import require_chat_template, template_inputs, template_variables


class TokenizeError(ValueError):
    pass


def _is_messages(value) -> bool:
    return isinstance(value, list) and (not value or isinstance(value[0], dict))


def _chat(tokenizer, messages, tools=None, template_kwargs=None, **kwargs) -> dict:
    messages, tools = template_inputs(messages, tools)
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                         **template_variables(template_kwargs), **kwargs)


def _no_tools_for_text(tools) -> None:
    if tools:
        raise TokenizeError("tools need conversational rows (lists of messages): a chat template is what "
                            "shows the tools to the model; drop the 'tools' column or use message lists")


def encode_prompt(tokenizer, prompt, tools=None, template_kwargs=None) -> list[int]:
    """Token ids of a prompt, a string or a list of messages (rendered with the generation prompt).

    tools: the row's tools for the chat template (see `posttrain.data.chat.template_tools`);
    template_kwargs: extra variables for the chat template.
    """
    if _is_messages(prompt):
        require_chat_template(tokenizer)
        return list(_chat(tokenizer, prompt, tools, template_kwargs, add_generation_prompt=True)["input_ids"])
    _no_tools_for_text(tools)
    return list(tokenizer(prompt)["input_ids"])


def check_prompts(dataset, tokenizer, what: str = "train_dataset") -> None:
    """Refuse, naming the row, a prompt the online trainers cannot generate from.

    Every `prompt` must be a string or a list of {'role','content'} messages (checked here, at
    construction, rather than at the first step), and an empty string prompt must give at least
    one token (a BOS): generation starts from the prompt's last token. Datasets without a
    `prompt` column (pre-tokenised `input_ids`) are left alone.
    """
    columns = getattr(dataset, "column_names", None) or (list(dataset[0]) if len(dataset) else [])
    if "prompt" not in columns:
        return
    try:
        formats.validate(dataset, formats.FormatInfo("prompt_only", False, ("prompt",)))
    except formats.FormatError as err:
        raise TokenizeError(f"{what}: {err}") from None
    if encode_prompt(tokenizer, ""):
        return
    prompts = dataset["prompt"] if hasattr(dataset, "column_names") else [row["prompt"] for row in dataset]
    empty = next((i for i, p in enumerate(prompts) if isinstance(p, str) and not p), None)
    if empty is not None:
        raise TokenizeError(
            f"{what}: row {empty}, column 'prompt': the prompt is the empty string and this tokenizer adds no "
            f"BOS token, so it gives no token to generate from; give the prompt some text (or a chat message), "
            f"or use a tokenizer that adds a BOS token")


def encode_prompt_completion(tokenizer, prompt, completion, max_length: int | None = None,
                             row: int | None = None, tools=None, template_kwargs=None) -> dict:
    """{"prompt_ids", "completion_ids", "truncated"} for one row; EOS ends a standard completion.

    A conversational completion may hold several turns (tool calls, `tool` results, the answer).
    Raises TokenizeError naming the row when the prompt alone reaches `max_length`.
    """
    prompt_ids = encode_prompt(tokenizer, prompt, tools, template_kwargs)
    if _is_messages(prompt) or _is_messages(completion):
        full = list(_chat(tokenizer, list(prompt) + list(completion), tools, template_kwargs)["input_ids"])
        if full[: len(prompt_ids)] != prompt_ids:
            raise TokenizeError(
                f"row {row}: the chat template does not render the prompt as a prefix of prompt + completion, "
                "so the completion tokens cannot be located; use a template whose generation prompt is a prefix")
        completion_ids = full[len(prompt_ids):]
    else:
        completion_ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
        if tokenizer.eos_token_id is not None:
            completion_ids.append(tokenizer.eos_token_id)
    truncated = False
    if max_length is not None:
        if len(prompt_ids) >= max_length:
            raise TokenizeError(
                f"row {row}: the prompt is {len(prompt_ids)} tokens, which leaves no room for a completion "
                f"under max_length={max_length}; raise max_length or shorten/filter long prompts")
        room = max_length - len(prompt_ids)
        truncated = len(completion_ids) > room
        completion_ids = completion_ids[:room]
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "truncated": truncated}


def continuation_ids(tokenizer, messages, new_messages, tools=None) -> list[int]:
    """Token ids to append after a sampled assistant turn when `new_messages` (tool results) follow:
    `continuation_text`, tokenised."""
    return list(tokenizer(continuation_text(tokenizer, messages, new_messages, tools), add_special_tokens=False)
                ["input_ids"])


def continuation_text(tokenizer, messages, new_messages, tools=None) -> str:
    """The text to append after a sampled assistant turn when `new_messages` (tool results) follow.

    messages: the conversation so far, ending with the sampled assistant turn (as a message, e.g.
    `posttrain.rollout.tools.assistant_turn`); its tokens end with the EOS the sampler stopped at.
    The ids are the chat template's rendering of `messages + new_messages` with the generation
    prompt, from just after that turn's last EOS token: what closes the turn (ChatML's newline),
    the new turns, and the next assistant header. Appending them to a row's cache continues the
    conversation without rendering and prefilling it again; they are context, not trained on.
    Raises TokenizeError when the template does not render `messages` as a prefix of the longer
    conversation, or writes no EOS token in it.
    """
    require_chat_template(tokenizer)
    messages, tools = template_inputs(list(messages), tools)
    new_messages, _ = template_inputs(list(new_messages))
    kwargs = {"tools": tools} if tools else {}
    before = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    after = tokenizer.apply_chat_template(messages + new_messages, tokenize=False, add_generation_prompt=True,
                                          **kwargs)
    eos = tokenizer.eos_token
    if not after.startswith(before) or not eos or eos not in before:
        raise TokenizeError(
            f"the chat template does not render the conversation as a prefix of the conversation with the new "
            f"messages, ending the assistant turn with the EOS token {eos!r}; a multi-turn rollout cannot "
            f"append the new turns to the sampled tokens")
    return after[before.rindex(eos) + len(eos):]


def encode_text(tokenizer, text, assistant_only: bool = False, tools=None, template_kwargs=None) -> dict:
    """{"input_ids", "loss_mask"} for language-modeling rows: a string (+ EOS) or a conversation.

    With `assistant_only`, the loss mask covers only what assistant turns say, read from the
    chat template's {% generation %} markers: their text and tool calls, never a `tool` result.
    """
    if _is_messages(text):
        require_chat_template(tokenizer)
        out = _chat(tokenizer, text, tools, template_kwargs, return_assistant_tokens_mask=assistant_only)
        ids = list(out["input_ids"])
        if assistant_only:
            mask = list(out["assistant_masks"])
            if not any(mask):
                raise TokenizeError(
                    "assistant_only_loss found no assistant tokens: the chat template needs "
                    "{% generation %} ... {% endgeneration %} markers around assistant content "
                    "(posttrain.data.chat.CHATML_TEMPLATE has them), or the row has no assistant turn")
            return {"input_ids": ids, "loss_mask": mask}
        return {"input_ids": ids, "loss_mask": [1] * len(ids)}
    if assistant_only:
        raise TokenizeError("assistant_only_loss needs conversational data (a 'messages' column)")
    _no_tools_for_text(tools)
    ids = list(tokenizer(text)["input_ids"])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return {"input_ids": ids, "loss_mask": [1] * len(ids)}


def encode_sft_row(tokenizer, row, i: int | None, *, language_modeling: bool, conversational: bool,
                   completion_only: bool, assistant_only: bool, max_length: int | None = None,
                   template_kwargs=None) -> dict:
    """{"input_ids", "loss_mask", "truncated"} of one SFT row: language modeling (`text` or, when
    `conversational`, `messages`) or prompt-completion (`prompt`, `completion`), its `tools` shown to the
    chat template. The loss mask covers every token, or the completion only (`completion_only`, prompt-
    completion rows), or what assistant turns say (`assistant_only`), or both of the last two. `truncated`
    tells whether the row is longer than `max_length` (a prompt-completion row is cut to it here)."""
    tools = row.get("tools")
    if language_modeling:
        out = encode_text(tokenizer, row["messages"] if conversational else row["text"],
                          assistant_only=assistant_only, tools=tools, template_kwargs=template_kwargs)
        return {"input_ids": out["input_ids"], "loss_mask": out["loss_mask"],
                "truncated": max_length is not None and len(out["input_ids"]) > max_length}
    out = encode_prompt_completion(tokenizer, row["prompt"], row["completion"], max_length, row=i,
                                   tools=tools, template_kwargs=template_kwargs)
    n_prompt, n_completion = len(out["prompt_ids"]), len(out["completion_ids"])
    ids = out["prompt_ids"] + out["completion_ids"]
    mask = [0] * n_prompt + [1] * n_completion if completion_only else [1] * len(ids)
    if assistant_only:
        full = encode_text(tokenizer, list(row["prompt"]) + list(row["completion"]), assistant_only=True,
                           tools=tools, template_kwargs=template_kwargs)
        mask = [m & a for m, a in zip(mask, full["loss_mask"])]
    return {"input_ids": ids, "loss_mask": mask, "truncated": out["truncated"]}


def render_chat(tokenizer, messages, tools=None, template_kwargs=None, **kwargs) -> str:
    """The chat template's text of `messages` (what `_chat` tokenises), with the row's tools and variables."""
    messages, tools = template_inputs(messages, tools)
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         **template_variables(template_kwargs), **kwargs)


def encode_steps(tokenizer, prompt: str, steps: list[str], labels: list, *, step_separator: str, max_length=None,
                 max_prompt_length=None, max_completion_length=None, last_step_only: bool = False) -> dict:
    """A stepwise row for a process reward model -> {"input_ids", "labels"}: the prompt (after the BOS token,
    where the tokenizer has one), then each step followed by `step_separator`; a step's label (int) sits at its
    separator's last token, -100 everywhere else. Truncation keeps the prompt's last `max_prompt_length`
    tokens, the steps' first `max_completion_length` and the whole row's first `max_length`."""
    separator = tokenizer(step_separator, add_special_tokens=False)["input_ids"]
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None:
        prompt_ids = [tokenizer.bos_token_id] + prompt_ids
    if max_prompt_length is not None:
        prompt_ids = prompt_ids[-max_prompt_length:]
    labels = [int(x) for x in labels]
    if last_step_only:
        labels = [IGNORE] * (len(labels) - 1) + labels[-1:]
    step_ids = [tokenizer(s, add_special_tokens=False)["input_ids"] + separator for s in steps]
    completion = [t for s in step_ids for t in s]
    step_labels = [y for s, label in zip(step_ids, labels) for y in [IGNORE] * (len(s) - 1) + [label]]
    if max_completion_length is not None:
        completion, step_labels = completion[:max_completion_length], step_labels[:max_completion_length]
    input_ids, labels = prompt_ids + completion, [IGNORE] * len(prompt_ids) + step_labels
    if max_length is not None:
        input_ids, labels = input_ids[:max_length], labels[:max_length]
    return {"input_ids": input_ids, "labels": labels}
