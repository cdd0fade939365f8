"""Chat templates: the built-in ChatML template, with {% generation %} markers so assistant-only
loss masks work, and a helper to give a tokenizer that lacks a template this one."""

from __future__ import annotations

from posttrain.models.tiny import CHATML_TEMPLATE, IM_END, IM_START

__all__ = ["CHATML_TEMPLATE", "IM_START", "IM_END", "ensure_chat_template"]


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
