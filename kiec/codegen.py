"""codegen: Schedule + target table -> the source files of one model (Jinja2 templates).

Templates see only the Schedule (as plain numbers prepared here), the target table and a
few model constants. The result is a dict file name -> text: the portability header,
the kernel with its host C API, the C API header, and the pybind11 module.
"""
from __future__ import annotations

import math
from pathlib import Path

import jinja2

from . import __version__
from .errors import KiecError
from .ir.schedule import HBM_SHARE, STAGE_KINDS, TILE_COLS, TILE_ROWS, Schedule
from .targets import Target

TEMPLATES = Path(__file__).parent / "templates"
NONE = 0xFFFFFFFF
MODES = {"present": 0, "past": 1, "none": 2}


def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)


def trace_layout(sched: Schedule) -> tuple[dict, int]:
    """Float offset (lane 0) and per-lane size of each stage's trace, and the total floats."""
    cfg = sched.config
    offsets, total = {}, 0
    for s in sched.stages:
        if s.kind in ("qkv", "attention"):
            size, lanes = cfg["heads"] * cfg["head_dim"], sched.lanes
        elif s.kind in ("attn_out", "down"):       # down in column halves: h with the first, then the second
            size, lanes = cfg["hidden"] * (2 if s.attr("half_tiles") else 1), sched.lanes
        elif s.kind == "gate_up":
            size, lanes = s.gemv.rows // 2, sched.lanes
        else:
            size, lanes = cfg["vocab"], 1
        offsets[s.index] = (total, size, lanes)
        total += size * lanes
    return offsets, total


def senders(sched: Schedule) -> set:
    """Indices of the residual stages whose partial goes to the peers: every `present` reduce, and
    the (sublayer, layer) a later `past(d)` reduce reads (even when its own mode is `none`)."""
    if sched.lanes == 1:
        return set()
    residual = {(s.attr("sublayer"), s.layer): s for s in sched.stages if s.kind in ("attn_out", "down")}
    out = {s.index for s in residual.values() if s.attr("mode") == "present"}
    for (sub, layer), s in residual.items():
        if s.attr("mode") == "past":
            out.add(residual[(sub, layer - s.attr("delay"))].index)
    return out


def _stage_entry(sched: Schedule, s, trace: dict, send: bool) -> dict:
    w, sync = sched.memory["weights"], sched.memory["sync"]
    g = s.gemv
    flags = 0
    if s.attr("embed_input"):
        flags |= 1
    if s.attr("embed_residual"):
        flags |= 2
    if s.attr("per_lane_norm"):
        flags |= 4
    if s.attr("lane_sum"):
        flags |= 8
    if s.attr("bias"):
        flags |= 16
    if send:
        flags |= 32
    if sched.grid.devices > 1 and s.kind == "down" and s.layer == sched.config["layers"] - 1:
        flags |= 64          # the last residual: mirrored to every device for the LM head
    prev = sched.stages[s.index - 1] if s.index else None
    # every stage waits for all of the one before it, except attention (its KV group's qkv tiles)
    # and layer 0's qkv (the token); an attention stage signals once per KV group, or once per split
    # tile where attn_out combines the splits. A primed block (primed_by) reads marks instead of waiting.
    wait, wait_count = NONE, 0
    if prev is not None and s.kind != "attention":
        wait = sync[f"lane.done.{prev.index}"][0]
        combined = prev.kind == "attention" and not prev.attr("combine_in_attn_out")
        # a combined output signals once per KV group, or, where short contexts go by head, once per
        # query head (every path signals its group's heads), or once per query head's split where those
        # are split (by_head_splits)
        wait_count = (prev.attr("heads") * prev.attr("by_head_splits", 1) if prev.attr("by_head_keys")
                      else prev.attr("kv_heads")) if combined else prev.tiles
    norm = {"qkv": "attn_norm", "gate_up": "ffn_norm"}.get(s.kind)
    groups = tickets = 0
    if s.kind == "qkv":
        groups = sync[f"lane.group.{s.index}.0"][0]
    if s.kind == "attention":
        groups = sync[f"lane.group.{prev.index}.0"][0]
        tickets = sync[f"lane.ticket.{s.index}.0"][0]
    layer_prefix = f"lane.layers.{s.layer}."
    # StageDesc holds a norm's and a bias's lane-relative offsets in 32 bits (the matrices' in 64)
    for name in (norm, "qkv_bias" if s.attr("bias") else None):
        if name and w[layer_prefix + name][0] >= 1 << 32:
            raise KiecError("model", f"{w['__lane_stride'][0] / 2**30:.2f} GiB of weights a lane",
                            "at most 4 GiB a lane before its last layer's norm weights (the kernel addresses them "
                            "with 32-bit offsets)", "split it over more lanes (`lanes`)")
    return dict(
        index=s.index, kind=s.kind, layer=s.layer, comment=STAGE_KINDS[s.kind],
        kind_const="STAGE_" + s.kind.upper(), layer_value=s.layer if s.layer is not None else "NONE",
        tiles=s.tiles, rotation=s.attr("rotation", 0), w_offset=g.offset if g else 0,
        rows=g.rows if g else 0, cols=g.cols if g else 0, segments=g.segments if g else 0,
        seg_width=g.seg_width if g else 0, rows_per_tile=g.rows_per_tile if g else 0,
        norm_offset=w[layer_prefix + norm][0] if norm else 0,
        bias_offset=w[layer_prefix + "qkv_bias"][0] if s.attr("bias") else "NONE",
        eps=repr(float(s.attr("eps", 0.0))), flags=flags, mode=MODES[s.attr("mode", "present")],
        delay=s.attr("delay", 0), q_rows=s.attr("q_rows", 0), kv_rows=s.attr("kv_rows", 0), window=s.attr("window", 0),
        done=sync[f"lane.done.{s.index}"][0] if f"lane.done.{s.index}" in sync else "NONE",
        wait=wait if wait != NONE else "NONE", wait_count=wait_count, groups=groups, tickets=tickets,
        signals=0, trace=trace[s.index][0], primed=primed_by(sched, s))


