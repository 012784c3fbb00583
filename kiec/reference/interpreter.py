"""The numpy interpreter of ir.Graph: the golden on every machine.

It runs the graph's ops in order over T tokens at once (prefill) or one (decode),
in float32 or float64, with a KV cache per layer and, for DTP, the history of each
sublayer's partial sums that `past(d)` reads d layers later. It imports no pass:
it only knows the op table's semantics.
"""
from __future__ import annotations

import numpy as np

from ..errors import KiecError
from ..ir.graph import Graph
from ..model import ArchConfig, rope_inv_freq


class Reference:
    """One sequence's state (KV cache, position) over a Graph and its weights."""

    def __init__(self, graph: Graph, weights: dict, cfg: ArchConfig, max_seq_len: int, dtype=np.float64):
        self.graph, self.cfg, self.max_seq_len, self.dtype = graph, cfg, max_seq_len, np.dtype(dtype)
        self.weights = {k: np.asarray(v, dtype=self.dtype) for k, v in weights.items()}
        self.inv_freq = rope_inv_freq(cfg)
        lanes = graph.lanes
        kv_heads = cfg.kv_heads // lanes
        self.k_cache = np.zeros((cfg.layers, lanes, max_seq_len, kv_heads, cfg.head_dim), self.dtype)
        self.v_cache = np.zeros_like(self.k_cache)
        self.position = 0
        self.trace: dict | None = None     # set to {} to record every tensor of the last forward

    def reset(self, position: int = 0) -> None:
        """Forget the sequence after `position` (the cache below it stays valid: prefix reuse)."""
        self.position = position

    def forward(self, tokens) -> np.ndarray:
        """Appends `tokens` to the sequence; returns their logits [T, vocab]."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        t = len(tokens)
        if self.position + t > self.max_seq_len:
            raise KiecError("context", self.position + t, f"at most max_seq_len ({self.max_seq_len}) tokens")
        if t == 0:
            raise KiecError("tokens", [], "at least one token")
        if tokens.min() < 0 or tokens.max() >= self.cfg.vocab:
            raise KiecError("tokens", int(tokens.max()), f"token ids in [0, {self.cfg.vocab})")
        env = {"__tokens": tokens, "__pos": np.arange(self.position, self.position + t)}
        history: dict = {}
        for op in self.graph.ops:
            args = [env[n] if n in env else self.weights[n] for n in op.inputs]
            out = getattr(self, "_" + op.kind)(op, args, env, history)
            if op.output is not None:
                env[op.output] = out
        self.position += t
        if self.trace is not None:
            self.trace = {k: v for k, v in env.items() if not k.startswith("__")}
        return env["logits"]

    # --- ops: x is [T, lanes, n] -----------------------------------------------------------------
    def _Embed(self, op, args, env, history):
        (table,) = args
        rows = table[env["__tokens"]]                     # [T, D]
        return np.repeat(rows[:, None, :], op.attr("lanes"), axis=1)

    def _RMSNorm(self, op, args, env, history):
        x, w = args
        scale = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.dtype.type(op.attr("eps")))
        return x * scale * w                              # w: [D] or [lanes, D]

    def _Linear(self, op, args, env, history):
        x, w = args[0], args[1]
        if w.ndim == 2:
            w = w[None]
        y = np.einsum("tli,loi->tlo", x, w, optimize=True)
        if len(args) == 3:
            y = y + args[2]
        return y

    def _RoPE(self, op, args, env, history):
        (x,) = args
        t, lanes, _ = x.shape
        hd = op.attr("head_dim")
        x = x.reshape(t, lanes, op.attr("heads"), hd)
        ang = (env["__pos"][:, None] * self.inv_freq[None, :]).astype(self.dtype)   # [T, hd/2]
        cos, sin = np.cos(ang)[:, None, None, :], np.sin(ang)[:, None, None, :]
        if op.attr("pairs") == "half":
            x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
            out = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        else:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            out = np.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)
        return out.reshape(t, lanes, -1)

    def _KVAppend(self, op, args, env, history):
        k, v = args
        t, lanes, _ = k.shape
        shape = (t, lanes, op.attr("kv_heads"), op.attr("head_dim"))
        pos = env["__pos"]
        self.k_cache[op.layer][:, pos] = k.reshape(shape).transpose(1, 0, 2, 3)
        self.v_cache[op.layer][:, pos] = v.reshape(shape).transpose(1, 0, 2, 3)

    def _Attention(self, op, args, env, history):
        (q,) = args
        t, lanes, _ = q.shape
        heads, kv_heads, hd, window = op.attr("heads"), op.attr("kv_heads"), op.attr("head_dim"), op.attr("window")
        pos = env["__pos"]
        end = pos[-1] + 1
        k = self.k_cache[op.layer][:, :end]               # [lanes, S, kv, hd]
        v = self.v_cache[op.layer][:, :end]
        group = heads // kv_heads
        k = np.repeat(k, group, axis=2)
        v = np.repeat(v, group, axis=2)
        q = q.reshape(t, lanes, heads, hd)
        scores = np.einsum("tlhd,lshd->tlhs", q, k) / np.sqrt(self.dtype.type(hd))
        keys = np.arange(end)
        mask = keys[None, :] > pos[:, None]
        if window:
            mask |= keys[None, :] <= pos[:, None] - window
        scores = np.where(mask[:, None, None, :], -np.inf, scores)
        scores = scores - scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p = p / p.sum(axis=-1, keepdims=True)
        return np.einsum("tlhs,lshd->tlhd", p, v).reshape(t, lanes, heads * hd)

    def _SwiGLU(self, op, args, env, history):
        gate, up = args
        return gate / (1.0 + np.exp(-gate)) * up

    def _LaneReduce(self, op, args, env, history):
        (p,) = args
        history[(op.attr("sublayer"), op.layer)] = p
        mode = op.attr("mode")
        lanes = p.shape[1]
        if mode == "present":
            return np.repeat(p.sum(axis=1, keepdims=True), lanes, axis=1)
        if mode == "none":
            return p * np.sqrt(self.dtype.type(lanes))
        old = history[(op.attr("sublayer"), op.layer - op.attr("delay"))]
        return p + (old.sum(axis=1, keepdims=True) - old)

    def _Add(self, op, args, env, history):
        return args[0] + args[1]

    def _LaneSum(self, op, args, env, history):
        return args[0].sum(axis=1, keepdims=True)

    def _LMHead(self, op, args, env, history):
        x, w = args
        head = op.attr("head")
        if head == "replicate":
            return x.mean(axis=1) @ w.T
        if head == "lane":
            return x.reshape(x.shape[0], -1) @ w.T
        return np.einsum("tld,lvd->tlv", x, w).reshape(x.shape[0], -1)

    def _Select(self, op, args, env, history):
        return args[0].argmax(axis=-1)


def reference_weights(graph: Graph, ckpt, dtype=np.float32) -> dict:
    """Every graph weight materialized from the checkpoint (see kiec.weights.materialize)."""
    from ..weights import materialize
    return {t.name: materialize(ckpt, t, dtype) for t in graph.weights()}
