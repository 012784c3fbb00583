"""fuse: group the graph's ops into the kernel's stages.

Needs: a verified, sharded graph whose LaneReduce modes are set (after `dtp`).
Guarantees: every op belongs to exactly one stage, in graph order; each layer is
five stages — qkv (norm + Q/K/V + RoPE + KV append; the embedding lookup folds into
layer 0's), attention, attn_out (O + lane reduce + residual), gate_up (norm + gate/up
+ SiLU*up), down (down + lane reduce + residual) — and the output is one lm_head
stage (final norm, LM head, selection). A GEMV stage knows its packed matrix shape.
An op sequence no pattern matches is an error naming the op, so a new op cannot be
silently dropped.
"""
from __future__ import annotations

from ..errors import KiecError
from ..ir.graph import Graph
from ..ir.schedule import Schedule, Stage, gemv_shape

# (stage kind, op kinds in order, role of the first Linear's weight or None)
PATTERNS = [
    ("qkv", ("RMSNorm", "Linear", "Linear", "Linear", "RoPE", "RoPE", "KVAppend"), "wq"),
    ("attention", ("Attention",), None),
    ("attn_out", ("Linear", "LaneReduce", "Add"), "wo"),
    ("gate_up", ("RMSNorm", "Linear", "Linear", "SwiGLU"), "w_gate"),
    ("down", ("Linear", "LaneReduce", "Add"), "w_down"),
    ("lm_head", ("LaneSum", "RMSNorm", "LMHead", "Select"), None),
    ("lm_head", ("RMSNorm", "LMHead", "Select"), None),
]


def fuse(graph: Graph, cfg) -> Schedule:
    ops = graph.ops
    if not ops or ops[0].kind != "Embed":
        raise KiecError("ir", ops[0].kind if ops else None, "a graph that starts with Embed")
    stages: list[Stage] = []
    i = 1
    while i < len(ops):
        kind, n = _match(graph, i)
        group = tuple(range(i, i + n))
        if kind == "qkv" and not stages:
            group = (0,) + group            # the embedding lookup feeds layer 0
        stages.append(_stage(graph, cfg, len(stages), kind, group))
        i += n
    facts = dict(hidden=cfg.hidden, head_dim=cfg.head_dim, heads=cfg.heads // graph.lanes, vocab=cfg.vocab,
                 layers=cfg.layers)
    return Schedule(model=graph.arch, arch=graph.arch, lanes=graph.lanes, stages=stages, config=facts)


def _match(graph: Graph, i: int) -> tuple[str, int]:
    ops = graph.ops
    for kind, pattern, role in PATTERNS:
        window = ops[i:i + len(pattern)]
        if tuple(op.kind for op in window) != pattern:
            continue
        if role is not None:
            linear = next(op for op in window if op.kind == "Linear")
            if graph.tensors[linear.inputs[1]].role != role:
                continue
        return kind, len(pattern)
    raise KiecError("ir", f"{ops[i].kind} at op {i} (layer {ops[i].layer})", "an op sequence a stage pattern fuses",
                    "add a pattern to kiec/passes/fuse.py and a stage template")


def _stage(graph: Graph, cfg, index: int, kind: str, group: tuple) -> Stage:
    ops = [graph.ops[j] for j in group]
    layer = next((op.layer for op in ops if op.layer is not None), None)
    first = {op.kind: op for op in reversed(ops)}
    shape = lambda name: graph.tensors[name].shape
    attrs: dict = {}
    gemv = None
    if kind == "qkv":
        q, k, v = (op for op in ops if op.kind == "Linear")
        rope = first["RoPE"]
        attrs.update(eps=first["RMSNorm"].attr("eps"), bias=len(q.inputs) == 3, embed_input=0 in group,
                     q_rows=shape(q.output)[1], kv_rows=shape(k.output)[1], head_dim=rope.attr("head_dim"),
                     pairs=rope.attr("pairs"), norm=first["RMSNorm"].inputs[1],
                     weights=(q.inputs[1], k.inputs[1], v.inputs[1]),
                     biases=tuple(op.inputs[2] for op in (q, k, v)) if len(q.inputs) == 3 else ())
        gemv = gemv_shape(attrs["q_rows"] + 2 * attrs["kv_rows"], shape(q.inputs[0])[1])
    elif kind == "attention":
        att = first["Attention"]
        attrs.update(heads=att.attr("heads"), kv_heads=att.attr("kv_heads"), head_dim=att.attr("head_dim"),
                     window=att.attr("window"))
    elif kind in ("attn_out", "down"):
        lin, red = first["Linear"], first["LaneReduce"]
        attrs.update(mode=red.attr("mode"), delay=red.attr("delay"), sublayer=red.attr("sublayer"),
                     weights=(lin.inputs[1],), embed_residual=kind == "attn_out" and layer == 0)
        w = shape(lin.inputs[1])
        gemv = gemv_shape(w[1], w[2])
    elif kind == "gate_up":
        gate, up = (op for op in ops if op.kind == "Linear")
        attrs.update(eps=first["RMSNorm"].attr("eps"), norm=first["RMSNorm"].inputs[1],
                     weights=(gate.inputs[1], up.inputs[1]), ffn=shape(gate.output)[1])
        gemv = gemv_shape(2 * shape(gate.output)[1], shape(gate.inputs[0])[1])
    elif kind == "lm_head":
        head = first["LMHead"]
        norm = first["RMSNorm"]
        attrs.update(eps=norm.attr("eps"), norm=norm.inputs[1], head=head.attr("head"), vocab=head.attr("vocab"),
                     lane_sum="LaneSum" in first, weights=(head.inputs[1],),
                     per_lane_norm=len(shape(norm.inputs[1])) == 2)
        if head.attr("head") != "replicate":
            raise KiecError("lm_head_type", head.attr("head"), "'replicate' on the GPU backend",
                            "the 'lane' and 'vocab_parallel' heads run on the reference backend only for now")
        w = shape(head.inputs[1])
        gemv = gemv_shape(w[0], w[1])
    return Stage(index=index, kind=kind, layer=layer, ops=group, gemv=gemv, attrs=tuple(sorted(attrs.items())))
