"""A GGUF file's parse and its metadata as a Hugging Face-style config: what the model spec, the
weight reader (kiec.weights) and the tokenizer take from a GGUF, kept apart from ArchConfig so that
kiec.model can read a GGUF's config without importing the weight readers."""
from __future__ import annotations

import functools
import math
import os

import numpy as np

from .errors import KiecError, is_number


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


ROPE_FREQS = "rope_freqs.weight"    # llama.cpp's per-pair RoPE factors: how a GGUF carries llama3 scaling
_REQUIRED = object()    # _meta_number's default for a key the config cannot do without
_NUMBER = {int: "an integer", float: "a number"}

# The GGUF architectures kiec reads, each with whether llama.cpp's converter (convert_hf_to_gguf.py)
# reordered the rows of its attn_q / attn_k so that every RoPE pair is two adjacent rows. It does so
# only for the architectures llama.cpp runs with adjacent-pair RoPE, and kiec.weights undoes it; the
# others keep Hugging Face's rotate-half order, and undoing a reordering that was never done
# scrambles Q and K (silently: the output is merely wrong).
QK_REORDERED = {
    # LlamaModel.modify_tensors permutes q_proj and k_proj, weights and biases. Mistral and
    # Llama-3 checkpoints are written as "llama" too, by the same class.
    "llama": True,
    # Qwen2Model writes them as Hugging Face has them: llama.cpp runs qwen2 with rotate-half RoPE.
    "qwen2": False,
}
# "mistral" was accepted once, and is not: no converter writes it (llama.cpp writes Mistral as
# "llama") and nothing reads it (llama.cpp, and gguf-py, so transformers' GGUF loader, know no such
# architecture), so whether its Q/K rows are reordered would be a guess, and a wrong guess is silent.
_MISTRAL = ("llama.cpp writes Mistral checkpoints as 'llama', and whether a 'mistral' GGUF's Q/K rows "
            "are reordered is not known: use the safetensors checkpoint with its config.json")


def gguf_architecture(reader, path: str) -> str:
    """The file's general.architecture, refused unless it is one kiec reads (QK_REORDERED)."""
    field = reader.fields.get("general.architecture")
    arch = _field(field) if field is not None else None
    if not isinstance(arch, str) or arch not in QK_REORDERED:
        raise KiecError("weights", f"{path} (general.architecture={arch!r})", "a llama or qwen2 GGUF",
                        _MISTRAL if arch == "mistral" else "")
    return arch


