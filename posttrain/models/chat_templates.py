"""TRL's chat-template helpers (`trl.chat_template_utils`): clone a template, get one fit for training,
parse tool calls back out of sampled text, and check that a template can render tool calls.

* `clone_chat_template` copies another tokenizer's template, special tokens and EOS onto a base
  model's tokenizer and grows the model's embeddings to match (rounded up, the spare rows named
  `<extra_id_N>` so the vocabulary and the embedding matrix stay the same size).
* `get_training_chat_template` returns a template that is prefix-preserving (an earlier turn renders
  the same whatever follows it, which multi-turn tool rollouts rely on) and marks what the assistant
  writes with `{% generation %}` (for `assistant_only_loss`), or None when the tokenizer's own already
  is both.
* `add_response_schema` sets the tokenizer's response parser (`response_template`, and TRL's older
  `response_schema`), which transformers' `parse_response` reads to turn sampled text into a message
  with `tool_calls`.

Departures from TRL (also in docs/migrating.md): TRL ships training versions of the DeepSeek-V3,
GPT-OSS, Llama 3, Qwen 2.5 and Qwen 3 templates and schemas for GLM-4-MoE, GPT-OSS, Llama 3.x and
Qwen 3 / 3.5; posttrain ships none of those files. It recognises templates by what they render:
one that renders conversations as plain ChatML (`<|im_start|>role\\n...<|im_end|>`, e.g. posttrain's
built-in models and Qwen2-style templates without a default system prompt) gets posttrain's ChatML
template, which has the markers and writes tool calls as `<tool_call>{...}</tool_call>`; others
raise a ValueError that says so.
"""

from __future__ import annotations

from posttrain.data.chat import CHATML_TEMPLATE, TOOL_CALL_END, TOOL_CALL_START

__all__ = ["CHATML_RESPONSE_SCHEMA", "CHATML_RESPONSE_TEMPLATE", "add_response_schema", "clone_chat_template", "get_training_chat_template",
           "is_chat_template_prefix_preserving", "supports_tool_calling"]

# How posttrain's ChatML template writes an assistant turn: optional text, then one
# <tool_call>{"name": ..., "arguments": {...}}</tool_call> per line, then <|im_end|>. Two spellings of the
# same parser: transformers' declarative `response_template` (what its `parse_response` reads now) and the
# older regex `response_schema` (what TRL sets and older transformers read).
CHATML_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        # \s* swallows the newline before a call, so it does not open an empty content region
        "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"\s*<\|im_end\|>", "content": "text"},
    },
}
CHATML_RESPONSE_SCHEMA = {
    "x-regex": r"^(?P<content>.*?)(?:\n?(?=<tool_call>))?(?P<tool_calls>(?:<tool_call>.+?</tool_call>\s*)+)?"
               r"\s*(?:<\|im_end\|>|$)",
    "type": "object",
    "properties": {
        "role": {"const": "assistant"},
        "content": {"type": "string"},
        "tool_calls": {
            "type": "array",
            "x-regex-iterator": r"<tool_call>\s*(.+?)\s*</tool_call>",
            "items": {"x-parser": "json", "x-parser-args": {"transform": "{type: 'function', function: @}"}},
        },
    },
}

# probe conversations: a plain exchange (to recognise ChatML) and a tool exchange whose parts are
# sentinels, so a template that drops any of them is caught
_PLAIN = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
          {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
_SENTINELS = ("tool_name_a8f3e2b1", "tool_arg_key_b9d4f5c2", "tool_arg_val_d6e7a9f3", "tool_content_c4f9a8e2")


def _tool_exchange(name: str, key: str, value: str, content: str, arguments_as_text: bool = False) -> list[dict]:
    arguments = f'{{"{key}": "{value}"}}' if arguments_as_text else {key: value}
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": name, "content": content}]


def _tokenizer_of(processing_class):
    return getattr(processing_class, "tokenizer", processing_class)  # a processor's inner tokenizer


def supports_tool_calling(processing_class) -> bool:
    """Whether the chat template renders a user -> assistant (tool call) -> tool exchange with every part of it
    (the call's name, its argument key and value, the tool's answer) present in the text; False when it fails
    to render it, or silently drops a part, or there is no template."""
    from jinja2 import TemplateError

    if not getattr(processing_class, "chat_template", None):
        return False
    try:
        rendered = processing_class.apply_chat_template(_tool_exchange(*_SENTINELS), tokenize=False)
    except TemplateError:
        return False
    return all(s in rendered for s in _SENTINELS)


def is_chat_template_prefix_preserving(processing_class) -> bool:
    """Whether a conversation ending in an assistant's tool call tokenises as a prefix of the same conversation
    continued with the tool's answer and a generation prompt (what a multi-turn rollout appends to)."""
    for as_text in (False, True):  # some templates only take JSON-string arguments
        messages = _tool_exchange("dummy", "a", "b", "dummy", arguments_as_text=as_text)
        try:
            ids1 = processing_class.apply_chat_template(messages[:2], tokenize=True, return_dict=False)
            ids2 = processing_class.apply_chat_template(messages, tokenize=True, return_dict=False,
                                                        add_generation_prompt=True)
        except TypeError:
            continue
        return list(ids2[:len(ids1)]) == list(ids1)
    return False


def _renders_as_chatml(tokenizer) -> bool:
    """Whether the template renders a plain conversation (and a generation prompt) exactly as ChatML does."""
    from jinja2 import TemplateError

    try:
        # with and without a system message: a template that adds a default one is not plain ChatML
        for messages, prompt in ((_PLAIN, True), (_PLAIN[:3], False), (_PLAIN[1:3], False)):
            ours = tokenizer.apply_chat_template(messages, chat_template=CHATML_TEMPLATE, tokenize=False,
                                                 add_generation_prompt=prompt)
            if tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt) != ours:
                return False
    except TemplateError:
        return False
    return True


