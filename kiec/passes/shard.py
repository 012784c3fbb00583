"""shard: split a one-lane graph over L lanes (tensor parallelism).

Needs: a graph with 1 lane (standard models) or already L lanes (a laneformer,
whose checkpoint is stored per lane; then nothing changes).
Guarantees: every activation has L lanes; lane l owns query heads l*H/L ..., KV heads
l*KV/L ... and FFN columns l*F/L ...; the Q/K/V and gate/up weights (and biases) are
split by output rows (colwise), O and down by input columns (rowwise), so each lane's
O and down produce a full-width partial sum that the following LaneReduce combines.
Norms, the embedding and the LM head are replicated. Heads and FFN width must divide.
"""
from __future__ import annotations

from ..errors import KiecError
from ..ir.graph import Graph, Tensor

# weight role -> how it is cut
RULES = {
    "wq": "colwise", "wk": "colwise", "wv": "colwise",
    "bq": "colwise", "bk": "colwise", "bv": "colwise",
    "w_gate": "colwise", "w_up": "colwise",
    "wo": "rowwise", "w_down": "rowwise",
    "norm": "replicate", "embed": "replicate", "lm_head": "replicate",
}
# per-lane op attributes that count heads
HEAD_ATTRS = ("heads", "kv_heads")


def shard(graph: Graph, lanes: int) -> Graph:
    if graph.lanes == lanes:
        return graph
    if graph.lanes != 1:
        raise KiecError("lanes", lanes, f"the graph's own lane count ({graph.lanes})",
                        "a laneformer checkpoint is already split into lanes")
    out = Graph(graph.arch, lanes)
    for t in graph.weights():
        out.add_tensor(_cut(t, lanes))
    for op in graph.ops:
        attrs = dict(op.attrs)
        for key in HEAD_ATTRS:
            if key in attrs:
                if attrs[key] % lanes:
                    raise KiecError("lanes", lanes, f"a divisor of {key} ({attrs[key]}) in layer {op.layer}")
                attrs[key] //= lanes
        if op.kind == "Embed":
            attrs["lanes"] = lanes
        out.op(op.kind, op.inputs, op.output, layer=op.layer, **attrs)
    return out


def _cut(t: Tensor, lanes: int) -> Tensor:
    rule = RULES[t.role]
    if rule == "replicate":
        return t
    shape = t.shape                       # (1, rows, cols) or (1, rows) for biases
    if rule == "colwise":
        if shape[1] % lanes:
            raise KiecError("lanes", lanes, f"a divisor of {t.name}'s {shape[1]} rows")
        new = (lanes, shape[1] // lanes) + shape[2:]
    else:
        if shape[2] % lanes:
            raise KiecError("lanes", lanes, f"a divisor of {t.name}'s {shape[2]} columns")
        new = (lanes, shape[1], shape[2] // lanes)
    return Tensor(t.name, new, t.kind, t.role, t.source, rule)
