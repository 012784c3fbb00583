"""memplan: byte offsets of every weight, activation, cache line and counter.

Needs: a scheduled Schedule (tiles known).
Guarantees four regions, each a dict name -> (offset, bytes), 256-byte aligned:
- `weights`: the blob uploaded once. First the shared part (embedding, LM head, final
  norm, RoPE table), then one region per lane (`lane_stride` bytes apart) with, per
  layer, the norms (fp32), the packed Q/K/V matrix (Q and K rows of each head reordered
  so RoPE pairs are adjacent), its bias (fp32), O, the gate/up matrix interleaved by row
  (gate j, up j, ...) and down (its column halves stacked where it has `half_tiles`). Matrices are bf16/fp16 rows padded to `stride` elements,
  tiled (`Gemv.tiled`: groups of 8 rows, each group 32-column tiles of 8 x 32) where the
  schedule says so; the embedding stays rows (a step reads one), so a tied LM head gets a
  tiled copy of its own.
  `packing` says how each entry is built from the graph's weights (kiec.pack applies it).
- `acts`: fp32 activations, per lane (`lane_stride` apart) then shared (logits, ...); a debug build
  (`Grid.kv_store_late`) keeps each step's new K and V rows there (`kv_late`) until the step's end.
- `kv`: the KV cache per lane, [layer][kv head][position][head_dim], 16-bit.
- `sync`: counters and flags, each on its own 128-byte line; shared ones first. Each lane's part
  also holds `h_marked` and `act_marked`: the residual and the FFN activation, fp32 values whose
  lowest bit marks the write that stored them, which readers check instead of a fenced counter
  (where down takes its columns in halves, `h_part` too: the second half's sums, which every
  reader of the h down wrote adds);
  and attention's output (`attn`), its queries (`q`) and this step's K and V rows (`kv_new`, each
  16-bit value above its mark), marked too where the grid reads marks alone (`marks_only`).
With several lanes, each lane also has an `inbox` (acts) of `exchange_slots` x 2 sublayers x
lanes x D floats where its peers store their partials, and one line of per-sender flags per
(slot, sublayer, tile) (`peer_flags`, sync). Exchange g (step x layers + layer) uses slot
g % exchange_slots: 2 for exact TP, 2d + 2 with past(d), so a slot is rewritten only after
every lane has read it (a lane reads exchange g at the latest d layers later).
Across GPUs (one lane per device) each device holds the shared parts and one lane's: the
`acts`, `kv` and `sync` totals are one device's, the weight blob is packed whole (`__total`)
and each device takes the shared part plus its lane's region (`__device_total` bytes). A
device also keeps `h_mirror` (acts, [lane][D]) and one `h_mirror` line per lane (sync):
every lane's last residual, which the LM head's vocabulary slice on each device reads.
The plan is plain data: the kernel's constants and the host's uploads both come from it.
"""
from __future__ import annotations

import dataclasses

from ..errors import KiecError
from ..ir.schedule import Schedule

ALIGN = 256
LINE = 128


