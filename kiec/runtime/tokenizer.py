"""Tokenizers from the model's own files, through Hugging Face `tokenizers`.

A `tokenizer.json` (a file, or inside the model folder) is used as it is. A GGUF file's
byte-level BPE vocabulary, merges and special tokens are rebuilt into an equivalent
`tokenizers.Tokenizer`. The chat template comes from the same files.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from ..errors import KiecError
from ..model import is_gguf

# pre-tokenizer regexes of llama.cpp's `tokenizer.ggml.pre` names that differ from GPT-2's
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"qwen2": QWEN2_SPLIT, "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT}


class Tokenizer:
    def __init__(self, backend, eos_ids=(), bos_id=None, add_bos=False, chat_template=None, special=None):
        self.backend = backend
        self.eos_ids = tuple(eos_ids)
        self.bos_id = bos_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.special = special or {}

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (OpenAI's logprob `bytes`). A byte-level BPE token may hold
        part of a UTF-8 character, which its text decoded alone can only show as U+FFFD."""
        piece = self.backend.id_to_token(token)
        if piece is not None and token not in self._added and _is_byte_level(self.backend.decoder) \
                and all(c in BYTE_OF_CHAR for c in piece):
            return bytes(BYTE_OF_CHAR[c] for c in piece)
        if piece is not None and (byte := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)):   # byte fallback
            return bytes([int(byte.group(1), 16)])
        return self.decode([token], skip_special=False).encode()

    @functools.cached_property
    def _added(self) -> frozenset:
        return frozenset(self.backend.get_added_tokens_decoder())

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)

    def apply_chat(self, messages: list, add_generation_prompt: bool = True) -> str:
        """The prompt text for a list of {role, content} messages, by the model's own template."""
        if not self.chat_template:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " if add_generation_prompt else "")
        import jinja2.sandbox
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        template = env.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.special.get("bos", ""), eos_token=self.special.get("eos", ""))


def _byte_level_alphabet() -> dict:
    """GPT-2's byte-level BPE spells each byte as one printable character: printable Latin-1 as
    itself, the other 68 bytes as U+0100 onwards, in byte order. Character -> byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(0x100 + i): b for i, b in enumerate(others)}}


BYTE_OF_CHAR = _byte_level_alphabet()


def _is_byte_level(decoder) -> bool:
    from tokenizers import decoders
    return isinstance(decoder, decoders.ByteLevel)


def _raise_template_error(message):
    raise KiecError("messages", message, "messages the model's chat template accepts")


class StreamDecoder:
    """Turns tokens into text pieces as they come, never splitting a UTF-8 character.

    A byte-level token may end with the first bytes of a character (decoded: U+FFFD); the text
    before them goes out at once, they wait for the token that completes them, and `flush` gives
    what is left when the sequence ends. The window decoded starts one token before the unsent
    text: some tokenizers decode a sequence's first token without its leading space."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.ids = tok, []
        self.prefix = 0    # the window's first token
        self.sent = 0      # characters of the window's text already given out

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids[self.prefix:])
        end = len(text.rstrip("\ufffd"))
        if end <= self.sent:
            return ""
        piece = text[self.sent:end]
        if end == len(text):          # nothing held: the window moves on, its last token the context
            self.prefix = len(self.ids) - 1
            self.sent = len(self.tok.decode(self.ids[self.prefix:]))
        else:
            self.sent = end
        return piece

    def flush(self) -> str:
        """The text still held (bytes of an unfinished character show as U+FFFD, as decode shows them)."""
        piece = self.tok.decode(self.ids[self.prefix:])[self.sent:]
        self.prefix, self.sent = len(self.ids), 0
        return piece


def load_tokenizer(source: str) -> Tokenizer:
    path = Path(source)
    if is_gguf(path):
        return _from_gguf(str(path))
    folder = path if path.is_dir() else path.parent
    file = path if path.is_file() and path.suffix == ".json" else folder / "tokenizer.json"
    if not file.exists():
        raise KiecError("tokenizer", str(source), "a tokenizer.json, a folder holding one, or a GGUF file",
                        "no tokenizer.json found")
    from tokenizers import Tokenizer as HFTokenizer
    try:
        backend = HFTokenizer.from_file(str(file))
    except Exception as err:
        raise KiecError("tokenizer", str(file), "a valid tokenizer.json", str(err)) from None
    config = _json(folder / "tokenizer_config.json")
    gen = _json(folder / "generation_config.json")
    model_cfg = _json(folder / "config.json")
    vocab = backend.get_vocab()

    def token_id(value):
        if isinstance(value, dict):
            value = value.get("content")
        return vocab.get(value) if isinstance(value, str) else None
    eos = gen.get("eos_token_id", model_cfg.get("eos_token_id", token_id(config.get("eos_token"))))
    eos_ids = [e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)]
    bos_id = token_id(config.get("bos_token"))
    template = config.get("chat_template")
    if template is None and (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    special = {"bos": _content(config.get("bos_token")), "eos": _content(config.get("eos_token"))}
    return Tokenizer(backend, eos_ids, bos_id, bool(config.get("add_bos_token", False)) and bos_id is not None,
                     template, special)


def _content(value) -> str:
    if isinstance(value, dict):
        return value.get("content", "")
    return value or ""


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError:
        return {}


def _from_gguf(path: str) -> Tokenizer:
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from ..gguf_meta import open_gguf
    reader = open_gguf(path)

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()
    kind = field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise KiecError("tokenizer", f"{path} (tokenizer.ggml.model={kind!r})", "a byte-level BPE ('gpt2') GGUF tokenizer")
    tokens = field("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
    backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                     fuse_unk=False, byte_fallback=False))
    pre = field("tokenizer.ggml.pre", "gpt2")
    if pre in SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t == 3])
    bos = field("tokenizer.ggml.bos_token_id")
    eos = field("tokenizer.ggml.eos_token_id")
    eot = field("tokenizer.ggml.eot_token_id")
    eos_ids = [int(e) for e in (eos, eot) if e is not None]
    template = field("tokenizer.chat_template")
    # chat models end their turn with <|im_end|> (ChatML) or <|eot_id|>; stop there too
    for name in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        if name in tokens and template and name in template:
            eos_ids.append(tokens.index(name))
    special = {"bos": tokens[bos] if bos is not None else "", "eos": tokens[eos] if eos is not None else ""}
    return Tokenizer(backend, sorted(set(eos_ids)), bos, bool(field("tokenizer.ggml.add_bos_token", False)),
                     template, special)
