"""lower: ModelSpec -> ir.Graph.

Guarantees: one Graph whose ops, in order, compute one decode token of the model:
Embed, then per layer (attention sublayer, MLP sublayer), then the final norm, the
LM head and Select. Standard models (llama, qwen2, mistral) come out with one lane
and weights in their natural layout; a laneformer comes out with its checkpoint's
lanes and its weights as stored. Every LaneReduce starts as `present`; the `dtp`
pass sets the modes.
"""
from __future__ import annotations

from ..ir.graph import Graph
from ..model import ArchConfig, ModelSpec


def lower(spec: ModelSpec) -> Graph:
    cfg = spec.config
    lanes = cfg.lanes if cfg.arch == "laneformer" else 1
    native = "native" if cfg.arch == "laneformer" else "lane1"
    g = Graph(cfg.arch, lanes)
    d, hd = cfg.hidden, cfg.head_dim
    heads, kv_heads, ffn = cfg.heads // lanes, cfg.kv_heads // lanes, cfg.ffn // lanes
    g.weight("embed", (cfg.vocab, d), "embed", "replicate")
    h = g.op("Embed", ["embed"], "h.embed", lanes=lanes)

    def norm_weight(name: str, replicated: bool) -> str:
        if replicated:
            return g.weight(name, (d,), "norm", "replicate")
        return g.weight(name, (lanes, d), "norm", "native")

    def linear(x, name, rows, cols, role, layer, bias=False):
        w = g.weight(name, (lanes, rows, cols), role, native)
        inputs = [x, w]
        if bias:
            inputs.append(g.weight(name.replace(".w", ".b"), (lanes, rows), "b" + role[1:], native))
        return g.op("Linear", inputs, f"{name}.out", layer=layer)

    for i in range(cfg.layers):
        p = f"layers.{i}"
        # attention sublayer
        x = g.op("RMSNorm", [h, norm_weight(f"{p}.attn_norm", cfg.replicated_norm)], f"{p}.attn.x",
                 layer=i, eps=cfg.norm_eps)
        q = linear(x, f"{p}.wq", heads * hd, d, "wq", i, cfg.qkv_bias)
        k = linear(x, f"{p}.wk", kv_heads * hd, d, "wk", i, cfg.qkv_bias)
        v = linear(x, f"{p}.wv", kv_heads * hd, d, "wv", i, cfg.qkv_bias)
        rope = dict(head_dim=hd, pairs=cfg.rope_pairs)
        q = g.op("RoPE", [q], f"{p}.q", layer=i, heads=heads, **rope)
        k = g.op("RoPE", [k], f"{p}.k", layer=i, heads=kv_heads, **rope)
        g.op("KVAppend", [k, v], None, layer=i, kv_heads=kv_heads, head_dim=hd)
        window = cfg.sliding_window if cfg.uses_window(i) else 0
        a = g.op("Attention", [q], f"{p}.attn.out", layer=i, heads=heads, kv_heads=kv_heads, head_dim=hd,
                 window=window)
        part = linear(a, f"{p}.wo", d, heads * hd, "wo", i)
        red = g.op("LaneReduce", [part], f"{p}.attn.reduced", layer=i, mode="present", delay=0, sublayer="attn")
        h = g.op("Add", [h, red], f"{p}.h.attn", layer=i)
        # MLP sublayer
        x = g.op("RMSNorm", [h, norm_weight(f"{p}.ffn_norm", cfg.replicated_norm)], f"{p}.mlp.x",
                 layer=i, eps=cfg.norm_eps)
        gate = linear(x, f"{p}.w_gate", ffn, d, "w_gate", i)
        up = linear(x, f"{p}.w_up", ffn, d, "w_up", i)
        act = g.op("SwiGLU", [gate, up], f"{p}.mlp.act", layer=i)
        part = linear(act, f"{p}.w_down", d, ffn, "w_down", i)
        red = g.op("LaneReduce", [part], f"{p}.mlp.reduced", layer=i, mode="present", delay=0, sublayer="mlp")
        h = g.op("Add", [h, red], f"{p}.h.mlp", layer=i)

    _output(g, cfg, h, lanes)
    return g


def _output(g: Graph, cfg: ArchConfig, h: str, lanes: int) -> None:
    d = cfg.hidden
    final_replicated = cfg.replicated_norm or cfg.pre_norm_lane_agg
    if cfg.pre_norm_lane_agg:
        h = g.op("LaneSum", [h], "h.lane_sum")
    norm = (g.weight("final_norm", (d,), "norm", "replicate") if final_replicated
            else g.weight("final_norm", (lanes, d), "norm", "native"))
    x = g.op("RMSNorm", [h, norm], "final.x", eps=cfg.norm_eps)
    head = "replicate" if cfg.pre_norm_lane_agg else cfg.lm_head_type
    source = "embed" if cfg.tie_embeddings else "lm_head"
    if head == "replicate":
        w = g.weight("lm_head", (cfg.vocab, d), "lm_head", "replicate", source=source)
    elif head == "lane":
        w = g.weight("lm_head", (cfg.vocab, lanes * d), "lm_head", "replicate", source=source)
    else:
        w = g.weight("lm_head", (lanes, cfg.vocab // lanes, d), "lm_head", "native", source=source)
    logits = g.op("LMHead", [x, w], "logits", head=head, vocab=cfg.vocab)
    g.op("Select", [logits], "token")
