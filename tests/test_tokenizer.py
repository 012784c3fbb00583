"""kiec's tokenizer (kiec/runtime/tokenizer.py) against transformers' tokenizer of the same files:
SmolLM2's GGUF vocabulary rebuilt into `tokenizers`, and a tokenizer.json folder."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kiec.errors import KiecError
from kiec.runtime.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "class A:\n\tdef __init__(self):\n\t\tself.x = {'a': [1, 2, 3]}  # comment\n",
    "#include <stdio.h>\nint main() { printf(\"%d\\n\", 42); return 0; }",
    "héllo wörld — naïve café, Straße, Ελληνικά, русский, العربية, עברית",
    "日本語のテキストと中文文本，한국어 텍스트。",
    "emoji 🤖🚀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "   leading, inner    runs\t\ttabs and trailing   ",
    "\n\n\nnewlines\r\n\r\nwindows\n \n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>after the end",
    "I'm sure you're right; they'll see. WE'D SAY IT'S FINE",
    "12345678901234 3.14159 1e-10 0x1F 1,000,000",
    "",
    " ",
    "a",
    "\u200b zero width, \u00a0 no-break, combining e\u0301",
]
TEXT_IDS = [f"text{i}" for i in range(len(TEXTS))]

MESSAGES = [
    [{"role": "user", "content": "Write fibonacci in Python."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! 👋"}, {"role": "user", "content": "Again,\n  with spaces"}],
]


@pytest.fixture(scope="module")
def kiec_tok(smollm2_gguf, one_gguf_parse):
    return load_tokenizer(str(smollm2_gguf))


@pytest.fixture(scope="module")
def folder_tok(smollm2_hf_tokenizer, tmp_path_factory):
    """The same tokenizer written by transformers as a tokenizer.json folder, read by kiec."""
    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    smollm2_hf_tokenizer.save_pretrained(folder)
    assert (folder / "tokenizer.json").exists()
    return load_tokenizer(str(folder)), folder


@pytest.mark.parametrize("text", TEXTS, ids=TEXT_IDS)
def test_gguf_tokenizer_encodes_like_transformers(kiec_tok, smollm2_hf_tokenizer, text):
    want = smollm2_hf_tokenizer(text).input_ids
    assert kiec_tok.encode(text) == want


@pytest.mark.parametrize("text", TEXTS, ids=TEXT_IDS)
def test_gguf_tokenizer_decode_round_trips(kiec_tok, smollm2_hf_tokenizer, text):
    ids = kiec_tok.encode(text)
    assert kiec_tok.decode(ids, skip_special=False) == text
    assert kiec_tok.decode(ids, skip_special=True) == smollm2_hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_single_ids(kiec_tok, smollm2_hf_tokenizer):
    for name in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        (token,) = kiec_tok.encode(name)
        assert token == smollm2_hf_tokenizer.convert_tokens_to_ids(name)
    assert kiec_tok.vocab_size == len(smollm2_hf_tokenizer)
    assert kiec_tok.bos_id == smollm2_hf_tokenizer.bos_token_id
    assert smollm2_hf_tokenizer.eos_token_id in kiec_tok.eos_ids
    assert smollm2_hf_tokenizer.convert_tokens_to_ids("<|im_end|>") in kiec_tok.eos_ids


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("generation", [True, False])
def test_chat_template_renders_like_transformers(kiec_tok, smollm2_hf_tokenizer, messages, generation):
    want = smollm2_hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    assert kiec_tok.apply_chat(messages, add_generation_prompt=generation) == want


def test_stream_decoder_never_splits_a_character(kiec_tok):
    text = "emoji 🤖🚀👍🏽 family 👨‍👩‍👧 日本語 é"
    ids = kiec_tok.encode(text)
    decoder = kiec_tok.stream_decoder()
    pieces = [decoder.push(t) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces            # some emoji span several byte tokens: nothing shown until complete


def _char_then_partial(tok) -> int:
    """A token whose bytes are a whole character, then the first byte(s) of the next one."""
    for i in range(tok.vocab_size):
        text = tok.token_bytes(i).decode("utf-8", errors="replace")
        if len(text) >= 2 and text.count("\ufffd") == 1 and text.endswith("\ufffd") and not text[-2].isspace():
            return i
    raise AssertionError("no such token in the vocabulary")


def test_stream_decoder_gives_a_whole_character_before_a_partial_one_at_once(kiec_tok):
    token = _char_then_partial(kiec_tok)
    whole = kiec_tok.token_bytes(token).decode("utf-8", errors="replace")[:-1]
    decoder = kiec_tok.stream_decoder()
    assert [decoder.push(t) for t in kiec_tok.encode("hi") + [token]] == ["hi", whole]
    assert decoder.flush() == "\ufffd"       # the unfinished character, as decode shows it


def test_stream_decoder_pieces_and_flush_are_the_decoded_text(kiec_tok):
    """Any tokens, partial characters and invalid bytes included: the pieces never take back what
    they gave, and with the flush they are exactly decode's text."""
    rng = np.random.default_rng(5)
    partial = _char_then_partial(kiec_tok)
    for _ in range(20):
        ids = [int(t) for t in rng.integers(0, kiec_tok.vocab_size, 40)] + [partial]
        decoder = kiec_tok.stream_decoder()
        pieces = [decoder.push(t) for t in ids]
        final = kiec_tok.decode(ids)
        for k in range(len(ids)):
            assert final.startswith("".join(pieces[: k + 1]))
        assert "".join(pieces) + decoder.flush() == final


@pytest.mark.parametrize("text", TEXTS, ids=TEXT_IDS)
def test_folder_tokenizer_encodes_like_transformers(folder_tok, smollm2_hf_tokenizer, text):
    tok, _ = folder_tok
    assert tok.encode(text) == smollm2_hf_tokenizer(text).input_ids


def test_folder_tokenizer_chat_and_special(folder_tok, smollm2_hf_tokenizer):
    tok, _ = folder_tok
    for messages in MESSAGES:
        assert tok.apply_chat(messages) == smollm2_hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)
    assert smollm2_hf_tokenizer.eos_token_id in tok.eos_ids
    assert tok.bos_id == smollm2_hf_tokenizer.bos_token_id


def test_tokenizer_errors(tmp_path):
    with pytest.raises(KiecError) as info:
        load_tokenizer(str(tmp_path))
    assert info.value.field == "tokenizer" and "no tokenizer.json" in info.value.hint
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": "nonsense"}))
    with pytest.raises(KiecError) as info:
        load_tokenizer(str(tmp_path))
    assert info.value.field == "tokenizer" and info.value.expected == "a valid tokenizer.json"
    with pytest.raises(KiecError):
        load_tokenizer(str(tmp_path / "absent.gguf"))