def get_training_chat_template(tokenizer) -> str | None:
    """A training-ready chat template for `tokenizer`, or None when its own is one already.

    Training-ready: prefix-preserving and with `{% generation %}` / `{% endgeneration %}` around what the
    assistant writes, so `return_assistant_tokens_mask=True` (SFT's `assistant_only_loss`) works. A template
    that renders conversations as plain ChatML gets posttrain's ChatML template; any other raises ValueError.
    """
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("the tokenizer has no chat template; set one (tokenizer.chat_template = ...) or copy one "
                         "with clone_chat_template")
    if "{% generation %}" in template and is_chat_template_prefix_preserving(tokenizer):
        return None
    if _renders_as_chatml(tokenizer):
        return CHATML_TEMPLATE
    raise ValueError("The tokenizer's chat template is not training-compatible (missing prefix-preservation or "
                     "`{% generation %}` markers) and posttrain has no training version of it: only templates that "
                     "render plain ChatML are recognised. Add the markers around the assistant's text yourself and "
                     "set tokenizer.chat_template.")


def add_response_schema(processing_class):
    """Set the tokenizer's `response_schema` (what `tokenizer.parse_response` reads) for its chat template and
    return `processing_class` (for a processor, the schema goes on its inner tokenizer). Recognised: templates
    that write tool calls as posttrain's ChatML one does; others raise ValueError."""
    tokenizer = _tokenizer_of(processing_class)
    template = getattr(processing_class, "chat_template", None)
    if template == CHATML_TEMPLATE or (template and _renders_as_chatml(tokenizer)
                                       and _writes_chatml_tool_calls(processing_class)):
        tokenizer.response_template = CHATML_RESPONSE_TEMPLATE
        tokenizer.response_schema = CHATML_RESPONSE_SCHEMA
        return processing_class
    raise ValueError("Unrecognized chat template, failed to add response schema. posttrain knows the ChatML "
                     "<tool_call>{...}</tool_call> format only; set tokenizer.response_schema yourself (see "
                     "transformers' chat response parsing docs).")


def _writes_chatml_tool_calls(processing_class) -> bool:
    rendered = processing_class.apply_chat_template(_tool_exchange(*_SENTINELS)[:2], tokenize=False)
    call = f'{TOOL_CALL_START}{{"name": "{_SENTINELS[0]}", "arguments": {{"{_SENTINELS[1]}": "{_SENTINELS[2]}"}}}}'
    return call + TOOL_CALL_END in rendered


def clone_chat_template(model, tokenizer, source_tokenizer_path: str, resize_to_multiple_of: int | None = 64):
    """(model, tokenizer, added_token_ids) after giving `tokenizer` the chat template of the tokenizer at
    `source_tokenizer_path` (a folder, a hub name or a built-in `posttrain/...` name).

    The source's added tokens that `tokenizer` lacks are added, its EOS becomes `tokenizer`'s and the model's
    (config and generation config), and the embeddings grow to the vocabulary size rounded up to a multiple of
    `resize_to_multiple_of` (None: exactly), the spare rows filled with `<extra_id_N>` tokens so that
    `len(tokenizer.vocab) == model.vocab_size`. added_token_ids lists every token added, spares included.
    """
    from transformers import AddedToken

    from posttrain.models.loading import load_tokenizer

    source = load_tokenizer(source_tokenizer_path)
    if not getattr(source, "chat_template", None):
        raise ValueError(f"the tokenizer at {source_tokenizer_path!r} has no chat template to clone")
    tokenizer.chat_template = source.chat_template
    added = [t for t in source.added_tokens_decoder.values() if t.content not in tokenizer.get_vocab()]
    tokenizer.add_tokens(added)
    tokenizer.eos_token = source.eos_token
    model.config.eos_token_id = tokenizer.eos_token_id
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.resize_token_embeddings(new_num_tokens=len(tokenizer.get_vocab()), pad_to_multiple_of=resize_to_multiple_of)
    size = model.get_input_embeddings().weight.shape[0]
    idx = 0
    while size > len(tokenizer.get_vocab()):  # name the spare rows, so ids and rows stay one to one
        token = AddedToken(f"<extra_id_{idx}>")
        if tokenizer.add_tokens(token) == 1:
            added.append(token)
        idx += 1
    if len(tokenizer.get_vocab()) != size:
        raise RuntimeError(f"vocabulary size {len(tokenizer.get_vocab())} differs from the model's embedding size "
                           f"{size} after cloning the chat template")
    return model, tokenizer, tokenizer.convert_tokens_to_ids([t.content for t in added])
