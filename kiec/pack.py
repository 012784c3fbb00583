"""Builds the weight blob the kernel reads, by memplan's `packing` list.

The kernel sees every matrix as contiguous rows of `stride` 16-bit elements; a
Q/K head's rows are reordered so that RoPE's pairs are adjacent (attention only
takes dot products, so q and k may share any order of their dimensions); gate and
up rows are interleaved so one tile holds matching pairs. `unpermute_pairs` undoes
the head reordering where a test compares q or k with the reference.
"""
from __future__ import annotations

import numpy as np

from .model import rope_inv_freq


def half_dtype(name: str):
    if name == "bf16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float16)


def permute_pairs(rows: np.ndarray, head_dim: int, pairs: str) -> np.ndarray:
    """[heads*hd, ...] in Hugging Face's rotate-half order -> adjacent RoPE pairs."""
    if pairs == "adjacent":
        return rows
    heads = rows.shape[0] // head_dim
    tail = rows.shape[1:]
    return rows.reshape(heads, 2, head_dim // 2, *tail).swapaxes(1, 2).reshape(rows.shape)


def unpermute_pairs(rows: np.ndarray, head_dim: int, pairs: str) -> np.ndarray:
    if pairs == "adjacent":
        return rows
    heads = rows.shape[0] // head_dim
    tail = rows.shape[1:]
    return rows.reshape(heads, head_dim // 2, 2, *tail).swapaxes(1, 2).reshape(rows.shape)


def rope_table(cfg, max_seq_len: int) -> np.ndarray:
    """[positions, head_dim/2, (cos, sin)] float32, angles in float64."""
    inv = rope_inv_freq(cfg)
    ang = np.arange(max_seq_len, dtype=np.float64)[:, None] * inv[None, :]
    return np.stack([np.cos(ang), np.sin(ang)], axis=-1).astype(np.float32)


def _padded(matrix: np.ndarray, stride: int, dtype) -> np.ndarray:
    out = np.zeros((matrix.shape[0], stride), dtype=dtype)
    out[:, : matrix.shape[1]] = matrix
    return out


def _lane_rows(entry: dict, arrays: dict, lane: int) -> np.ndarray:
    """The rows of one lane's packed matrix (or bias), before padding."""
    kind, src = entry["kind"], [arrays[name] for name in entry["sources"]]
    pick = lambda a: a[lane] if a.ndim == 3 or (a.ndim == 2 and kind == "qkv_bias") else a
    if kind in ("qkv", "qkv_bias"):
        hd, pairs = entry["head_dim"], entry["pairs"]
        q, k, v = (pick(a) for a in src)
        return np.concatenate([permute_pairs(q, hd, pairs), permute_pairs(k, hd, pairs), v])
    if kind == "interleave":
        gate, up = (pick(a) for a in src)
        return np.stack([gate, up], axis=1).reshape(-1, gate.shape[1])
    return pick(src[0])


def pack_weights(sched, arrays: dict, cfg, max_seq_len: int, dtype: str = "bf16", progress=None) -> np.ndarray:
    """arrays: graph weight name -> float array (kiec.weights.materialize). Returns the blob (uint8)."""
    mem = sched.memory["weights"]
    blob = np.zeros(mem["__total"][0], dtype=np.uint8)
    half = half_dtype(dtype)
    lanes_base, lane_stride = mem["__lanes_base"][0], mem["__lane_stride"][0]

    def put(offset: int, data: np.ndarray) -> None:
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        blob[offset: offset + raw.size] = raw

    for n, entry in enumerate(sched.packing):
        kind, name = entry["kind"], entry["name"]
        if entry["lane"] is None:
            offset = mem[name][0]
            if kind == "matrix":
                put(offset, _padded(arrays[entry["sources"][0]].reshape(entry["rows"], -1), entry["stride"], half))
            elif kind == "fp32":
                put(offset, arrays[entry["sources"][0]].astype(np.float32))
            elif kind == "rope":
                put(offset, rope_table(cfg, max_seq_len))
        else:
            for lane in range(sched.lanes):
                offset = lanes_base + lane * lane_stride + mem["lane." + name][0]
                if kind == "fp32_lane":
                    norm = arrays[entry["sources"][0]]
                    put(offset, (norm[lane] if norm.ndim == 2 else norm).astype(np.float32))
                elif kind == "qkv_bias":
                    put(offset, _lane_rows(entry, arrays, lane).astype(np.float32))
                else:
                    put(offset, _padded(_lane_rows(entry, arrays, lane), entry["stride"], half))
        if progress:
            progress("pack weights", n + 1, len(sched.packing))
    return blob