def primed_by(sched: Schedule, s) -> int | str:
    """The stage whose tile, in a block that had one, lets stage s read its marked input without
    waiting for the counter (NONE: it waits). One mark bit tells a write from the one before it, so a
    read must not find the write before that: it cannot once the block has read (or follows, through
    what it read, a tile that read) the write in between at every value s reads. qkv(L) reads all of
    h as down(L - 1) left it, which is what attn_out(L) (attention's output and its residual rows),
    gate_up(L) and down(L) (the activation, its residual rows) each need seen; qkv(L) itself needs
    attn_out(L - 1)'s h seen, which gate_up(L - 1) read whole; at level 2, attention(L) needs q and the
    new K and V rows of layer L - 1 seen, which qkv(L) follows through h. Layer 0's qkv reads the
    embedding, so there it proves nothing: layer 0 is safe because every block begins a step by
    acquiring the last step's token, published after every block took the LM head's ticket, whose
    tiles each read the last layer's h whole (LM_TICKETS). Down's second column half (`h_part`, where
    down has `half_tiles`, marked once a layer) is read with the h down wrote, by qkv, attn_out's
    residual and the LM head (which waits for its counter). attn_out(L) is primed by qkv(L), which read
    it whole. qkv(L + 1)'s primer gate_up(L) never reads it, but gate_up(L) read attn_out(L)'s h whole,
    and attn_out(L) read h_part(L - 1) row by row before writing it; layer 1 is covered by the token's
    acquire, as layer 0 is (attn_out(0) adds onto the embedding). One lane only (`marks_only`); attn_out
    reads marks only where attention's own output is marked (not where it combines the splits, nor in the
    probe `timing_only=4`, where it reads none). With by-head splits (`by_head_splits`) their partials
    are written in every layer of a step that goes by head and attention's output in every layer of the
    others, so either's write before a step's first can be the last layer's of a step some steps back:
    its mark differs from layer 0's whatever the steps between where the layers are even, and attn_out
    reads primed only then."""
    if not sched.grid.marks_only or s.layer is None:
        return "NONE"
    index = {(t.kind, t.layer): t.index for t in sched.stages}
    if s.kind == "qkv":
        return index[("gate_up", s.layer - 1)] if s.layer > 0 else "NONE"     # layer 0 reads the embedding
    att = sched.stages[s.index - 1]
    if s.kind == "attn_out" and (att.attr("combine_in_attn_out") or sched.grid.timing_only == 4 or
                                 (att.attr("by_head_splits", 1) > 1 and sched.config["layers"] % 2)):
        return "NONE"
    if s.kind in ("attn_out", "gate_up", "down") or (s.kind == "attention" and sched.grid.marks_only >= 2):
        return index[("qkv", s.layer)]
    return "NONE"


