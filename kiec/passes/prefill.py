"""prefill: the plan of the prompt path, over the decode kernel's packed weights.

Needs: a memory-planned Schedule (memplan) and the target table.
Guarantees `sched.prefill`: either None, with `sched.config["prefill_off"]` saying why (the
decode kernel then takes the prompt token by token), or a dict the templates render as is:
- `chunk`: prompt tokens one pass takes (a multiple of 64, at most max_seq_len);
- `key_tile`: keys one attention step holds in shared memory (64, 32 or 16: what fits the target
  next to the queries, double-buffered, and keeps the accumulators in registers);
- `gemm`: the GEMM block (warps_m x warps_n warps of units_m x units_n 16x16 tiles, k per slice,
  slices in flight), whose shared memory fits the target;
- `layers`: per layer the absolute byte offsets of its norms, packed matrices and bias in the
  weight blob, each matrix's rows, cols and row stride, q/kv rows and the attention window; where
  down takes its columns in halves, `down` is the first half's matrix and `down_second` the second's
  (else None), each a GEMM over its half of the `ffn`-wide activation.
Every matrix the GEMMs read has cols and stride in multiples of 8 elements (16-byte loads), and
the rows of the matrices are exactly the decode kernel's (RoPE pairs adjacent, gate/up interleaved;
tiled where the decode kernel's are, which the GEMMs' loads follow: weight_at).
"""
from __future__ import annotations

import dataclasses

from ..ir.schedule import Schedule
from ..targets import Target

DEFAULT_CHUNK = 2048
ATTENTION_ROWS = 64            # queries one attention block takes (4 warps of 16)
GEMM = dict(warps_m=2, warps_n=4, units_m=4, units_n=2, k=32, stages=3)
WIDE_K = 64                    # k per slice where shared memory holds it: half the barriers, ~4% faster on the H200


def gemm_smem(g: dict) -> int:
    return g["stages"] * 16 * (g["warps_m"] * g["units_m"] + g["warps_n"] * g["units_n"]) * (g["k"] + 8) * 2


def key_tile(head_dim: int, smem_bytes: int) -> int:
    """The largest key tile whose shared memory (queries + 2 x (K, V) + 4 warps' 16x16 scratch) fits."""
    ld = head_dim + 8
    for keys in ((64, 32, 16) if head_dim <= 128 else (32, 16)):
        if (ATTENTION_ROWS + 4 * keys) * ld * 2 + 4 * 256 * 2 <= smem_bytes:
            return keys
    return 0


def gemm_block(target: Target) -> dict:
    wide = dict(GEMM, k=WIDE_K)
    return wide if gemm_smem(wide) <= target.smem_bytes else dict(GEMM)


def prefill(sched: Schedule, target: Target, chunk: int | None = None) -> Schedule:
    cfg = sched.config
    reason = _unsupported(sched, target)
    if reason:
        return dataclasses.replace(sched, prefill=None, config=dict(cfg, prefill_off=reason))
    max_seq = cfg["max_seq_len"]
    chunk = min(chunk or DEFAULT_CHUNK, -(-max_seq // 64) * 64)
    w = sched.memory["weights"]
    base = w["__lanes_base"][0]
    layers = []
    for layer in range(cfg["layers"]):
        stages = {s.kind: s for s in sched.stages if s.layer == layer}
        qkv, att = stages["qkv"], stages["attention"]
        prefix = f"lane.layers.{layer}."

        def matrix(s):
            return dict(offset=s.gemv.offset, rows=s.gemv.rows, cols=s.gemv.cols, stride=s.gemv.stride)

        down, down_second = matrix(stages["down"]), None
        if stages["down"].attr("half_tiles"):       # the column halves stacked: a GEMM each, over its half of act
            down = dict(down, rows=down["rows"] // 2)
            down_second = dict(down, offset=down["offset"] + down["rows"] * down["stride"] * 2)

        layers.append(dict(
            layer=layer,
            attn_norm=base + w[prefix + "attn_norm"][0], attn_eps=float(qkv.attr("eps")),
            ffn_norm=base + w[prefix + "ffn_norm"][0], ffn_eps=float(stages["gate_up"].attr("eps")),
            qkv=matrix(qkv), o=matrix(stages["attn_out"]), gate_up=matrix(stages["gate_up"]),
            down=down, down_second=down_second, ffn=stages["gate_up"].gemv.rows // 2,
            bias=base + w[prefix + "qkv_bias"][0] if qkv.attr("bias") else None,
            q_rows=qkv.attr("q_rows"), kv_rows=qkv.attr("kv_rows"), window=att.attr("window") or 0))
    plan = dict(chunk=chunk, key_tile=key_tile(cfg["head_dim"], target.smem_bytes), gemm=gemm_block(target), layers=layers)
    return dataclasses.replace(sched, prefill=plan, config=dict(cfg, prefill_off=None))


def _unsupported(sched: Schedule, target: Target) -> str | None:
    cfg = sched.config
    if sched.lanes > 1:
        return f"{sched.lanes} lanes: the prompt goes through the lanes' exchange in the decode kernel"
    if cfg["head_dim"] % 16:
        return f"head_dim {cfg['head_dim']} is not a multiple of 16 (the matrix units' tile)"
    if key_tile(cfg["head_dim"], target.smem_bytes) == 0:
        return f"head_dim {cfg['head_dim']}: no attention key tile fits {target.smem_bytes} bytes of shared memory"
    for s in sched.gemv_stages():
        if s.kind != "lm_head" and (s.gemv.cols % 8 or s.gemv.stride % 8):
            return f"{s.name} has {s.gemv.cols} columns (stride {s.gemv.stride}): not a multiple of 8"
    return None
