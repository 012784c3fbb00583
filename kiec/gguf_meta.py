"""A GGUF file's parse and its metadata as a Hugging Face-style config: what the model spec, the
weight reader (kiec.weights) and the tokenizer take from a GGUF, kept apart from ArchConfig so that
kiec.model can read a GGUF's config without importing the weight readers."""
from __future__ import annotations

import functools
import os

from .errors import KiecError


def open_gguf(path: str):
    """The parsed GGUF file (tensors and metadata), parsed once per file version."""
    try:
        stat = os.stat(path)
    except OSError as err:
        raise KiecError("weights", path, "a GGUF file", str(err)) from None
    return _cached_gguf_reader(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached_gguf_reader(path: str, size: int, mtime_ns: int):
    """One parse per file version: the spec, the checkpoint and the tokenizer all read the same
    GGUF, and parsing its metadata (the vocabulary) takes seconds."""
    import gguf
    try:
        return gguf.GGUFReader(path)
    except Exception as err:  # the gguf package raises ValueError, struct.error, OSError, ...
        raise KiecError("weights", path, "a GGUF file", f"unreadable or truncated: {type(err).__name__}: {err}") from None


def gguf_config(path: str) -> dict:
    """A Hugging Face-style config from a GGUF file's metadata."""
    reader = open_gguf(path)
    meta = {k: _field(f) for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2", "mistral"):
        raise KiecError("weights", f"{path} (general.architecture={arch!r})", "a llama, qwen2 or mistral GGUF")
    names = {t.name for t in reader.tensors}

    def key(k, default=None):
        return meta.get(f"{arch}.{k}", default)
    heads = int(key("attention.head_count"))
    cfg = {
        "model_type": arch,
        "hidden_size": int(key("embedding_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "intermediate_size": int(key("feed_forward_length")),
        "max_position_embeddings": int(key("context_length", 4096)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "vocab_size": int(key("vocab_size", 0) or reader.tensors[0].shape[-1]),
        "tie_word_embeddings": "output.weight" not in names,
    }
    if key("rope.dimension_count"):
        cfg["head_dim"] = int(key("rope.dimension_count"))
    if key("attention.sliding_window"):
        cfg["sliding_window"] = int(key("attention.sliding_window"))
    if arch == "qwen2":
        cfg["use_sliding_window"] = False
    return cfg


def _field(f):
    try:
        return f.contents()
    except Exception:
        return None