def render(sched: Schedule, target: Target, module_name: str) -> dict:
    cfg = sched.config
    trace, trace_floats = trace_layout(sched)
    send = senders(sched)
    stages = [_stage_entry(sched, s, trace, s.index in send) for s in sched.stages]
    group_signals = []
    for entry, s in zip(stages, sched.stages):
        if s.kind == "attention":
            entry["signals"] = len(group_signals)
            group_signals.extend(s.attr("group_signals"))
    att = next(s for s in sched.stages if s.kind == "attention")
    # the kernel's attention constants are the first attention stage's: every other must agree where it
    # changes what attn_out counts (_stage_entry reads each stage's own)
    for name, key in (("attention_by_head", "by_head_keys"), ("by_head_splits", "by_head_splits")):
        if any(s.attr(key) != att.attr(key) for s in sched.stages if s.kind == "attention"):
            raise KiecError(name, att.attr(key), "the same in every layer")
    attention_marked = sched.grid.marks_only >= 1 and not att.attr("combine_in_attn_out")
    if att.attr("by_head_splits", 1) > 1 and not attention_marked:
        raise KiecError("by_head_splits", att.attr("by_head_splits"), "1 where attention's output is not marked (marks_only 0)")
    # x chunks one lane keeps in registers: enough for the widest segment, at most 4 (32 registers);
    # a stage with wider segments reads x from shared memory instead
    widest = max(s.gemv.seg_width for s in sched.gemv_stages())
    x_chunks = min(4, -(-widest // (8 * target.warp_size)))
    w, a, kv, sy = (sched.memory[k] for k in ("weights", "acts", "kv", "sync"))
    c = dict(hidden=cfg["hidden"], d_embed=-(-cfg["hidden"] // 8) * 8, head_dim=cfg["head_dim"],
             group=att.attr("heads") // att.attr("kv_heads"), kv_heads=att.attr("kv_heads"), heads=att.attr("heads"),
             vocab=cfg["vocab"], max_seq=cfg["max_seq_len"], layers=cfg["layers"], batch=att.attr("batch"),
             splits=att.attr("splits"), min_split=att.attr("min_split"), attention_rows=att.attr("rows"),
             attention_by_head_rows=att.attr("by_head_rows"), attention_prefetch=att.attr("prefetch"),
             attention_pass_heads=att.attr("pass_heads"), combine_in_attn_out=att.attr("combine_in_attn_out"),
             attention_by_head_keys=att.attr("by_head_keys", 0), attention_by_head_splits=att.attr("by_head_splits", 1),
             attention_marked=attention_marked,
             qkv_marked=sched.grid.marks_only >= 2, x_chunks=x_chunks, bf16=cfg["dtype"] == "bf16", sqrt_lanes=math.sqrt(sched.lanes),
             gemv_tiles=all(s.gemv.tiled for s in sched.gemv_stages()), tile_rows=TILE_ROWS, tile_cols=TILE_COLS, hbm_share=HBM_SHARE,
             lm_head_pass_rows=next(s.gemv.pass_rows for s in sched.stages if s.kind == "lm_head"),
             down_half_tiles=next(s.attr("half_tiles") or 0 for s in sched.stages if s.kind == "down"))
    m = dict(w_embed=w["embed"][0], w_final_norm=w["final_norm"][0], w_rope=w["rope"][0],
             w_lanes_base=w["__lanes_base"][0], w_lane_stride=w["__lane_stride"][0], w_total=w["__total"][0],
             w_device_total=w["__device_total"][0],
             a_h_mirror=a["h_mirror"][0] if "h_mirror" in a else 0,
             s_h_mirror=sy["h_mirror"][0] if "h_mirror" in sy else 0,
             s_q=sy["lane.q"][0], s_kv_new=sy["lane.kv_new"][0], s_attn=sy["lane.attn"][0],
             s_attn_part=sy["lane.attn_part"][0] if "lane.attn_part" in sy else 0,
             a_part=a["lane.attn_partial"][0], a_lane_stride=a["__lane_stride"][0], a_logits=a["logits"][0],
             a_kv_late=a["lane.kv_late"][0] if "lane.kv_late" in a else 0,
             a_lm_best=a["lm_best"][0], a_total=a["__total"][0],
             a_inbox=a["lane.inbox"][0] if "lane.inbox" in a else 0, exchange_slots=cfg["exchange_slots"], exchange_tiles=cfg["exchange_tiles"],
             s_peer_flags=sy["lane.peer_flags"][0] if "lane.peer_flags" in sy else 0,
             kv_k=kv["k"][0], kv_v=kv["v"][0], kv_layer_stride=kv["__layer_stride"][0],
             kv_lane_stride=kv["__lane_stride"][0], kv_total=kv["__total"][0],
             s_abort=sy["abort"][0], s_error=sy["error"][0], s_select=sy["select"][0], s_lm_ticket=sy["lm_ticket"][0],
             s_lane_stride=sy["__lane_stride"][0], s_total=sy["__total"][0],
             s_h_marked=sy["lane.h_marked"][0], s_act_marked=sy["lane.act_marked"][0],
             s_h_part=sy["lane.h_part"][0] if "lane.h_part" in sy else 0)
    context = dict(model=sched.model, version=__version__, target=target, grid=sched.grid, c=c, m=m,
                   stages=stages, stage_kinds=[(k, i) for i, k in enumerate(STAGE_KINDS)],
                   group_signals=group_signals or [0], trace_floats=trace_floats, module_name=module_name,
                   p=sched.prefill, prefill_off=cfg.get("prefill_off"))
    env = _env()
    return {
        "kiec_port.h": env.get_template("port.h.j2").render(target=target),
        "kiec_api.h": env.get_template("api.h.j2").render(**context),
        "kernel.hip": env.get_template("kernel.hip.j2").render(**context),
        "module.cpp": env.get_template("module.cpp.j2").render(**context),
    }
