"""LANEFORMER.md (../shared/LANEFORMER.md) transcribed into plain numpy, from the document and
not from kiec: random checkpoints under the published names and shapes, and the forward.

`laneformer_forward` reads the checkpoint by its published names, runs all tokens at once with a
full causal mask (no KV cache), keeps every lane's residual stream, and concatenates the heads of
all lanes lane-major before attention. One reading of the document is ours: a sliding window of w
lets position t see keys t-w < s <= t (as Mistral's does).
"""
from __future__ import annotations

import json
import math

import numpy as np


def laneformer_forward(cfg: dict, w: dict, tokens, modes=None) -> np.ndarray:
    """Logits [T, V] of a laneformer_tp checkpoint. `modes[i]`, when given, overrides layer i's
    reduce mode ("present" | "past" | "none")."""
    D, n_layers, H = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    KV, L = cfg.get("num_key_value_heads", H), cfg.get("num_lanes", 1)
    hd, theta, eps = D // H, cfg.get("rope_theta", 10000.0), cfg.get("norm_eps", 1e-5)
    d = cfg.get("broadcast_delay", 1)
    window, n_win = cfg.get("sliding_window") or 0, cfg.get("sliding_window_n_layers", 0)
    unclamped = set(cfg.get("unclamped_layers") or ())
    replicated_scale = cfg.get("replicated_rmsn_scale", True)
    tokens = np.asarray(tokens)
    T = len(tokens)
    pos = np.arange(T)

    def mode(i):
        if modes is not None:
            return modes[i]
        if i < d:
            return "present" if cfg.get("use_early_comm", True) else "none"
        return "past" if cfg.get("use_comm", True) else "none"

    def rms(x):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)

    def norm(x, prefix, replicated):                       # x: [T, L, D]
        return rms(x) * (w[prefix + ".weight"] if replicated else w[prefix + ".scale"])

    def rope(x):                                           # x: [T, heads, hd], adjacent pairs
        ang = pos[:, None] * theta ** (-np.arange(0, hd, 2) / hd)[None, :]     # [T, hd/2]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out

    futures = {}

    def reduce(p, i, sublayer):                            # p: [T, L, D]
        futures[sublayer, i] = p
        m = mode(i)
        if m == "present":
            return np.broadcast_to(p.sum(axis=1, keepdims=True), p.shape)
        if m == "none":
            return p * math.sqrt(L)
        old = futures[sublayer, i - d]
        return p + (old.sum(axis=1, keepdims=True) - old)

    def attention(x, i):                                   # x: [T, L, D] -> partials [T, L, D]
        a = f"model.layers.{i}.attention."
        q = np.einsum("tld,lrd->tlr", x, w[a + "wq.weight"]).reshape(T, H, hd)    # lane-major heads
        k = np.einsum("tld,lrd->tlr", x, w[a + "wk.weight"]).reshape(T, KV, hd)
        v = np.einsum("tld,lrd->tlr", x, w[a + "wv.weight"]).reshape(T, KV, hd)
        q, k = rope(q), rope(k)
        visible = pos[None, :] <= pos[:, None]
        if window and (i < n_win or i >= n_layers + n_win) and i not in unclamped:
            visible &= pos[None, :] > pos[:, None] - window
        out = np.empty((T, H, hd))
        for h in range(H):
            kv = h // (H // KV)
            s = q[:, h] @ k[:, kv].T / math.sqrt(hd)
            s = np.where(visible, s, -np.inf)
            e = np.exp(s - s.max(axis=1, keepdims=True))
            out[:, h] = (e / e.sum(axis=1, keepdims=True)) @ v[:, kv]
        out = out.reshape(T, L, H * hd // L)
        return np.einsum("tlc,ldc->tld", out, w[a + "wo.weight"])

    def mlp(x, i):
        f = f"model.layers.{i}.feed_forward."
        gate = np.einsum("tld,lfd->tlf", x, w[f + "w1.weight"])
        up = np.einsum("tld,lfd->tlf", x, w[f + "w3.weight"])
        return np.einsum("tlf,ldf->tld", gate / (1 + np.exp(-gate)) * up, w[f + "w2.weight"])

    h = np.repeat(w["model.tok_embeddings.weight"][tokens][:, None, :], L, axis=1)
    for i in range(n_layers):
        p = f"model.layers.{i}."
        h = h + reduce(attention(norm(h, p + "attention_norm", replicated_scale), i), i, "attn")
        h = h + reduce(mlp(norm(h, p + "ffn_norm", replicated_scale), i), i, "mlp")

    head = w.get("lm_head.weight", w["model.tok_embeddings.weight"] if cfg.get("tie_word_embeddings") else None)
    if cfg.get("pre_norm_lane_agg", False):
        return (rms(h.sum(axis=1)) * w["model.norm.weight"]) @ head.T
    x = norm(h, "model.norm", replicated_scale)
    kind = cfg.get("lm_head_type", "replicate")
    if kind == "replicate":
        return x.mean(axis=1) @ head.T
    if kind == "lane":
        return x.reshape(T, L * D) @ w["lm_head.linear.weight"].T
    return np.einsum("tld,lvd->tlv", x, w["lm_head.weight"]).reshape(T, -1)


# --- checkpoints ---------------------------------------------------------------------------------

def random_laneformer(cfg: dict, seed: int) -> dict:
    """Random tensors under LANEFORMER.md's names and shapes (not kiec's table)."""
    rng = np.random.default_rng(seed)
    D, H, F, V = cfg["hidden_size"], cfg["num_attention_heads"], cfg["intermediate_size"], cfg["vocab_size"]
    KV, L = cfg.get("num_key_value_heads", H), cfg.get("num_lanes", 1)
    hd = D // H
    replicated = cfg.get("replicated_rmsn_scale", True)

    def proj(*shape):
        return rng.standard_normal(shape) / math.sqrt(shape[-1])

    def norm(prefix, replicated):
        return {prefix + ".weight": 1 + 0.1 * rng.standard_normal(D)} if replicated else \
               {prefix + ".scale": 1 + 0.1 * rng.standard_normal((L, D))}
    w = {"model.tok_embeddings.weight": rng.standard_normal((V, D))}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update(norm(p + "attention_norm", replicated))
        w.update(norm(p + "ffn_norm", replicated))
        w[p + "attention.wq.weight"] = proj(L, H * hd // L, D)
        w[p + "attention.wk.weight"] = proj(L, KV * hd // L, D)
        w[p + "attention.wv.weight"] = proj(L, KV * hd // L, D)
        w[p + "attention.wo.weight"] = proj(L, D, H * hd // L) / math.sqrt(L)
        w[p + "feed_forward.w1.weight"] = proj(L, F // L, D)
        w[p + "feed_forward.w3.weight"] = proj(L, F // L, D)
        w[p + "feed_forward.w2.weight"] = proj(L, D, F // L) / math.sqrt(L)
    w.update(norm("model.norm", replicated or cfg.get("pre_norm_lane_agg", False)))
    kind = "replicate" if cfg.get("pre_norm_lane_agg", False) else cfg.get("lm_head_type", "replicate")
    if not cfg.get("tie_word_embeddings", False):
        w[{"lane": "lm_head.linear.weight"}.get(kind, "lm_head.weight")] = {
            "replicate": lambda: rng.standard_normal((V, D)),
            "lane": lambda: rng.standard_normal((V, L * D)) / math.sqrt(L),
            "vocab_parallel": lambda: rng.standard_normal((L, V // L, D)),
        }[kind]()
    return w


def save_checkpoint(folder, cfg: dict, tensors: dict, dtype=np.float32):
    from safetensors.numpy import save_file
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: np.ascontiguousarray(v, dtype) for k, v in tensors.items()}, folder / "model.safetensors")
    return folder
