"""Builds the weight blob the kernel reads, by memplan's `packing` list.

The kernel sees every matrix as contiguous rows of `stride` 16-bit elements; a
Q/K head's rows are reordered so that RoPE's pairs are adjacent (attention only
takes dot products, so q and k may share any order of their dimensions); gate and
up rows are interleaved so one tile holds matching pairs; a down taken in column halves
stacks them (the first half's columns of every row, then the second's). `unpermute_pairs` undoes
the head reordering where a test compares q or k with the reference. A tiled matrix
(for the matrix units) keeps the same bytes per group of TILE_ROWS rows, reordered into
TILE_ROWS x TILE_COLS tiles, each row-major, left to right (`tile_rows`, `untile_rows`).
"""
from __future__ import annotations

import numpy as np

from .ir.schedule import TILE_COLS, TILE_ROWS
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
    if kind == "halves":
        m = pick(src[0])
        return np.concatenate([m[:, : m.shape[1] // 2], m[:, m.shape[1] // 2:]])
    return pick(src[0])


def tile_rows(rows: np.ndarray) -> np.ndarray:
    """[rows, stride] -> the tiled order: [row group][column tile][TILE_ROWS][TILE_COLS], flattened
    to [packed rows, stride] (the last group padded with zero rows). stride % TILE_COLS == 0."""
    n, stride = rows.shape
    padded = np.zeros((-(-n // TILE_ROWS) * TILE_ROWS, stride), dtype=rows.dtype)
    padded[:n] = rows
    groups = padded.reshape(-1, TILE_ROWS, stride // TILE_COLS, TILE_COLS).swapaxes(1, 2)
    return np.ascontiguousarray(groups).reshape(padded.shape)


def untile_rows(tiled: np.ndarray, rows: int) -> np.ndarray:
    """tile_rows undone: [packed rows, stride] in tiled order -> the first `rows` rows."""
    stride = tiled.shape[1]
    groups = tiled.reshape(-1, stride // TILE_COLS, TILE_ROWS, TILE_COLS).swapaxes(1, 2)
    return groups.reshape(tiled.shape)[:rows]


def pack_weights(sched, arrays: dict, cfg, max_seq_len: int, dtype: str = "bf16", progress=None) -> np.ndarray:
    """arrays: graph weight name -> float array (kiec.weights.materialize). Returns the blob (uint8)."""
    mem = sched.memory["weights"]
    blob = np.zeros(mem["__total"][0], dtype=np.uint8)
    half = half_dtype(dtype)
    lanes_base, lane_stride = mem["__lanes_base"][0], mem["__lane_stride"][0]

    def put(offset: int, data: np.ndarray) -> None:
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        blob[offset: offset + raw.size] = raw

    def matrix(entry: dict, rows: np.ndarray) -> np.ndarray:
        padded = _padded(rows, entry["stride"], half)
        return tile_rows(padded) if entry.get("tiled") else padded

    for n, entry in enumerate(sched.packing):
        kind, name = entry["kind"], entry["name"]
        if entry["lane"] is None:
            offset = mem[name][0]
            if kind == "matrix":
                put(offset, matrix(entry, arrays[entry["sources"][0]].reshape(entry["rows"], -1)))
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
                    put(offset, matrix(entry, _lane_rows(entry, arrays, lane)))
        if progress:
            progress("pack weights", n + 1, len(sched.packing))
    return blob
