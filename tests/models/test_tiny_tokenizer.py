"""The built-in tiny tokenizer is the same on every machine.

It used to be trained at first use on the running Python's pydoc pages, so Python 3.11.2 and
3.11.7 gave different tokenizers (379 of 1024 ids agreed). It now ships as package data. The
expected values below were taken from the tokenizer that training gave on Python 3.11.7 before
the file was shipped, so these tests also prove that shipping it changed no id.
"""

import hashlib
import json

from posttrain.models import loading, tiny

VOCAB_SHA256 = "f491971b8322e286aa20b7698bc325eec9f193f9f97aacddb7f2385da8ef91f4"
MERGES_SHA256 = "9e598f1af00deebeee538d7516e53683c70c2b1cc7f6a0fd6ad8acc8fb68ffa4"
ENCODINGS = {
    "reverse 4721 = 1274": [269, 458, 274, 223, 22, 25, 20, 19, 626, 223, 19, 20, 25, 22],
    "Beautiful is better than ugly.": [36, 71, 596, 276, 72, 705, 294, 627, 532, 223, 87, 73, 341, 16],
    "def f(x):\n    return x  # é ✓": [286, 72, 289, 10, 90, 854, 799, 500, 890, 223, 948, 223, 130, 105, 223,
                                       161, 253, 244],
}
# transformers opens the tiny-qwen2 folder as a Qwen2Tokenizer, whose own pre-tokenizer splits a
# run of spaces before a word differently (" " + "   return" instead of "    " + "return"): same vocabulary
# and merges, other ids for that one string. Pinned too, so a change there shows.
QWEN2_CODE_IDS = [286, 72, 289, 10, 90, 854, 201, 510, 500, 890, 223, 948, 223, 130, 105, 223, 161, 253, 244]
CHAT = [{"role": "user", "content": "reverse 4721 ="}, {"role": "assistant", "content": "1274"}]
CHAT_IDS = [1, 366, 84, 201, 269, 458, 274, 223, 22, 25, 20, 19, 626, 2, 201,
            1, 67, 505, 415, 306, 201, 19, 20, 25, 22, 2, 201]


def _sha256(value) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()


def _check(tok, encodings=ENCODINGS):
    assert len(tok) == tiny.VOCAB_SIZE
    assert _sha256(sorted(tok.get_vocab().items())) == VOCAB_SHA256
    assert _sha256(json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]) == MERGES_SHA256
    for text, ids in encodings.items():
        assert tok(text)["input_ids"] == ids, text
        assert tok.decode(ids) == text
    assert tok.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"] == CHAT_IDS
    assert (tok.pad_token_id, tok.convert_tokens_to_ids(tiny.IM_START), tok.eos_token_id) == (0, 1, 2)


def test_shipped_tokenizer_is_pinned():
    _check(tiny.build_tokenizer())


def test_tiny_models_carry_the_pinned_tokenizer():
    _check(loading.load_tokenizer(None, model="posttrain/tiny-llama"))
    qwen2 = loading.load_tokenizer(None, model="posttrain/tiny-qwen2")
    code = "def f(x):\n    return x  # é ✓"
    _check(qwen2, {**ENCODINGS, code: QWEN2_CODE_IDS})


def test_tokenizer_is_loaded_from_the_package_not_trained(monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError("the tiny tokenizer must not be trained at run time")

    monkeypatch.setattr(tiny, "_training_text", no_training)
    monkeypatch.setattr(tiny, "train_tokenizer", no_training)
    _check(tiny.build_tokenizer())


def test_a_cache_built_from_another_tokenizer_is_not_reused(tmp_path, monkeypatch):
    """Earlier versions cached tiny-qwen2 under a fixed folder name; a folder left there by a
    Python that trained a different tokenizer must not be picked up."""
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    stale = tmp_path / "tiny-qwen2"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    (stale / "tokenizer.json").write_text("{}")
    path = tiny.tiny_model_path("tiny-qwen2")
    assert path.parent == tmp_path and path != stale
    _check(loading.load_tokenizer(None, model=str(path)), {"reverse 4721 = 1274": ENCODINGS["reverse 4721 = 1274"]})
    # the folder name changes with the tokenizer file it was built from
    other = tmp_path / "other_tokenizer.json"
    tokenizer = json.loads(tiny.TOKENIZER_FILE.read_text())
    tokenizer["model"]["merges"] = tokenizer["model"]["merges"][:-1]
    other.write_text(json.dumps(tokenizer))
    monkeypatch.setattr(tiny, "TOKENIZER_FILE", other)
    rebuilt = tiny.tiny_model_path("tiny-qwen2")
    assert rebuilt.parent == tmp_path and rebuilt != path
    assert (rebuilt / "tokenizer.json").read_text() != (path / "tokenizer.json").read_text()
