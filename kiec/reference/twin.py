"""The Python twin of a Schedule: runs the scheduled stages the way the kernel does.

It reads the packed weight blob through memplan's offsets and strides, keeps q and k
in the packed (pair-adjacent) order, stores K/V in 16-bit in the kernel's cache layout,
splits attention as the kernel does at each context and combines them, interleaves gate/up, takes
down in column halves where the schedule does (its trace then holds h plus the first half's sums, then
the second's) — so a wrong offset, permutation or split shows up here, on the CPU, against the graph
interpreter. On the GPU its per-stage trace is what the kernel's trace is diffed with.
"""
from __future__ import annotations

import numpy as np

from ..ir.schedule import Schedule
from ..passes.schedule import attention_splits
from ..pack import half_dtype, untile_rows


class Twin:
    def __init__(self, sched: Schedule, blob: np.ndarray, cfg, max_seq_len: int, dtype: str = "bf16"):
        self.s, self.blob, self.cfg, self.max_seq_len = sched, blob, cfg, max_seq_len
        self.half = half_dtype(dtype)
        self.lanes = sched.lanes
        att = next(s for s in sched.stages if s.kind == "attention")
        self.kv_heads, self.hd = att.attr("kv_heads"), cfg.head_dim
        shape = (self.lanes, cfg.layers, self.kv_heads, max_seq_len, self.hd)
        self.k_cache = np.zeros(shape, self.half)
        self.v_cache = np.zeros(shape, self.half)
        mem = sched.memory["weights"]
        self.lanes_base, self.lane_stride = mem["__lanes_base"][0], mem["__lane_stride"][0]
        rope = mem["rope"][0]
        self.rope = blob[rope: rope + max_seq_len * (self.hd // 2) * 8].view(np.float32).reshape(max_seq_len, -1, 2)
        self._matrices: dict = {}      # fp32 copies: the blob is 16-bit, a step reads every matrix

    # --- reading the blob ---
    def matrix(self, stage, lane: int) -> np.ndarray:
        key = (stage.index, lane)
        if key not in self._matrices:
            self._matrices[key] = self._read_matrix(stage, lane)
        return self._matrices[key]

    def _read_matrix(self, stage, lane: int) -> np.ndarray:
        g = stage.gemv
        offset = g.offset + (0 if stage.kind == "lm_head" else lane * self.lane_stride)
        raw = self.blob[offset: offset + g.bytes].view(self.half).reshape(g.packed_rows, g.stride)
        if g.tiled:
            raw = untile_rows(raw, g.rows)
        return raw[:, : g.cols].astype(np.float32)

    def fp32(self, name: str, count: int, lane: int | None) -> np.ndarray:
        mem = self.s.memory["weights"]
        if lane is None:
            offset = mem[name][0]
        else:
            offset = self.lanes_base + lane * self.lane_stride + mem["lane." + name][0]
        return self.blob[offset: offset + 4 * count].view(np.float32)

    def embed_row(self, token: int) -> np.ndarray:
        d = self.cfg.hidden
        stride = -(-d // 8) * 8
        offset = self.s.memory["weights"]["embed"][0] + token * stride * 2
        return self.blob[offset: offset + stride * 2].view(self.half)[:d].astype(np.float32)

    # --- one decode step ---
    def step(self, token: int, pos: int) -> tuple[np.ndarray, dict]:
        cfg, L = self.cfg, self.lanes
        h = np.repeat(self.embed_row(token)[None], L, axis=0)        # [lanes, D]
        q = [None] * L
        act = [None] * L
        attn = [None] * L
        history: dict = {}
        trace: dict = {}
        for st in self.s.stages:
            p = f"layers.{st.layer}."
            if st.kind == "qkv":
                for l in range(L):
                    x = _rms(h[l], self.fp32(p + "attn_norm", cfg.hidden, l), st.attr("eps"))
                    y = self.matrix(st, l) @ x
                    if st.attr("bias"):
                        y = y + self.fp32(p + "qkv_bias", st.gemv.rows, l)
                    qr, kr = st.attr("q_rows"), st.attr("kv_rows")
                    y[: qr + kr] = self._rope(y[: qr + kr], pos)
                    q[l] = y[:qr]
                    k = y[qr: qr + kr].reshape(self.kv_heads, self.hd)
                    v = y[qr + kr:].reshape(self.kv_heads, self.hd)
                    self.k_cache[l, st.layer, :, pos] = k.astype(self.half)
                    self.v_cache[l, st.layer, :, pos] = v.astype(self.half)
                trace[st.index] = np.stack(q)
            elif st.kind == "attention":
                for l in range(L):
                    attn[l] = self._attention(st, l, q[l], pos)
                trace[st.index] = np.stack(attn)
            elif st.attr("half_tiles"):     # down in column halves (one lane): h + the first, then the second apart
                w, half, d = self.matrix(st, 0), st.gemv.cols, cfg.hidden
                first, second = h[0] + w[:d] @ act[0][:half], w[d:] @ act[0][half:]
                trace[st.index] = np.concatenate([first, second])[None]
                h = (first + second)[None]
            elif st.kind in ("attn_out", "down"):
                inputs = attn if st.kind == "attn_out" else act
                parts = np.stack([self.matrix(st, l) @ inputs[l] for l in range(L)])
                history[(st.attr("sublayer"), st.layer)] = parts
                h = h + _lane_reduce(parts, st, history)
                trace[st.index] = h.copy()
            elif st.kind == "gate_up":
                for l in range(L):
                    x = _rms(h[l], self.fp32(p + "ffn_norm", cfg.hidden, l), st.attr("eps"))
                    y = (self.matrix(st, l) @ x).reshape(-1, 2)
                    gate, up = y[:, 0], y[:, 1]
                    act[l] = gate / (1.0 + np.exp(-gate)) * up
                trace[st.index] = np.stack(act)
            elif st.kind == "lm_head":
                w = self.fp32("final_norm", cfg.hidden * (L if st.attr("per_lane_norm") else 1), None)
                w = w.reshape(L, -1) if st.attr("per_lane_norm") else np.repeat(w[None], L, axis=0)
                if st.attr("lane_sum"):
                    x = _rms(h.sum(axis=0), w[0], st.attr("eps"))
                else:
                    x = np.mean([_rms(h[l], w[l], st.attr("eps")) for l in range(L)], axis=0)
                logits = self.matrix(st, 0) @ x
                trace[st.index] = logits
        return logits, trace

    def _rope(self, rows: np.ndarray, pos: int) -> np.ndarray:
        pairs = rows.reshape(-1, self.hd // 2, 2)
        cos, sin = self.rope[pos, :, 0], self.rope[pos, :, 1]
        a, b = pairs[..., 0], pairs[..., 1]
        return np.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(rows.shape)

    def _attention(self, st, lane: int, q: np.ndarray, pos: int) -> np.ndarray:
        heads, kv, hd, window = st.attr("heads"), st.attr("kv_heads"), st.attr("head_dim"), st.attr("window")
        group = heads // kv
        lo = max(0, pos - window + 1) if window else 0
        length, used = attention_splits(lo, pos, st.attr("splits"), st.attr("batch"), st.attr("min_split"),
                                        st.attr("by_head_keys", 0), st.attr("by_head_splits", 1))
        out = np.zeros((heads, hd), np.float32)
        scale = 1.0 / np.sqrt(hd)
        for j in range(kv):
            qg = q.reshape(heads, hd)[j * group:(j + 1) * group]
            partials = []
            for split in range(used):                                     # the splits the kernel runs
                a, b = lo + split * length, min(pos + 1, lo + (split + 1) * length)
                k = self.k_cache[lane, st.layer, j, a:b].astype(np.float32)
                v = self.v_cache[lane, st.layer, j, a:b].astype(np.float32)
                s = qg @ k.T * scale
                m = s.max(axis=1, keepdims=True)
                e = np.exp(s - m)
                partials.append((m[:, 0], e.sum(axis=1), e @ v))
            top = np.max([m for m, _, _ in partials], axis=0)
            total = sum(l * np.exp(m - top) for m, l, _ in partials)
            acc = sum(o * np.exp(m - top)[:, None] for m, _, o in partials)
            out[j * group:(j + 1) * group] = acc / total[:, None]
        return out.reshape(-1)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x) + eps) * w


def _lane_reduce(parts: np.ndarray, st, history: dict) -> np.ndarray:
    mode, lanes = st.attr("mode"), parts.shape[0]
    if mode == "present":
        return np.repeat(parts.sum(axis=0, keepdims=True), lanes, axis=0)
    if mode == "none":
        return parts * np.sqrt(lanes)
    old = history[(st.attr("sublayer"), st.layer - st.attr("delay"))]
    return parts + (old.sum(axis=0, keepdims=True) - old)
