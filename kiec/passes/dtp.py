"""dtp: choose each LaneReduce's mode (Delayed Tensor Parallelism).

Needs: a sharded graph (every LaneReduce follows a row-parallel O or down projection).
Guarantees: every LaneReduce has mode `present` (blocking all-reduce: exact tensor
parallelism), `past` with delay d (a lane adds its own partial now and the other
lanes' partials of the same sublayer from d layers earlier) or `none` (p * sqrt(L)).
A laneformer gets its training-time modes from its config: layers i < d are
`present` (use_early_comm) or `none`, layers i >= d `past(d)` (use_comm) or `none`.
A standard model stays `present` everywhere — exact — unless `delay` is given: then
layers i >= delay use `past(delay)`, which is an approximation of the model.
"""
from __future__ import annotations

from ..ir.graph import Graph
from ..model import ArchConfig


def reduce_mode(cfg: ArchConfig, layer: int, delay: int | None) -> tuple[str, int]:
    if cfg.arch == "laneformer":
        d = cfg.broadcast_delay if delay is None else delay
        if layer < d:
            return ("present" if cfg.use_early_comm else "none"), 0
        return ("past", d) if cfg.use_comm else ("none", 0)
    if delay is not None and layer >= delay:
        return "past", delay
    return "present", 0


def dtp(graph: Graph, cfg: ArchConfig, delay: int | None = None) -> Graph:
    out = Graph(graph.arch, graph.lanes)
    for t in graph.weights():
        out.add_tensor(t)
    for op in graph.ops:
        attrs = dict(op.attrs)
        if op.kind == "LaneReduce":
            attrs["mode"], attrs["delay"] = reduce_mode(cfg, op.layer, delay)
        out.op(op.kind, op.inputs, op.output, layer=op.layer, **attrs)
    return out
