"""TRL's chat-template helpers (posttrain.models.chat_templates) on the built-in tokenizer and hand-written templates."""

import pytest
import torch

from posttrain import add_response_schema, clone_chat_template, get_training_chat_template, supports_tool_calling
from posttrain.data.chat import CHATML_TEMPLATE
from posttrain.models.loading import load_causal_lm, load_tokenizer

# plain ChatML without markers or tools: renders conversations exactly as posttrain's template does
PLAIN_CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# ChatML that adds a system turn when the conversation has none (as Qwen 2.5's does)
DEFAULT_SYSTEM = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}"
                  "{% endif %}" + PLAIN_CHATML)
# a template that reads only `content`: tool calls vanish from the text
CONTENT_ONLY = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
RAISES_ON_TOOL = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
                  "{{ m['content'] }}{% endfor %}")


@pytest.fixture
def tokenizer():
    return load_tokenizer(None, model="posttrain/tiny-qwen2")


def test_supports_tool_calling(tokenizer):
    assert supports_tool_calling(tokenizer)  # posttrain's ChatML writes calls and tool answers
    tokenizer.chat_template = CONTENT_ONLY
    assert not supports_tool_calling(tokenizer)  # renders, but drops the call
    tokenizer.chat_template = RAISES_ON_TOOL
    assert not supports_tool_calling(tokenizer)
    tokenizer.chat_template = None
    assert not supports_tool_calling(tokenizer)


def test_get_training_chat_template(tokenizer):
    assert get_training_chat_template(tokenizer) is None  # markers and prefix-preserving already
    tokenizer.chat_template = PLAIN_CHATML
    template = get_training_chat_template(tokenizer)
    assert template == CHATML_TEMPLATE
    # with it, the assistant-only mask covers exactly the assistant's text and end token
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    out = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    marked = [t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tokenizer.decode(marked) == "hello<|im_end|>"
    for template in (CONTENT_ONLY, DEFAULT_SYSTEM):  # DEFAULT_SYSTEM would lose its default system turn
        tokenizer.chat_template = template
        with pytest.raises(ValueError, match="not training-compatible"):
            get_training_chat_template(tokenizer)


def test_add_response_schema_parses_tool_calls(tokenizer):
    assert add_response_schema(tokenizer) is tokenizer
    text = 'Let me see.\n<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call><|im_end|>'
    assert tokenizer.parse_response(text, prefix="") == {
        "role": "assistant", "content": "Let me see.",
        "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}]}
    assert tokenizer.parse_response("It is 12.<|im_end|>", prefix="") == {"role": "assistant",
                                                                         "content": "It is 12."}
    # what the template writes for a call parses back to that call
    call = {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "q"},
                                              {"role": "assistant", "content": "", "tool_calls": [call]}],
                                             tokenize=False)
    turn = rendered.split("<|im_start|>assistant\n")[1]
    assert tokenizer.parse_response(turn, prefix="")["tool_calls"] == [call]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False,
                                           add_generation_prompt=True)
    assert tokenizer.parse_response(turn, prefix=prompt)["tool_calls"] == [call]  # as a rollout parses it
    tokenizer.chat_template = CONTENT_ONLY
    with pytest.raises(ValueError, match="Unrecognized chat template"):
        add_response_schema(tokenizer)


def test_clone_chat_template(tmp_path):
    source = load_tokenizer(None, model="posttrain/tiny-qwen2")
    source.add_special_tokens({"additional_special_tokens": ["<|eot|>", "<|header|>"]})
    source.eos_token = "<|eot|>"
    source.chat_template = "{% for m in messages %}<|header|>{{ m['content'] }}<|eot|>{% endfor %}"
    source.save_pretrained(tmp_path / "source")

    model = load_causal_lm("posttrain/tiny-qwen2")
    tokenizer = load_tokenizer(None, model="posttrain/tiny-qwen2")
    tokenizer.chat_template = None
    before = model.get_input_embeddings().weight[:1024].clone()
    model, tokenizer, added = clone_chat_template(model, tokenizer, str(tmp_path / "source"))
    assert tokenizer.chat_template == source.chat_template
    assert tokenizer.eos_token == "<|eot|>"
    assert model.config.eos_token_id == model.generation_config.eos_token_id == tokenizer.eos_token_id
    rows = model.get_input_embeddings().weight.shape[0]
    assert rows == 1088 and rows % 64 == 0  # 1024 + 2 new tokens, rounded up to a multiple of 64
    assert len(tokenizer.get_vocab()) == rows  # the spare rows are named <extra_id_N>
    assert added[:2] == tokenizer.convert_tokens_to_ids(["<|eot|>", "<|header|>"])
    assert len(added) == 64 and tokenizer.convert_ids_to_tokens(added[-1]) == "<extra_id_61>"
    assert torch.equal(model.get_input_embeddings().weight[:1024], before)  # existing rows untouched
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, return_dict=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|header|>") and ids[-1] == tokenizer.eos_token_id
    model, tokenizer, added = clone_chat_template(model, tokenizer, str(tmp_path / "source"), None)
    assert added == []  # nothing left to add
