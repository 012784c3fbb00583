"""Weight readers: safetensors (file, folder, sharded index), GGUF and Hugging Face folders.

No torch at run time: safetensors are parsed here (header + memory map, bf16 through
ml_dtypes); GGUF goes through the `gguf` package and is dequantized, with llama.cpp's
Q/K row permutation undone where its converter applied it (the file's architecture says
where), so every weight has Hugging Face's layout. Checkpoint names
are mapped to kiec's canonical names (`layers.3.wq`, ...) and checked against the
config: a missing, extra or misshapen tensor is one clear error.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from .errors import KiecError, is_int
from .gguf_meta import QK_REORDERED, ROPE_FREQS, gguf_architecture, open_gguf
from .model import ArchConfig, is_gguf, read_json_object, rope_inv_freq

SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
GGUF_NOT_WEIGHTS = ("I8", "I16", "I32", "I64", "F64")     # GGUF tensor types no weight of ours has
GGUF_REORDERED = ("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")  # rows llama.cpp reorders
IGNORED = ("rotary_emb.inv_freq", "masked_bias", ".attn.bias")


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class WeightStore:
    """Checkpoint tensors by their checkpoint names: shape, dtype and lazily read data."""

    def __init__(self, entries: dict, loaders: dict, origin: str):
        self.entries = entries      # name -> (shape, dtype name)
        self.loaders = loaders      # name -> () -> np.ndarray
        self.origin = origin

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self):
        return self.entries.keys()

    def shape(self, name: str) -> tuple:
        return self.entries[name][0]

    def get(self, name: str, dtype=np.float32) -> np.ndarray:
        array = self.loaders[name]()
        return array if dtype is None else array.astype(dtype, copy=False)


# --- safetensors ------------------------------------------------------------------------------

def read_safetensors(path: str) -> WeightStore:
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise KiecError("weights", path, "a safetensors file", "truncated before its header")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8 or header_len > 100_000_000:
            raise KiecError("weights", path, "a safetensors file",
                            f"its header claims {header_len} bytes but the file has {size}")
        try:
            header = json.loads(fh.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise KiecError("weights", path, "a safetensors file", f"corrupt header: {err}") from None
    if not isinstance(header, dict):
        raise KiecError("weights", path, "a safetensors file", "corrupt header: not an object")
    header.pop("__metadata__", None)
    start = 8 + header_len
    data = np.memmap(path, dtype=np.uint8, mode="r") if size > start else np.zeros(0, np.uint8)
    entries, loaders = {}, {}
    for name, info in header.items():
        dtype, shape, lo, hi = _header_entry(path, name, info, start, size)
        npdt = _np_dtype(dtype)
        entries[name] = (shape, dtype)
        loaders[name] = (lambda lo=lo, hi=hi, npdt=npdt, shape=shape:
                         np.asarray(data[start + lo:start + hi]).view(npdt).reshape(shape))
    return WeightStore(entries, loaders, path)


def _header_entry(path: str, name: str, info, start: int, size: int):
    """(dtype name, shape, begin, end) of one safetensors header entry, every field checked.

    The header is JSON that any writer (or a hand edit) may fill with anything: a dtype that is a
    list, a shape of strings, offsets that run backwards or past the file. Each of those has to be
    one KiecError naming the file and the tensor, not a TypeError from numpy or the arithmetic."""
    field, where = f"weights[{name}]", f"in {path}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise KiecError(field, info, "a safetensors entry with dtype, shape and data_offsets",
                        f"corrupt header {where}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:    # a list would not even hash
        raise KiecError(f"{field}.dtype", dtype, " / ".join(SAFETENSORS_DTYPES), where)
    if not isinstance(shape, list) or not all(_count(n) for n in shape):
        raise KiecError(f"{field}.shape", shape, "a list of non-negative integers", f"corrupt header {where}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(n) for n in offsets)
            and offsets[0] <= offsets[1]):
        raise KiecError(f"{field}.data_offsets", offsets, "[begin, end]: two integers, 0 <= begin <= end",
                        f"corrupt header {where}")
    (lo, hi), shape = offsets, tuple(shape)
    itemsize = _np_dtype(SAFETENSORS_DTYPES[dtype]).itemsize
    if hi - lo != math.prod(shape) * itemsize:      # Python ints: a huge shape cannot overflow
        raise KiecError(field, f"{hi - lo} bytes", f"{shape} of {dtype}", f"corrupt header {where}")
    if start + hi > size:
        raise KiecError("weights", path, f"at least {start + hi} bytes",
                        f"truncated at tensor {name}: the file has {size}")
    return SAFETENSORS_DTYPES[dtype], shape, lo, hi


def _count(n) -> bool:
    """A JSON non-negative integer (bool is an int to Python, but not a count)."""
    return is_int(n) and n >= 0


def read_folder(folder: str) -> WeightStore:
    """A folder of safetensors: a Hugging Face model folder, sharded by an index or not."""
    root = Path(folder)
    index = root / "model.safetensors.index.json"
    if index.exists():
        files = _index_shards(index)
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth") or is_gguf(p))
        raise KiecError("weights", folder, "a folder holding *.safetensors",
                        f"found {others} instead" if others else "no safetensors files in it")
    entries, loaders = {}, {}
    for name in files:
        path = root / name
        if not path.exists():
            raise KiecError("weights", str(path), "an existing shard named by the index", "no such file")
        part = read_safetensors(str(path))
        entries.update(part.entries)
        loaders.update(part.loaders)
    return WeightStore(entries, loaders, folder)


def _index_shards(index: Path) -> list:
    """The shard file names a model.safetensors.index.json maps its tensors to, sorted.

    The index is JSON of any shape once hand-edited or written by another tool: the top level a
    list, weight_map a list, a shard name a number. Each is one KiecError naming the index, not an
    AttributeError or a TypeError from joining the folder with an int."""
    doc = read_json_object("weights", str(index))
    if "weight_map" not in doc:
        raise KiecError("weights", str(index), "a safetensors index with a weight_map", "no weight_map key in it")
    weight_map = doc["weight_map"]
    if not isinstance(weight_map, dict):
        raise KiecError("weight_map", weight_map, "an object mapping tensor names to shard file names",
                        f"in {index}")
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise KiecError(f"weight_map[{tensor}]", shard, "a shard file name (a non-empty string)",
                            f"in {index}")
    return sorted(set(weight_map.values()))


# --- GGUF -------------------------------------------------------------------------------------

def read_gguf(path: str, cfg: ArchConfig) -> WeightStore:
    import gguf
    reader = open_gguf(path)
    # the file's own architecture, not cfg.arch: a model.json may give a config beside any GGUF
    reordered = QK_REORDERED[gguf_architecture(reader, path)]
    size = os.path.getsize(path)
    entries, loaders = {}, {}
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise KiecError("weights", path, f"at least {end} bytes", f"truncated at tensor {t.name}: the file has {size}")
        if t.tensor_type.name in GGUF_NOT_WEIGHTS:
            raise KiecError(f"weights[{t.name}].dtype", t.tensor_type.name, "F32, F16, BF16 or a quantized type",
                            f"in {path}")
        shape = tuple(int(n) for n in reversed(t.shape))      # GGUF lists the fastest axis first
        entries[t.name] = (shape, "float32")

        def load(t=t, shape=shape):
            try:
                array = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
            except NotImplementedError as err:
                raise KiecError(f"weights[{t.name}].dtype", t.tensor_type.name, "a type the gguf package dequantizes",
                                str(err)) from None
            if reordered and t.name.endswith(GGUF_REORDERED):
                heads = cfg.heads if "attn_q" in t.name else cfg.kv_heads
                array = _unpermute(array, heads)
            return array
        loaders[t.name] = load
    return WeightStore(entries, loaders, path)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE) back to rotate-half order; a bias
    (one axis) the same way."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_store(path: str, cfg: ArchConfig) -> WeightStore:
    p = Path(path)
    if p.is_dir():
        return read_folder(path)
    if is_gguf(p):
        return read_gguf(path, cfg)
    if p.suffix == ".safetensors":
        return read_safetensors(path)
    raise KiecError("weights", path, "a .safetensors or .gguf file, or a folder", f"suffix {p.suffix!r}")


# --- canonical names --------------------------------------------------------------------------

def expected_tensors(cfg: ArchConfig, gguf_names: bool = False) -> dict:
    """canonical name -> (checkpoint name, shape) for every tensor the config needs."""
    d, f, v, L = cfg.hidden, cfg.ffn, cfg.vocab, cfg.lanes
    out = {}
    if cfg.arch == "laneformer":
        norm = (d,) if cfg.replicated_norm else (L, d)
        suffix = "weight" if cfg.replicated_norm else "scale"
        out["embed"] = ("model.tok_embeddings.weight", (v, d))
        for i in range(cfg.layers):
            p, c = f"layers.{i}", f"model.layers.{i}"
            out[f"{p}.attn_norm"] = (f"{c}.attention_norm.{suffix}", norm)
            out[f"{p}.wq"] = (f"{c}.attention.wq.weight", (L, cfg.q_dim // L, d))
            out[f"{p}.wk"] = (f"{c}.attention.wk.weight", (L, cfg.kv_dim // L, d))
            out[f"{p}.wv"] = (f"{c}.attention.wv.weight", (L, cfg.kv_dim // L, d))
            out[f"{p}.wo"] = (f"{c}.attention.wo.weight", (L, d, cfg.q_dim // L))
            out[f"{p}.ffn_norm"] = (f"{c}.ffn_norm.{suffix}", norm)
            out[f"{p}.w_gate"] = (f"{c}.feed_forward.w1.weight", (L, f // L, d))
            out[f"{p}.w_up"] = (f"{c}.feed_forward.w3.weight", (L, f // L, d))
            out[f"{p}.w_down"] = (f"{c}.feed_forward.w2.weight", (L, d, f // L))
        final_rep = cfg.replicated_norm or cfg.pre_norm_lane_agg
        out["final_norm"] = ("model.norm.weight", (d,)) if final_rep else ("model.norm.scale", (L, d))
        if not cfg.tie_embeddings:
            out["lm_head"] = {"replicate": ("lm_head.weight", (v, d)),
                              "lane": ("lm_head.linear.weight", (v, L * d)),
                              "vocab_parallel": ("lm_head.weight", (L, v // L, d))}[
                "replicate" if cfg.pre_norm_lane_agg else cfg.lm_head_type]
        return out
    if gguf_names:
        names = dict(embed="token_embd.weight", final="output_norm.weight", head="output.weight",
                     attn_norm="attn_norm.weight", wq="attn_q.weight", wk="attn_k.weight", wv="attn_v.weight",
                     bq="attn_q.bias", bk="attn_k.bias", bv="attn_v.bias", wo="attn_output.weight",
                     ffn_norm="ffn_norm.weight", w_gate="ffn_gate.weight", w_up="ffn_up.weight",
                     w_down="ffn_down.weight", layer="blk.{i}")
    else:
        names = dict(embed="model.embed_tokens.weight", final="model.norm.weight", head="lm_head.weight",
                     attn_norm="input_layernorm.weight", wq="self_attn.q_proj.weight", wk="self_attn.k_proj.weight",
                     wv="self_attn.v_proj.weight", bq="self_attn.q_proj.bias", bk="self_attn.k_proj.bias",
                     bv="self_attn.v_proj.bias", wo="self_attn.o_proj.weight",
                     ffn_norm="post_attention_layernorm.weight", w_gate="mlp.gate_proj.weight",
                     w_up="mlp.up_proj.weight", w_down="mlp.down_proj.weight", layer="model.layers.{i}")
    out["embed"] = (names["embed"], (v, d))
    for i in range(cfg.layers):
        p, c = f"layers.{i}", names["layer"].format(i=i)
        shapes = dict(attn_norm=(d,), wq=(cfg.q_dim, d), wk=(cfg.kv_dim, d), wv=(cfg.kv_dim, d),
                      wo=(d, cfg.q_dim), ffn_norm=(d,), w_gate=(f, d), w_up=(f, d), w_down=(d, f))
        if cfg.qkv_bias:
            shapes.update(bq=(cfg.q_dim,), bk=(cfg.kv_dim,), bv=(cfg.kv_dim,))
        for key, shape in shapes.items():
            out[f"{p}.{key}"] = (f"{c}.{names[key]}", shape)
    out["final_norm"] = (names["final"], (d,))
    if not cfg.tie_embeddings:
        out["lm_head"] = (names["head"], (v, d))
    return out


class Checkpoint:
    """A WeightStore seen through canonical names, checked against the config."""

    def __init__(self, store: WeightStore, cfg: ArchConfig):
        self.store, self.cfg = store, cfg
        self.expected = expected_tensors(cfg, gguf_names=is_gguf(store.origin))
        self._check()

    def _check(self) -> None:
        origin = self.store.origin
        wanted = {ckpt: shape for ckpt, shape in self.expected.values()}
        for canon, (ckpt, shape) in self.expected.items():
            if ckpt not in self.store:
                raise KiecError(f"weights[{ckpt}]", "missing", f"a tensor of shape {list(shape)} for {canon}",
                                f"not in {origin}")
            got = tuple(self.store.shape(ckpt))
            if got != tuple(shape):
                raise KiecError(f"weights[{ckpt}].shape", list(got), f"{list(shape)} for this config",
                                f"in {origin}")
        tied_head = {"lm_head.weight", "output.weight"} if self.cfg.tie_embeddings else set()
        for name in self.store.names():
            if name == ROPE_FREQS and is_gguf(origin):
                self._check_rope_freqs()
            elif name not in wanted and name not in tied_head and not name.endswith(IGNORED):
                raise KiecError(f"weights[{name}]", "an extra tensor", "only the tensors this config uses",
                                f"in {origin}; the config and the checkpoint disagree")

    def _check_rope_freqs(self) -> None:
        """A GGUF's rope_freqs (llama.cpp's per-pair RoPE factors) are no graph weight: the config
        read from the GGUF carries them into the RoPE table (kiec.gguf_meta). A config given beside
        the GGUF must imply the same factors, or the table would silently be another."""
        factors = self.store.get(ROPE_FREQS, np.float64).reshape(-1)
        implied = rope_inv_freq(dataclasses.replace(self.cfg, rope_scaling=())) / rope_inv_freq(self.cfg)
        field, where = f"weights[{ROPE_FREQS}]", f"in {self.store.origin}"
        if factors.shape != implied.shape:
            raise KiecError(f"{field}.shape", list(factors.shape), f"[{len(implied)}]: one factor per RoPE pair",
                            where)
        # 1e-5: llama.cpp's converter computes the factors in float32, kiec's llama3 RoPE in float64
        off = np.abs(factors - implied) > 1e-5 * implied
        if off.any():
            i = int(np.argmax(off))
            kind = dict(self.cfg.rope_scaling).get("rope_type", "default")
            raise KiecError(f"{field}[{i}]", float(factors[i]), f"{implied[i]:.6g}, as the config's RoPE ({kind}) implies",
                            f"{where}; the config and the checkpoint disagree: without a config in model.json "
                            "kiec reads the GGUF's own")

    def get(self, canonical: str, dtype=np.float32) -> np.ndarray:
        """The tensor, refused if any value is NaN or infinite: such a checkpoint would run, and every
        token would come out of NaN logits (as token 0), with nothing said."""
        name = self.expected[canonical][0]
        array = self.store.get(name, dtype)
        finite = np.isfinite(array)
        if not finite.all():
            raise KiecError(f"weights[{name}]", f"{array.size - int(finite.sum())} NaN or infinite values",
                            "finite weights", f"in {self.store.origin}")
        return array


def load_checkpoint(spec) -> Checkpoint:
    return Checkpoint(open_store(spec.weights, spec.config), spec.config)


# --- layouts: how a graph weight is cut from its canonical tensor ----------------------------

def materialize(ckpt: Checkpoint, tensor, dtype=np.float32) -> np.ndarray:
    """The array of graph weight `tensor` ([lanes, rows, cols] etc.) from the checkpoint."""
    src = ckpt.get(tensor.source, dtype)
    layout, shape = tensor.layout, tuple(tensor.shape)
    if layout in ("replicate", "native"):
        out = src
    elif layout == "lane1":
        out = src[None]
    elif layout == "colwise":       # split output rows: lane l owns rows l*n/L ...
        out = src.reshape((shape[0], shape[1]) + src.shape[1:])
    elif layout == "rowwise":       # split input columns: lane l owns columns l*n/L ...
        out = src.reshape(src.shape[0], shape[0], shape[2]).transpose(1, 0, 2)
    else:
        raise ValueError(f"unknown layout {layout}")
    if out.shape != shape:
        raise ValueError(f"{tensor.name}: {layout} of {src.shape} gives {out.shape}, graph wants {shape}")
    return np.ascontiguousarray(out)
