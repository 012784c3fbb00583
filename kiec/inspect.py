"""`kiec inspect`: what the compiler sees — the graph, parameters, bytes per token, the lane split."""
from __future__ import annotations

import re
from collections import Counter

import numpy as np

from .model import ModelSpec
from .pipeline import build_graph

DTYPE_BYTES = {"bf16": 2, "fp16": 2}


def bytes_per_token(spec: ModelSpec, context: int) -> dict:
    """Bytes one decode step must read: every weight once (one embedding row), plus the KV cache."""
    graph = build_graph(spec)
    cfg, esize = spec.config, DTYPE_BYTES[spec.dtype]
    per_lane = np.zeros(graph.lanes)
    shared = 0
    for t in graph.weights():
        n = int(np.prod(t.shape))
        if t.role == "embed":
            n = cfg.hidden                        # one row is read
        if t.layout in ("replicate",):
            shared += n * esize
        else:
            per_lane += n * esize / t.shape[0]
    kv = cfg.layers * 2 * cfg.kv_dim * esize * sum(
        min(context, cfg.sliding_window) if cfg.uses_window(i) else context for i in range(cfg.layers)) / cfg.layers
    return {"weights": int(per_lane.sum() + shared), "per_lane_weights": int(per_lane[0]), "shared": shared,
            "kv_cache": int(kv), "total": int(per_lane.sum() + shared + kv)}


def describe(spec: ModelSpec, context: int = 128) -> str:
    graph = build_graph(spec)
    cfg = spec.config
    counts = Counter(op.kind for op in graph.ops)
    b = bytes_per_token(spec, context)
    modes = Counter((op.attr("mode"), op.attr("delay")) for op in graph.ops if op.kind == "LaneReduce")
    lines = [
        f"model      {spec.name} ({cfg.arch}) from {spec.source or spec.weights}",
        f"shape      {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads / {cfg.kv_heads} kv heads of "
        f"{cfg.head_dim}, ffn {cfg.ffn}, vocab {cfg.vocab}"
        + (f", sliding window {cfg.sliding_window} on {sum(cfg.window_layers)} layers" if cfg.sliding_window else ""),
        f"params     {cfg.parameter_count() / 1e6:.1f} M ({cfg.parameter_count()})",
        f"target     {spec.target}, dtype {spec.dtype}, max_seq_len {spec.max_seq_len}",
        f"lanes      {graph.lanes} on {spec.gpus} GPU(s); lane reduce: "
        + ", ".join(f"{m}{'(' + str(d) + ')' if m == 'past' else ''} x{n}" for (m, d), n in sorted(modes.items())),
    ]
    if spec.approximate:
        lines.append(f"WARNING    past({spec.dtp_delay}) on a {cfg.arch} model not trained with delay: "
                     "an approximation of the model (`kiec inspect --dtp-error` measures how far)")
    lines += [
        f"bytes/token {b['total'] / 1e6:.2f} MB at context {context}: weights {b['weights'] / 1e6:.2f} MB "
        f"+ KV cache {b['kv_cache'] / 1e6:.2f} MB",
        f"per lane   {b['per_lane_weights'] / 1e6:.2f} MB of lane weights + {b['shared'] / 1e6:.2f} MB replicated",
        "ops        " + ", ".join(f"{k} x{v}" for k, v in counts.items()),
        "",
        "graph (first layer and output):",
    ]
    shown = [l for l in graph.dump().splitlines() if _layer_of(l) in (None, 0)]
    lines += shown
    return "\n".join(lines)


def _layer_of(line: str):
    """The layer a dump line belongs to: the one its output (or weight, or first input) names."""
    found = re.search(r"layers\.(\d+)\.", line.split(" = ")[0])
    return None if found is None else int(found.group(1))
