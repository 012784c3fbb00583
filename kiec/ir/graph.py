"""ir.Graph: a small op graph over named tensors, one decode token, per lane.

Activations have shape [lanes, n]; weights [lanes, rows, cols] (or replicated
[rows, cols] / [n]). The KV cache is per-layer state that KVAppend writes and
Attention reads. Shapes are checked when an op is added (OPS holds one shape rule
per op), so a Graph that exists is well-formed; `verify` re-checks one after a pass.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from ..errors import KiecError


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple
    kind: str                  # "weight" | "act" | "input"
    role: str = ""             # weights: wq, wk, wv, bq, bk, bv, wo, w_gate, w_up, w_down, norm, embed, lm_head
    source: str = ""           # weights: the canonical checkpoint name they are cut from
    layout: str = "lane1"      # weights: how `source` becomes `shape` (see kiec.weights.materialize)


@dataclass(frozen=True)
class Op:
    kind: str
    inputs: tuple
    output: str | None
    attrs: tuple = ()          # sorted (key, value) pairs: hashable and printable
    layer: int | None = None

    def attr(self, key, default=None):
        return dict(self.attrs).get(key, default)


def _attrs(**kw) -> tuple:
    return tuple(sorted(kw.items()))


# --- the op table: one shape rule per op -------------------------------------------------------
# Each rule gets the input shapes and attrs and returns the output shape (or None: no output).

def _norm(shapes, a):
    x, w = shapes
    if w not in ((x[1],), (x[0], x[1])):
        raise ValueError(f"norm weight {w} does not fit x {x}")
    return x


def _linear(shapes, a):
    x, w = shapes[0], shapes[1]
    lanes, width = x
    if len(w) == 2:            # replicated weight, one copy for every lane
        w = (lanes,) + w
    if w[0] != lanes or w[2] != width:
        raise ValueError(f"weight {w} does not fit x {x}")
    if len(shapes) == 3 and shapes[2] not in ((w[0], w[1]), (w[1],)):
        raise ValueError(f"bias {shapes[2]} does not fit weight {w}")
    return (lanes, w[1])


def _rope(shapes, a):
    (x,) = shapes
    if x[1] != a["heads"] * a["head_dim"]:
        raise ValueError(f"{x} is not {a['heads']} heads of {a['head_dim']}")
    return x


def _kv_append(shapes, a):
    k, v = shapes
    if k != v or k[1] != a["kv_heads"] * a["head_dim"]:
        raise ValueError(f"k {k} / v {v} do not fit {a['kv_heads']} heads of {a['head_dim']}")
    return None


def _attention(shapes, a):
    (q,) = shapes
    if q[1] != a["heads"] * a["head_dim"] or a["heads"] % a["kv_heads"]:
        raise ValueError(f"q {q} does not fit {a['heads']} heads over {a['kv_heads']} kv heads")
    return q


def _same2(shapes, a):
    x, y = shapes
    if x != y:
        raise ValueError(f"{x} != {y}")
    return x


def _lane_reduce(shapes, a):
    (p,) = shapes
    if a["mode"] not in ("present", "past", "none"):
        raise ValueError(f"mode {a['mode']}")
    if a["mode"] == "past" and a["delay"] < 1:
        raise ValueError("past needs delay >= 1")
    return p


def _embed(shapes, a):
    (table,) = shapes
    return (a["lanes"], table[1])


def _lane_sum(shapes, a):
    (x,) = shapes
    return (1, x[1])


def _lm_head(shapes, a):
    x, w = shapes
    lanes, width = x
    kind = a["head"]
    if kind == "replicate" and w[1] == width:
        return (a["vocab"],)
    if kind == "lane" and w[1] == lanes * width:
        return (a["vocab"],)
    if kind == "vocab_parallel" and w == (lanes, a["vocab"] // lanes, width):
        return (a["vocab"],)
    raise ValueError(f"{kind} head {w} does not fit x {x}")


def _select(shapes, a):
    return (1,)


OPS = {
    "Embed": _embed,          # token -> [lanes, D]: the row copied to every lane
    "RMSNorm": _norm,         # attrs: eps; weight [D] replicated or scale [lanes, D]
    "Linear": _linear,        # x [lanes, in] . W[lane]^T (+ bias) -> [lanes, out]
    "RoPE": _rope,            # attrs: heads, head_dim, pairs ("half" | "adjacent")
    "KVAppend": _kv_append,   # writes k, v at the current position of this layer's cache
    "Attention": _attention,  # attrs: heads, kv_heads, head_dim, window (0: causal)
    "SwiGLU": _same2,         # silu(gate) * up
    "LaneReduce": _lane_reduce,  # attrs: mode, delay, sublayer ("attn" | "mlp")
    "Add": _same2,            # residual add
    "LaneSum": _lane_sum,     # [lanes, D] -> [1, D]
    "LMHead": _lm_head,       # attrs: head, vocab
    "Select": _select,        # argmax or sampling -> the next token
}


@dataclass
class Graph:
    """Ops in execution order over named tensors; `lanes` is the lane count of every activation."""
    arch: str
    lanes: int
    tensors: dict = field(default_factory=dict)
    ops: list = field(default_factory=list)

    # -- building --------------------------------------------------------------------------------
    def add_tensor(self, t: Tensor) -> str:
        if t.name in self.tensors:
            raise ValueError(f"tensor {t.name} defined twice")
        self.tensors[t.name] = t
        return t.name

    def weight(self, name: str, shape: tuple, role: str, layout: str = "lane1", source: str = "") -> str:
        return self.add_tensor(Tensor(name, tuple(shape), "weight", role, source or name, layout))

    def op(self, kind: str, inputs, output: str | None = None, layer=None, **attrs) -> str | None:
        inputs = tuple(inputs)
        op = Op(kind, inputs, output, _attrs(**attrs), layer)
        shape = self.infer(op)
        if output is not None:
            self.add_tensor(Tensor(output, shape, "act"))
        self.ops.append(op)
        return output

    def infer(self, op: Op):
        if op.kind not in OPS:
            raise ValueError(f"unknown op {op.kind}")
        missing = [n for n in op.inputs if n not in self.tensors]
        if missing:
            raise ValueError(f"{op.kind}: undefined inputs {missing}")
        try:
            return OPS[op.kind]([self.tensors[n].shape for n in op.inputs], dict(op.attrs))
        except ValueError as err:
            raise ValueError(f"{op.kind} (layer {op.layer}): {err}") from None

    # -- reading ----------------------------------------------------------------------------------
    def weights(self) -> list:
        return [t for t in self.tensors.values() if t.kind == "weight"]

    def layer_ops(self, layer: int) -> list:
        return [op for op in self.ops if op.layer == layer]

    def dump(self) -> str:
        """Readable text: one line per tensor and op. Also the stage file `kiec compile --dump` writes."""
        lines = [f"graph {self.arch} lanes={self.lanes}"]
        for t in self.tensors.values():
            if t.kind != "act":
                lines.append(f"  {t.kind} {t.name} {list(t.shape)} role={t.role} layout={t.layout} source={t.source}")
        for op in self.ops:
            attrs = " ".join(f"{k}={v}" for k, v in op.attrs)
            out = f"{op.output}{list(self.tensors[op.output].shape)} = " if op.output else ""
            lines.append(f"  {out}{op.kind}({', '.join(op.inputs)}) {attrs}".rstrip())
        return "\n".join(lines) + "\n"

    def to_json(self) -> str:
        return json.dumps({"arch": self.arch, "lanes": self.lanes,
                           "tensors": [dataclasses.asdict(t) for t in self.tensors.values()],
                           "ops": [dataclasses.asdict(o) for o in self.ops]}, indent=1)

    @staticmethod
    def from_json(text: str) -> "Graph":
        raw = json.loads(text)
        g = Graph(raw["arch"], raw["lanes"])
        for t in raw["tensors"]:
            g.tensors[t["name"]] = Tensor(**dict(t, shape=tuple(t["shape"])))
        for o in raw["ops"]:
            g.ops.append(Op(o["kind"], tuple(o["inputs"]), o["output"],
                            tuple((k, v) for k, v in o["attrs"]), o["layer"]))
        verify(g)
        return g


def verify(graph: Graph) -> Graph:
    """Re-checks every op's shapes against the op table and that each tensor is defined before use."""
    defined = {n for n, t in graph.tensors.items() if t.kind != "act"}
    for op in graph.ops:
        for name in op.inputs:
            if name not in defined:
                raise KiecError("ir", f"{op.kind}({name})", "inputs defined before use")
        try:
            shape = graph.infer(op)
        except ValueError as err:
            raise KiecError("ir", op.kind, "shapes that fit the op table", str(err)) from None
        if op.output is not None:
            if graph.tensors[op.output].shape != shape:
                raise KiecError("ir", op.output, f"shape {shape}", "a pass left a stale shape")
            defined.add(op.output)
        for name in op.inputs:
            t = graph.tensors[name]
            if t.kind == "act" and len(t.shape) == 2 and t.shape[0] not in (graph.lanes, 1):
                raise KiecError("ir", name, f"{graph.lanes} lanes", f"shape {t.shape}")
    return graph