class _Region:
    def __init__(self, align: int = ALIGN):
        self.entries, self.size, self.align = {}, 0, align

    def add(self, name: str, nbytes: int) -> int:
        offset = self.size
        self.entries[name] = (offset, int(nbytes))
        self.size = -(-(offset + int(nbytes)) // self.align) * self.align
        return offset


def memplan(sched: Schedule, cfg, max_seq_len: int, dtype: str = "bf16") -> Schedule:
    lanes = sched.lanes
    here = sched.grid.lanes_per_device          # lanes whose buffers one device holds
    esize = 2
    hd = cfg.head_dim
    d_embed = -(-cfg.hidden // 8) * 8
    packing: list = []

    # --- weights: shared part ---
    shared = _Region()
    shared.add("embed", cfg.vocab * d_embed * esize)
    packing.append(dict(name="embed", kind="matrix", sources=["embed"], rows=cfg.vocab, stride=d_embed, lane=None))
    stages = list(sched.stages)
    lm = next(s for s in stages if s.kind == "lm_head")
    if lm.gemv.stride == d_embed and cfg.tie_embeddings and not lm.gemv.tiled:
        lm_offset = shared.entries["embed"][0]        # tied and the same padding: one copy serves both
    else:
        lm_offset = shared.add("lm_head", lm.gemv.bytes)
        packing.append(dict(name="lm_head", kind="matrix", sources=list(lm.attr("weights")), rows=lm.gemv.rows,
                            stride=lm.gemv.stride, lane=None, tiled=lm.gemv.tiled))
    stages[lm.index] = dataclasses.replace(lm, gemv=dataclasses.replace(lm.gemv, offset=lm_offset))
    norm_bytes = 4 * cfg.hidden * (lanes if lm.attr("per_lane_norm") else 1)
    shared.add("final_norm", norm_bytes)
    packing.append(dict(name="final_norm", kind="fp32", sources=[lm.attr("norm")], lane=None))
    shared.add("rope", max_seq_len * (hd // 2) * 2 * 4)
    packing.append(dict(name="rope", kind="rope", sources=[], lane=None))

    # --- weights: one region per lane ---
    lane = _Region()
    for s in stages:
        p = f"layers.{s.layer}."
        if s.kind in ("qkv", "gate_up"):
            norm_name = p + ("attn_norm" if s.kind == "qkv" else "ffn_norm")
            lane.add(norm_name, 4 * cfg.hidden)
            packing.append(dict(name=norm_name, kind="fp32_lane", sources=[s.attr("norm")], lane=True))
        if s.gemv is None or s.kind == "lm_head":
            continue
        name = p + s.kind
        offset = lane.add(name, s.gemv.bytes)
        stages[s.index] = dataclasses.replace(s, gemv=dataclasses.replace(s.gemv, offset=offset))
        kind = {"qkv": "qkv", "gate_up": "interleave"}.get(s.kind, "halves" if s.attr("half_tiles") else "matrix")
        packing.append(dict(name=name, kind=kind, sources=list(s.attr("weights")), rows=s.gemv.rows,
                            stride=s.gemv.stride, lane=True, head_dim=hd, pairs=s.attr("pairs"),
                            tiled=s.gemv.tiled))
        if s.kind == "qkv" and s.attr("bias"):
            lane.add(p + "qkv_bias", 4 * s.gemv.rows)
            packing.append(dict(name=p + "qkv_bias", kind="qkv_bias", sources=list(s.attr("biases")),
                                rows=s.gemv.rows, lane=True, head_dim=hd, pairs=s.attr("pairs")))
    weights = {name: entry for name, entry in shared.entries.items()}
    lanes_base = shared.size
    for name, (offset, nbytes) in lane.entries.items():
        weights["lane." + name] = (offset, nbytes)
    weights["__lanes_base"] = (lanes_base, 0)
    weights["__lane_stride"] = (lane.size, 0)
    weights["__total"] = (lanes_base + lanes * lane.size, 0)
    weights["__device_total"] = (lanes_base + here * lane.size, 0)
    # lane-relative gemv offsets become absolute for lane 0
    for i, s in enumerate(stages):
        if s.gemv is not None and s.kind != "lm_head":
            stages[i] = dataclasses.replace(s, gemv=dataclasses.replace(s.gemv, offset=lanes_base + s.gemv.offset))

    # --- activations (fp32) ---
    att = next(s for s in stages if s.kind == "attention")
    group = att.attr("heads") // att.attr("kv_heads")
    lane_acts = _Region()
    # a split's partial of a query head: o, m and l, padded to 16-byte rows (stage_attention.j2's PART_ROW)
    lane_acts.add("attn_partial", 4 * att.attr("kv_heads") * att.attr("splits") * group * (hd + 4))
    if sched.grid.kv_store_late:        # a debug build's new K and V rows of every layer, 16-bit, until the step's end
        lane_acts.add("kv_late", 2 * cfg.layers * 2 * att.attr("kv_heads") * hd)
    residual = [s for s in stages if s.kind in ("attn_out", "down")]
    if lanes > LINE // 4:
        raise KiecError("lanes", lanes, f"at most {LINE // 4} (one {LINE}-byte line holds a tile's peer flags)")
    slots = exchange_slots(residual) if lanes > 1 else 0
    exchange_tiles = max(s.tiles for s in residual)       # attn_out and down: D rows, the same tiling
    if slots:
        lane_acts.add("inbox", 4 * slots * 2 * lanes * cfg.hidden)
    shared_acts = _Region()
    shared_acts.add("logits", 4 * cfg.vocab)
    shared_acts.add("lm_best", 8 * stages[lm.index].tiles)
    if sched.grid.devices > 1:
        shared_acts.add("h_mirror", 4 * lanes * cfg.hidden)
    acts = {"lane." + k: v for k, v in lane_acts.entries.items()}
    acts["__lane_stride"] = (lane_acts.size, 0)
    base = here * lane_acts.size
    acts.update({k: (base + o, n) for k, (o, n) in shared_acts.entries.items()})
    acts["__total"] = (base + shared_acts.size, 0)

    # --- KV cache (16-bit) ---
    per_layer = att.attr("kv_heads") * max_seq_len * hd * esize
    kv = {"k": (0, cfg.layers * per_layer), "v": (cfg.layers * per_layer, cfg.layers * per_layer),
          "__layer_stride": (per_layer, 0), "__lane_stride": (2 * cfg.layers * per_layer, 0),
          "__total": (here * 2 * cfg.layers * per_layer, 0)}

    # --- counters and flags, one 128-byte line each ---
    sync = _Region(align=LINE)
    for name in ("abort", "error", "select", "lm_ticket"):
        sync.add(name, LINE)
    if sched.grid.devices > 1:
        sync.add("h_mirror", LINE * lanes)
    lane_sync = _Region(align=LINE)
    # the residual h and the FFN activation, fp32 values whose lowest bit marks their write: readers check
    # the mark, so these live where the counters do and are cleared with them (a cleared value never passes)
    lane_sync.add("h_marked", 4 * cfg.hidden)
    lane_sync.add("act_marked", 4 * max(s.attr("ffn") for s in stages if s.kind == "gate_up"))
    if any(s.attr("half_tiles") for s in stages):       # down's second column half, marked: h's readers add it
        lane_sync.add("h_part", 4 * cfg.hidden)
    lane_sync.add("attn", 4 * att.attr("heads") * hd)
    lane_sync.add("q", 4 * att.attr("heads") * hd)
    lane_sync.add("kv_new", 4 * 2 * att.attr("kv_heads") * hd)      # this step's K and V rows, 16 bits above the mark
    for s in stages:
        if s.kind not in ("qkv", "lm_head"):     # qkv signals per KV group; the LM head selects
            lane_sync.add(f"done.{s.index}", LINE)
        if s.kind == "qkv":
            for j in range(stages[s.index + 1].attr("kv_heads")):
                lane_sync.add(f"group.{s.index}.{j}", LINE)
        if s.kind == "attention":
            for j in range(s.attr("kv_heads")):
                lane_sync.add(f"ticket.{s.index}.{j}", LINE)
    if slots:
        lane_sync.add("peer_flags", LINE * slots * 2 * exchange_tiles)   # [slot][sublayer][tile]
    # a by-head split's partial (o, m, l) of each query head, marked; last, so that nothing else moves
    if att.attr("by_head_splits", 1) > 1:
        lane_sync.add("attn_part", 4 * att.attr("by_head_splits") * att.attr("heads") * (hd + 4))
    sync_map = dict(sync.entries)
    sync_map.update({"lane." + k: (sync.size + o, n) for k, (o, n) in lane_sync.entries.items()})
    sync_map["__lane_stride"] = (lane_sync.size, 0)
    sync_map["__total"] = (sync.size + here * lane_sync.size, 0)

    memory = {"weights": weights, "acts": acts, "kv": kv, "sync": sync_map}
    config = dict(sched.config, max_seq_len=max_seq_len, dtype=dtype, exchange_slots=slots,
                  exchange_tiles=exchange_tiles)
    return dataclasses.replace(sched, stages=stages, memory=memory, packing=packing, config=config)


def exchange_slots(residual_stages: list) -> int:
    """Slots of the lanes' exchange ring: 2 for exact TP, 2d + 2 when some reduce is past(d)."""
    delay = max((s.attr("delay") for s in residual_stages if s.attr("mode") == "past"), default=0)
    return 2 * delay + 2