def gguf_config(path: str) -> dict:
    """A Hugging Face-style config from a GGUF file's metadata."""
    reader = open_gguf(path)
    meta = {k: _field(f) for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    arch = gguf_architecture(reader, path)
    names = {t.name for t in reader.tensors}

    def key(k, kind=int, default=_REQUIRED):
        return _meta_number(meta, f"{arch}.{k}", kind, default, path)
    heads = key("attention.head_count")
    cfg = {
        "model_type": arch,
        "hidden_size": key("embedding_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", default=heads),
        "intermediate_size": key("feed_forward_length"),
        "max_position_embeddings": key("context_length", default=4096),
        "rope_theta": key("rope.freq_base", float, 10000.0),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", float, 1e-5),
        "vocab_size": key("vocab_size", default=0) or _embedding_rows(reader, f"{arch}.vocab_size", path),
        "tie_word_embeddings": "output.weight" not in names,
    }
    if key("rope.dimension_count", default=None):
        cfg["head_dim"] = key("rope.dimension_count")
    if key("attention.sliding_window", default=None):
        cfg["sliding_window"] = key("attention.sliding_window")
    if arch == "qwen2":
        cfg["use_sliding_window"] = False
    scaling = _rope_scaling(meta, arch, path)
    if ROPE_FREQS in names:
        if scaling:     # llama.cpp would apply both; no config spells that, and no converter writes it
            raise KiecError(f"weights[{ROPE_FREQS}]", f"the tensor beside {scaling['rope_type']} RoPE scaling keys",
                            f"either the tensor (llama3 scaling) or {arch}.rope.scaling.* keys, not both", f"in {path}")
        # a head count of 0 is arch_config's to name (config.num_attention_heads), after this
        head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads > 0 else 0)
        scaling = {"rope_type": "freq_factors", "factors": _rope_freqs(reader, head_dim // 2, path)}
    if scaling:
        cfg["rope_scaling"] = scaling
    return cfg


def _rope_freqs(reader, pairs: int, path: str) -> list:
    """The factors of llama.cpp's rope_freqs tensor, one per RoPE pair: its converter writes a
    llama3-scaled checkpoint's rope_scaling as them, and llama.cpp divides each pair's inverse
    frequency by its factor."""
    tensor = next(t for t in reader.tensors if t.name == ROPE_FREQS)
    shape = [int(n) for n in reversed(tensor.shape)]
    if tensor.tensor_type.name not in ("F32", "F16"):
        raise KiecError(f"weights[{ROPE_FREQS}].dtype", tensor.tensor_type.name, "F32 or F16", f"in {path}")
    if pairs and shape != [pairs]:
        raise KiecError(f"weights[{ROPE_FREQS}].shape", shape, f"[{pairs}]: one factor per RoPE pair (head_dim / 2)",
                        f"in {path}")
    factors = np.asarray(tensor.data, np.float64).reshape(-1)
    bad = ~(np.isfinite(factors) & (factors > 0))
    if bad.any():
        i = int(np.argmax(bad))
        raise KiecError(f"weights[{ROPE_FREQS}][{i}]", float(factors[i]), "a positive finite factor", f"in {path}")
    return factors.tolist()


def _rope_scaling(meta: dict, arch: str, path: str) -> dict | None:
    """The rope_scaling of a GGUF's `{arch}.rope.scaling.*` keys, read as llama.cpp reads them, or
    None for none. Only linear scaling has these keys and a RoPE table kiec computes (llama3's is the
    rope_freqs tensor); yarn, longrope or any other type is refused by name, not run unscaled."""
    type_key = f"{arch}.rope.scaling.type"
    # llama.cpp reads the older `rope.scale_linear` where `rope.scaling.factor` is absent
    factor_key = next((k for k in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear")
                       if meta.get(k) is not None), f"{arch}.rope.scaling.factor")
    kind = meta.get(type_key)
    if kind is None and meta.get(factor_key) is None:
        return None
    if kind is None:
        kind = "linear"     # llama.cpp's type for a file that gives a factor and no type
    if kind == "none":      # llama.cpp never scales under "none", whatever the factor says
        return None
    if kind != "linear":
        raise KiecError(type_key, kind, "'linear' or 'none': the RoPE scaling kiec reads from a GGUF",
                        f"in the metadata of {path}; kiec's RoPE table has no other scaling yet: no yarn, no longrope")
    factor = _meta_number(meta, factor_key, float, _REQUIRED, path)
    if not math.isfinite(factor) or factor <= 0:
        raise KiecError(factor_key, factor, "a positive finite number", f"in the metadata of {path}")
    return {"rope_type": "linear", "factor": factor}


def _meta_number(meta: dict, name: str, kind, default, path: str):
    """The number stored under GGUF metadata key `name`, as `kind` (int or float).

    A GGUF's metadata is whatever its writer put there: a key can be missing, a string, an
    array (per-layer counts, as some converters write) or a bool, and int()/float() on those
    fail with a TypeError that names neither the key nor the file."""
    value = meta.get(name)          # None also when _field could not read the value
    if value is None:
        if default is _REQUIRED:
            raise KiecError(name, None, f"{_NUMBER[kind]} in the GGUF metadata", f"the key is missing from {path}")
        return default
    # bool is an int to Python but a GGUF BOOL is no count; an int float (a 64.0 head count) is fine
    if not is_number(value) or (kind is int and not float(value).is_integer()):
        raise KiecError(name, value, _NUMBER[kind], f"in the metadata of {path}")
    return kind(value)


def _embedding_rows(reader, name: str, path: str) -> int:
    """The vocabulary size from token_embd.weight, for a GGUF without `<arch>.vocab_size`."""
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[-1])         # GGUF lists the fastest axis first: [hidden, vocab]
    raise KiecError(name, None, "an integer in the GGUF metadata, or a token_embd.weight tensor",
                    f"neither is in {path}")


def _field(f):
    try:
        return f.contents()
    except Exception:
        return None
