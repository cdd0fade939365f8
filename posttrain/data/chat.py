"""Chat templates: the built-in ChatML template, with {% generation %} markers so assistant-only
loss masks work, and a helper to give a tokenizer that lacks a template this one.

Tool calling follows transformers: tools reach the template as its `tools=` argument (a list of
JSON schemas), assistant messages carry `tool_calls`, and `tool` messages carry the results.
`template_inputs` turns a dataset row's messages and `tools` value into what the template gets.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # also the EOS token: one stop token for chat and plain text

# ChatML with {% generation %} markers around what the assistant writes, so
# `apply_chat_template(..., return_assistant_tokens_mask=True)` yields assistant-only masks.
# Tools (transformers' `tools=` argument: JSON schemas) are listed in a system turn, merged with
# the conversation's own system message, and an assistant's `tool_calls` are written inside its
# turn as Hermes/Qwen-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` lines, so
# the calls are trained on and a sampled turn ends at the usual stop token. A `tool` message is a
# turn of its own, outside the markers (never trained on). Without tools or tool calls the
# rendering is exactly the plain ChatML that earlier versions wrote.
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{ '# Tools\nYou may call these functions:\n<tools>' }}"
    "{%- for tool in tools %}{{ '\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\n</tools>\nTo call one, write <tool_call>{\"name\": <name>, \"arguments\": <JSON object>}</tool_call>"
    "<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{{ message['content'] if message['content'] is string else '' }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- set fn = call['function'] if call['function'] is mapping else call %}"
    "{{ '\n' if (message['content'] or not loop.first) else '' }}"
    "{{ '<tool_call>{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' }}"
    "{{ fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) }}"
    "{{ '}</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)

# ChatML for vision-language models: a message's content is a string or a list of parts
# ({"type": "image"}, {"type": "text", "text": ...}, TRL's and transformers' layout); an image part is
# written as the model's image placeholder, which its processor then expands into the image tokens.
# Text-only conversations render exactly as CHATML_TEMPLATE renders them.
_RENDER_PARTS = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}{{ IMAGE }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)


def vision_chat_template(image_placeholder: str) -> str:
    """CHATML_TEMPLATE for content given as parts, each image part written as `image_placeholder`."""
    template = (CHATML_TEMPLATE
                .replace("messages[0]['content'] + '\n\n'", "render(messages[0]['content']) + '\n\n'")
                .replace("message['content'] if message['content'] is string else ''", "render(message['content'])")
                .replace("message['content'] + '<|im_end|>\n'", "render(message['content']) + '<|im_end|>\n'"))
    if template.count("render(") != 3:
        raise RuntimeError("CHATML_TEMPLATE changed: update vision_chat_template's replacements")
    return _RENDER_PARTS.replace("IMAGE", repr(image_placeholder)) + template


__all__ = ["CHATML_TEMPLATE", "vision_chat_template", "IM_START", "IM_END", "TOOL_CALL_START", "TOOL_CALL_END", "ensure_chat_template",
           "load_chat_template", "template_inputs", "template_tools", "template_variables"]


def ensure_chat_template(tokenizer, template: str = CHATML_TEMPLATE):
    """Give `tokenizer` the ChatML template when it has none; its special tokens must exist in the vocab."""
    if not getattr(tokenizer, "chat_template", None):
        missing = [t for t in (IM_START, IM_END) if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
        if missing:
            raise ValueError(f"the tokenizer has no chat template and lacks the ChatML tokens {missing}; "
                             "add them with tokenizer.add_special_tokens and resize the model's embeddings, "
                             "or set tokenizer.chat_template to a template of your own")
        tokenizer.chat_template = template
    return tokenizer


def _drop_nones(value):
    """`value` without the None-valued dict keys, at every depth.

    A `datasets.Dataset` stores dicts as Arrow structs whose fields are the union over all rows, so
    a row's tool arguments or schema come back with every other row's keys set to None; a JSON
    null cannot be told from such a key, so both go (a JSON string keeps nulls).
    """
    if isinstance(value, Mapping):
        return {k: _drop_nones(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_drop_nones(v) for v in value]
    return value


def template_tools(tools) -> list[dict] | None:
    """A row's or a trainer's `tools` as the JSON-schema list a chat template gets; None when empty.

    tools: None, a list of JSON schemas and/or Python functions (sync or async, with type hints
    and a Google-style docstring: transformers' `get_json_schema` reads them), or a JSON string
    of a schema list (the form that keeps varied schemas intact in a `datasets.Dataset`).
    """
    if tools is None:
        return None
    if isinstance(tools, str):
        tools = json.loads(tools)
    if not tools:
        return None
    from transformers.utils import get_json_schema

    return [get_json_schema(t) if callable(t) else _drop_nones(t) for t in tools]


def _clean_message(message: Mapping) -> dict:
    message = dict(message)
    if message.get("tool_calls") is None:
        message.pop("tool_calls", None)  # the Arrow-filled None of a message that calls no tool
    else:
        message["tool_calls"] = [_drop_nones(call) for call in message["tool_calls"]]
    return message


def template_inputs(messages, tools=None) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) ready for `tokenizer.apply_chat_template(messages, tools=tools)`.

    Tool calls lose the None-valued keys Arrow adds (see `_drop_nones`); messages without tool
    calls are passed on as they are, so conversations without tools render as before.
    """
    messages = [_clean_message(m) if "tool_calls" in m else m for m in messages]
    return messages, template_tools(tools)


def template_variables(*kwargs) -> dict:
    """Extra chat-template variables merged from dicts given in order (a trainer's, then a row's), later ones
    winning; None-valued keys go, since a `datasets.Dataset` fills a row's dict with every other row's keys."""
    merged = {}
    for extra in kwargs:
        merged.update(_drop_nones(dict(extra or {})))
    return merged


def load_chat_template(tokenizer, path: str, model=None):
    """Give `tokenizer` the chat template at `path`: a Jinja file, or a tokenizer folder whose template is used.

    From a folder, the special tokens the template writes that `tokenizer` lacks are added to it (and
    `model`'s embeddings grown to match), so the rendered markers are single tokens as in the source.
    """
    import os

    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
        return tokenizer
    if not os.path.isdir(path):
        raise ValueError(f"chat_template_path={path!r} is neither a Jinja template file nor a tokenizer folder")
    from transformers import AutoTokenizer

    source = AutoTokenizer.from_pretrained(path)
    template = getattr(source, "chat_template", None)
    if not template:
        raise ValueError(f"chat_template_path={path!r}: the tokenizer saved there has no chat template")
    vocab = tokenizer.get_vocab()
    written = [t.content for t in source.added_tokens_decoder.values() if t.special and t.content in template]
    missing = [t for t in written if t not in vocab]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
        if model is not None and model.get_input_embeddings().weight.shape[0] < len(tokenizer):
            model.resize_token_embeddings(len(tokenizer))
    tokenizer.chat_template = template
    return tokenizer


def require_chat_template(tokenizer, what: str = "conversational data"):
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{what} needs a tokenizer with a chat template, and this one has none; set "
            "tokenizer.chat_template (posttrain.data.chat.CHATML_TEMPLATE is a ready ChatML template) "
            "or convert the data to plain text first")
