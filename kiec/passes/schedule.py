"""schedule: place every stage's tiles on the persistent grid and size the weight ring.

Needs: fused stages (after `fuse`), the target, the device's multiprocessor count and
the devices the lanes run on (1, or one per lane).
Guarantees:
- the grid is one block per multiprocessor, split evenly over the lanes on one device,
  or every multiprocessor of each lane's own device (a lane's stages run on its own
  blocks; the LM head runs on the blocks of every lane, each taking a slice of the vocabulary);
- a GEMV stage's rows are cut into contiguous tiles of `rows_per_tile` rows (even
  where rows come in pairs: RoPE pairs, gate/up pairs; a multiple of TILE_ROWS where the
  matrices are tiled), at most one tile per block of the lane, so a stage finishes in one
  pass over the grid; a tiled `down` on one lane may take its columns in two halves
  (`down_halves`, where that makes the largest tile smaller): its matrix is then the halves
  stacked, 2 x hidden rows of intermediate / 2 columns, `half_tiles` tiles a half, no tile
  crossing from one half to the other;
- every GEMV matrix is tiled for the matrix units, or none is: the target's choice
  (`Target.gemv_tiles`) for bf16 weights, rows for fp16, unless `gemv_tiles` overrides it; tiles need a target that has
  them; a tiled row has at least one tile per consumer warp, and a slot whole tiles for each
  warp reading it; with `slot_groups` warp groups the ring has a multiple of that many slots;
  with one group and at most 4 tiles a warp in a slot, a warp takes two full slots in one go
  where both are in (`slot_pairs`, on by default there);
- an attention stage (head_dim a multiple of 8) has one tile per (KV head, split of positions), at
  most one tile per block of the lane: `splits` per KV head, at most (warps x head_dim - 1) / 2 so
  that the combine's weights fit where the warps' sums were. The split length is chosen per step from the
  context (`attention_splits`): whole batches (one pass of every consumer warp: warps x keys
  a warp reads at once x rows a lane loads), at least `min_split` keys (`split_batches` batches:
  a short context in one split needs no combine), as few splits as fill the lane's blocks, so a
  long context costs each block one tile and the combine reads at most `splits` partials; a pass
  over the keys scores `pass_heads` query heads, the group spread evenly over as few passes as
  `heads_per_pass` (4) allows; with `combine_in_attn_out` every split tile signals and attn_out's
  prologue combines them; a short context (up to `by_head_keys`) goes a query head a tile, each
  head's context in `by_head_splits` tiles (by default, where attention's output is marked, as
  many, at most 3, as keep those tiles within a third of the lane's blocks), whose partials attn_out
  combines;
- tile t of a stage runs on block (t + rotation) % blocks, the rotation carrying on
  from the previous stage, so small stages land on different blocks;
- shared memory holds the ring of weight slots plus one scratch area (input vector,
  partial sums, attention scratch) that fits the largest stage, the LM head's tile walked in passes
  of `pass_rows` rows where its partials alone would cost the ring a slot; where the partials go, a
  norm stage first stages its norm weights and the LM head one lane's h; a block keeps at most
  `copies_in_flight` weight copies in flight in the layers (a deeper queue at the memory system delays
  every activation and counter read behind it): as many as cover a block's share of the device's peak
  bandwidth (`block_bandwidth`) over the target's `copy_latency_ns`, at least 2 (the H100 2, the H200 3),
  or the target's count where the device is unknown; they carry
  L2's evict-first hint where the target has one (`ring_evict_first`);
- with `marks_only` (one lane: the target's, 2 on the H200; off with lanes), a stage reading marked values may skip
  its counter (codegen's `primed_by` names the earlier stage whose tile makes that safe in a block);
  at 2, attention's inputs are marked too and every block takes the LM head's ticket; a debug build
  (`kv_store_late`, level 2 only) stores the cache's copy of a step's new K and V rows at the step's end;
- where the target moves registers between warpgroups (setmaxnreg), the producer's keeps
  `producer_registers` a thread, at most what the launch gives, and the consumers take the rest
  of the launch's allocation, never fewer than the launch gave them (`consumer_registers`);
Dependencies are implied by stage order: a GEMV tile waits for every tile of the
stage before it (attn_out for each KV group's combined output, or every split tile when it
combines them itself); an attention tile only for the qkv tiles that cover its KV group. With
`marks_only`, a primed block reads the marked values instead of waiting (codegen's `primed_by`).
"""
from __future__ import annotations

import dataclasses

from ..errors import KiecError
from ..ir.schedule import HBM_SHARE, TILE_BYTES, TILE_COLS, TILE_ROWS, Grid, Schedule, Stage, gemv_shape, gemv_tiled
from ..options import CompileOptions
from ..targets import Target

BARRIER_BYTES = 1024     # mbarriers and block-local flags
REGISTER_FILE = 65536    # 32-bit registers of a multiprocessor; one block holds them all
MAX_THREAD_REGISTERS = 240   # what a consumer thread asks for at most
# accumulators a warp's tile products go round: 2 was 0.5-1.1% faster a step than 4 for both models on
# an H200 (a row group's flush adds half as many); 1 not yet timed on Llama-1B (PERF version 39)
TILE_ACCUMULATORS = 2


def _moved_registers(target: Target, warps: int, producer: int) -> tuple[int, int]:
    """(what the launch gives every thread, what a consumer thread takes once the producer's warpgroup
    keeps `producer`). The launch bounds split the register file over the block's threads in steps of
    8, and ptxas uses no more than the consumers ask for (4 consumer warps: 240 of the 256 allowed);
    setmaxnreg then moves registers only within that, in steps of 8."""
    threads = (warps + target.producer_warps) * target.warp_size
    launched = min(MAX_THREAD_REGISTERS, REGISTER_FILE // threads // 8 * 8)
    left = launched * threads - producer * target.producer_warps * target.warp_size
    return launched, min(MAX_THREAD_REGISTERS, left // (warps * target.warp_size) // 8 * 8)


def schedule(sched: Schedule, target: Target, multiprocessors: int | None = None, max_seq_len: int = 4096,
             options: CompileOptions = CompileOptions(), devices: int = 1, dtype: str = "bf16",
             block_bandwidth: float | None = None) -> Schedule:
    lanes = sched.lanes
    if devices not in (1, lanes):
        raise KiecError("gpus", devices, f"1 or the lane count ({lanes})")
    blocks = (multiprocessors or target.multiprocessors) * (lanes if devices > 1 else 1)
    blocks -= blocks % lanes
    if blocks < lanes:
        raise KiecError("lanes", lanes, f"at most the device's {blocks} multiprocessors")
    warps = options.consumer_warps or (8 if target.warp_size == 32 else 4)
    per_lane = blocks // lanes
    # tiles split x into two 16-bit halves: fp16's range (65504) would turn a large activation into inf,
    # so fp16 weights keep rows unless asked (bf16 has fp32's range)
    tiled = bool((target.gemv_tiles and dtype == "bf16") if options.gemv_tiles is None else options.gemv_tiles)
    if tiled and not target.gemv_tiles:
        raise KiecError("gemv_tiles", options.gemv_tiles, f"0 on {target.name} (its decode GEMVs have no tiled form)")
    slot_groups = options.slot_groups or 1
    if slot_groups > 1 and not tiled:
        raise KiecError("slot_groups", slot_groups, "1 where the matrices are not tiled (gemv_tiles=0 or the target)")
    if options.tile_accumulators and not tiled:
        raise KiecError("tile_accumulators", options.tile_accumulators,
                        "unset where the matrices are not tiled (gemv_tiles=0 or the target)")
    if warps % slot_groups:
        raise KiecError("slot_groups", slot_groups, f"a divisor of the {warps} consumer warps")
    if options.ring_evict_first and not target.ring_evict_first:
        raise KiecError("ring_evict_first", options.ring_evict_first, f"0 on {target.name}, whose producer copies with its own loads")
    # registers: the producer's warpgroup gives back all but `producer` a thread and the consumers take
    # them; setmaxnreg.dec never raises a count and .inc never lowers one
    if options.producer_registers and not target.producer_registers:
        raise KiecError("producer_registers", options.producer_registers, f"unset on {target.name}, whose warps keep their registers")
    producer_registers = options.producer_registers or target.producer_registers
    consumer_registers = 0
    if producer_registers:
        launched, consumer_registers = _moved_registers(target, warps, producer_registers)
        if producer_registers > launched or consumer_registers < launched:
            raise KiecError("producer_registers", producer_registers,
                            f"at most the {launched} a thread the launch gives with {warps} consumer warps, "
                            f"leaving the consumers at least as many")
    # a lane's residual sums its peers' partials through the inbox, whose flags are the lanes' only order
    if options.marks_only and lanes > 1:
        raise KiecError("marks_only", options.marks_only, f"0 with {lanes} lanes (marks alone are read on one lane)")
    marks_only = (target.marks_only if lanes == 1 else 0) if options.marks_only is None else options.marks_only
    stages = []
    for s in sched.stages:
        halves = _down_halves(s, per_lane, warps, tiled, lanes, options) if s.kind == "down" else None
        if halves is not None:
            rows_per_tile, half_tiles = halves
            cut = gemv_tiled(2 * s.gemv.rows, s.gemv.cols // 2, warps)
            gemv = dataclasses.replace(s.gemv, rows=cut.rows, cols=cut.cols, segments=cut.segments,
                                       seg_width=cut.seg_width, rows_per_tile=rows_per_tile, pass_rows=rows_per_tile,
                                       tiled=True)
            stages.append(dataclasses.replace(s, gemv=gemv, tiles=2 * half_tiles,
                                              attrs=tuple(sorted(dict(s.attrs, half_tiles=half_tiles).items()))))
        elif s.gemv is not None:
            row_multiple = TILE_ROWS if tiled else 2 if s.kind in ("qkv", "gate_up") else 1
            rows_per_tile = _rows_per_tile(s.gemv.rows, blocks if s.kind == "lm_head" else per_lane, row_multiple)
            tiles = -(-s.gemv.rows // rows_per_tile)
            cut = gemv_tiled(s.gemv.rows, s.gemv.cols, warps) if tiled else gemv_shape(s.gemv.rows, s.gemv.cols, warps)
            gemv = dataclasses.replace(s.gemv, segments=cut.segments, seg_width=cut.seg_width,
                                       rows_per_tile=rows_per_tile, pass_rows=rows_per_tile, tiled=tiled)
            stages.append(dataclasses.replace(s, gemv=gemv, tiles=tiles))
        elif s.kind == "attention":
            if s.attr("head_dim") % 8:
                raise KiecError("config.head_dim", s.attr("head_dim"),
                                "a multiple of 8 (attention loads a row's values 8 at a time, 16 bytes)")
            lanes_per_key = 1 << (max(1, s.attr("head_dim") // 8) - 1).bit_length()
            if lanes_per_key > target.warp_size:
                raise KiecError("config.head_dim", s.attr("head_dim"), f"at most {8 * target.warp_size} on {target.name}")
            # registers hold the rows in flight x 2 loads and group x 8 accumulators: fewer rows for
            # bigger groups; two rows or more are half this batch, half the next one (prefetch).
            # Where the consumers have taken the producer's registers (setmaxnreg: 232 instead of 168; 224,
            # with a producer keeping 56, compiled spill-free for Qwen-1.5B too), 4 rows fit any group
            # with no spills while a pass scores at most 4 query heads (Llama-1B at context 8,192: 1.008
            # -> 0.878 ms; Qwen-1.5B's group of 6: 1.297 -> 1.238). kv_in_flight overrides.
            group = s.attr("heads") // s.attr("kv_heads")
            roomy = consumer_registers >= 224
            in_flight = options.kv_in_flight or (4 if roomy or group <= 2 else 2 if group == 3 else 1)
            prefetch = in_flight > 1
            rows = in_flight // 2 if prefetch else 1
            # a by-head tile keeps one query head's 8 accumulators: where the consumers are roomy it loads 4
            # rows a lane per batch, so its first batch (loaded while the tile waits for qkv) holds twice the
            # keys. Timed on an H100 (Llama-1B, Qwen-1.5B, two calls): attention's stream 0.4-0.5 us shorter,
            # one launch a sequence 0.6-1.3% faster, 0.5-2.2% from position 400; one launch a step 0.2-1.0% slower.
            # A kv_in_flight given holds for these tiles too, unless by_head_rows is given as well (roomy
            # consumers without one prefetch, above).
            by_head_rows = options.by_head_rows or (4 if roomy and not options.kv_in_flight else rows)
            batch = warps * (target.warp_size // lanes_per_key) * rows
            # the combine keeps each split's weights, (2 splits + 1) a head, where the warps' output sums
            # were: at most (warps x head_dim - 1) / 2 splits (gfx942's 4 waves reach it at head_dim 64)
            room = min(per_lane // s.attr("kv_heads"), (warps * s.attr("head_dim") - 1) // 2)
            splits = max(1, min(room, -(-max_seq_len // batch)))
            # a pass over the keys scores up to heads_per_pass query heads (8 accumulators each); a bigger
            # group takes several passes, each loading the keys again, with the heads spread evenly
            passes = -(-group // (options.heads_per_pass or 4))
            # a context of up to 4 batches goes to one split where a batch is one pass: the split's output
            # is then the attention's, with no ticket and no combine (Llama-1B at position 200: 0.741 ->
            # 0.723 ms); Qwen-1.5B's two passes per batch lost with 2, 3 and 4 (1.157 -> 1.195 to 1.233)
            split_batches = options.split_batches or (4 if passes == 1 else 1)
            # a short context can go to a query head a tile, each over the whole context, where the lane
            # has a tile for each (its outputs are then complete: no ticket, no combine); attn_out
            # combining the splits itself has no such case, and a group of one has nothing to divide.
            # Up to 512 keys it is faster than splits and a combine for both shapes timed (8-step
            # launches from positions 128-512: Llama-1B 1.7-6.2% a step, Qwen-1.5B 3.9-8.2%); they break
            # even near 640 and 768 keys and lose beyond (Llama-1B at 1,000: +7%). Not by default with
            # lanes: beside their exchange, ptxas keeps one value in local memory (a 4-byte spill).
            by_head_fits = group > 1 and not options.combine_in_attn_out and room >= group
            if options.attention_by_head and not by_head_fits:
                raise KiecError("attention_by_head", options.attention_by_head,
                                f"0 where attn_out combines the splits, a KV head has room for fewer than its "
                                f"{group} query heads' tiles ({room}) or a group has one head")
            by_head_keys = (options.attention_by_head if options.attention_by_head is not None
                            else 512 * (by_head_fits and lanes == 1))
            # a KV head keeps a tile for each query head even where the context needs fewer splits: a
            # model compiled for 160 positions (the bench's Qwen-1.5B row) had 5 splits for a group of 6,
            # lost the by-head path and took 7% longer a step. Splits past the context stay unused.
            # by_head_splits cuts each query head's context in that many splits, a tile each, whose
            # marked partials attn_out's prologue combines: a KV head then keeps group x splits tiles.
            # By default, where attention's output is marked: as many splits (at most 3) as keep the
            # lane's by-head tiles within a third of its blocks. Fitted on the two shapes timed (an H100
            # at an H200's pace, timing_only=6): Qwen-1.5B's 12 heads take 3 of 132 blocks' worth (36),
            # its sequence at 128 3.6% faster; Llama-1B's 32 would take 64 with 2 splits, which left its
            # sequence as it was and its 64 steps to 8,192 2.3% slower, so it keeps 1.
            by_head_splits = options.by_head_splits or (
                max([1] + [n for n in (2, 3) if s.attr("heads") * n <= per_lane // 3 and group * n <= room])
                if by_head_keys and marks_only else 1)
            if by_head_splits > 1 and not (by_head_keys and group * by_head_splits <= room):
                raise KiecError("by_head_splits", by_head_splits,
                                f"1 where no context goes by head (attention_by_head {by_head_keys}), or at most "
                                f"{room // group} (a KV head's {room} tiles over its {group} query heads)")
            splits = max(splits, group * by_head_splits) if by_head_keys else splits
            attrs = dict(s.attrs, splits=splits, batch=batch, rows=rows, prefetch=prefetch, by_head_keys=by_head_keys,
                         by_head_rows=by_head_rows, by_head_splits=by_head_splits,
                         min_split=batch * split_batches,
                         pass_heads=-(-group // passes), combine_in_attn_out=bool(options.combine_in_attn_out))
            stages.append(dataclasses.replace(s, tiles=s.attr("kv_heads") * splits,
                                              attrs=tuple(sorted(attrs.items()))))
        else:
            raise KiecError("ir", s.kind, "a stage kind the scheduler knows")
    stages = _rotate(stages, per_lane, blocks)
    stages = _attention_waits(stages)
    slot_bytes = options.slot_bytes or target.slot_bytes

    def ring_slots(scratch: int) -> int:
        slots = (target.smem_bytes - scratch - BARRIER_BYTES) // slot_bytes
        slots = min(slots, options.max_slots or slots)
        # warp groups taking turns skip every other phase of a slot's barriers: with an even slot count a
        # slot always belongs to the same group, so no group waits on a phase two ahead of the one it saw
        return slots - slots % slot_groups

    if options.lm_head_passes is None and tiled:
        stages = _lm_head_passes(stages, warps, slot_bytes, ring_slots)
    scratch = max(_stage_scratch(stages, s, warps) for s in stages)
    slots = ring_slots(scratch)
    if slots < 2 and options.slot_bytes:
        fits = (target.smem_bytes - scratch - BARRIER_BYTES) // 2 // 1024 * 1024
        raise KiecError("slot_bytes", options.slot_bytes, f"at most {fits} (two slots beside this model's {scratch} "
                        f"bytes of scratch in {target.smem_bytes} bytes of shared memory on {target.name})")
    if slots < 2:
        widest = max(stages, key=lambda s: _stage_scratch(stages, s, warps))
        field = "intermediate_size" if widest.kind == "down" else "hidden_size"
        why = (f"its input is {widest.gemv.cols} wide (config.{field})" if widest.gemv is not None
               else "its query group's per-warp sums (config.head_dim, the heads per KV head)")
        raise KiecError("model", f"{scratch} bytes of scratch in {widest.name}", f"a model whose widest stage leaves "
                        f"room for two {slot_bytes}-byte weight slots in {target.smem_bytes} bytes of shared memory "
                        f"on {target.name}", why)
    for s in stages:
        if s.gemv is not None and s.gemv.unit_bytes > slot_bytes:
            raise KiecError("ir", s.name, f"units of at most {slot_bytes} bytes")
    if options.kv_store_late and marks_only < 2:
        raise KiecError("kv_store_late", options.kv_store_late,
                        f"0 where marks_only is {marks_only}{' (with lanes it is 0)' if lanes > 1 else ''}: only at "
                        f"2 does attention read this step's K and V rows from their marked copy, not the cache")
    group_warps = warps // slot_groups          # the warps reading one slot take its tiles in turn
    if tiled and (slot_bytes // TILE_BYTES) % group_warps:
        raise KiecError("slot_bytes", slot_bytes, f"a multiple of {TILE_BYTES * group_warps} bytes: whole tiles "
                        f"for each of the {group_warps} warps reading a slot (tiled matrices)")
    # two full slots taken in one go hold both slots' loads in registers at once: at most 4 tiles a warp each
    pairs_fit = tiled and slot_groups == 1 and slot_bytes // TILE_BYTES // group_warps <= 4
    if options.slot_pairs and not pairs_fit:
        raise KiecError("slot_pairs", options.slot_pairs, "0 where the matrices are not tiled, the warps read the slots "
                        f"in {slot_groups} groups or a slot holds more than 4 tiles a warp ({slot_bytes} bytes, "
                        f"{group_warps} warps)")
    pairs = pairs_fit if options.slot_pairs is None else bool(options.slot_pairs)
    if options.steady_pairs and not pairs:
        raise KiecError("steady_pairs", options.steady_pairs, "0 where slot pairs are off")
    # a full pair whose warps' shares each lie in one row group skips the general loop's tests (93
    # instructions a pair against 122). On an H200, where the consumers set the pace: one launch a
    # sequence 0.5-0.8% faster for both models over two calls; on an H100 within 0.5% either way. Timed
    # on one device only, and a kernel across devices has less room: a small laneformer at 4 GPUs spills
    # 8 bytes with it (none without), so there it stays asked-for.
    steady = (pairs and devices == 1) if options.steady_pairs is None else bool(options.steady_pairs)
    if options.contiguous_units and not (tiled and slot_groups == 1):
        raise KiecError("contiguous_units", options.contiguous_units, "0 where the matrices are not tiled or the warps read "
                        f"the slots in {slot_groups} groups")
    # a warp taking every warps-th unit of a slot crosses a row group wherever a row is not whole slots
    # (Qwen-1.5B's 48 tiles), and such a slot places each unit alone; a run of units stays in one group
    # wherever a row is whole runs. On an H100: Qwen-1.5B 1.9-2.6% a step, qkv's and attn_out's streams
    # 0.6 us shorter; Llama-1B, whose rows are whole slots, unchanged (and left as it was).
    slot_units = slot_bytes // TILE_BYTES
    crosses = any(s.gemv.stride // TILE_COLS % slot_units for s in stages if s.gemv is not None)
    contiguous = (tiled and slot_groups == 1 and crosses) if options.contiguous_units is None else bool(options.contiguous_units)
    # the probe timing_only=6 makes a card read its weights 1.5 times as fast (an H100 at an H200's pace),
    # so its copies are counted for that card
    if options.timing_only == 6 and block_bandwidth:
        block_bandwidth *= HBM_SHARE[1] / HBM_SHARE[0]
    copies = (_copies_in_flight(target, slot_bytes, block_bandwidth) if options.copies_in_flight is None
              else options.copies_in_flight)
    stream_copies = (_stream_copies_in_flight(copies) if options.stream_copies_in_flight is None
                     else options.stream_copies_in_flight)
    grid = Grid(blocks=blocks, lanes=lanes, consumer_warps=warps, warp_size=target.warp_size,
                slot_bytes=slot_bytes, slots=slots, scratch_bytes=scratch, devices=devices,
                producer_warps=target.producer_warps,
                reduce_batch=options.reduce_batch or 8, warp_release=bool(options.warp_release),
                timing_only=options.timing_only or 0, slot_groups=slot_groups,
                tile_accumulators=options.tile_accumulators or TILE_ACCUMULATORS,
                slot_pairs=pairs, steady_pairs=steady,
                contiguous_units=contiguous,
                copies_in_flight=min(copies, slots),
                stream_copies_in_flight=min(stream_copies, slots),
                producer_registers=producer_registers, consumer_registers=consumer_registers,
                ring_evict_first=target.ring_evict_first if options.ring_evict_first is None
                else bool(options.ring_evict_first),
                producer_polls=bool(options.producer_polls),
                marks_only=marks_only, kv_store_late=bool(options.kv_store_late))
    return dataclasses.replace(sched, stages=stages, grid=grid)


def _rows_per_tile(rows: int, blocks: int, multiple: int) -> int:
    """The rows a GEMV tile takes so that `blocks` tiles cover `rows`: a whole number of `multiple`."""
    per_block = -(-rows // blocks)
    return -(-per_block // multiple) * multiple


def _down_halves(s: Stage, per_lane: int, warps: int, tiled: bool, lanes: int, options: CompileOptions):
    """(rows per tile, tiles per half) where down's columns go in two halves, else None. Rows are cut
    into groups of TILE_ROWS, so a hidden size of few groups for the grid leaves some blocks without a
    down tile and the others with a group more than the mean (Qwen-1.5B: 192 groups on 132 blocks, 96
    tiles of 2 groups, 287 KB each against 208 KB a block). Halves make twice the groups at half the
    bytes (128 tiles of 3 half groups, 215 KB): where that makes the largest tile smaller (`down_halves`
    None), or where asked (1). The second half's sums go to their own buffer, which h's readers add."""
    g = s.gemv
    if options.down_halves == 0:
        return None
    rows_per_tile = _rows_per_tile(2 * g.rows, per_lane, TILE_ROWS)
    half_tiles = -(-g.rows // rows_per_tile)
    why = None
    if not tiled:
        why = "tiled matrices (gemv_tiles)"
    elif lanes > 1:
        why = "one lane (a lane's residual goes to its peers whole)"
    elif g.rows % TILE_ROWS or g.cols % (2 * TILE_COLS):
        why = f"a hidden size in groups of {TILE_ROWS} rows and an intermediate size in pairs of {TILE_COLS}-column tiles"
    elif 2 * half_tiles > per_lane:       # an odd block count can leave each half one tile too many
        why = f"two halves' tiles ({2 * half_tiles}) within the lane's {per_lane} blocks"
    if why and options.down_halves is None:
        return None
    if why:
        raise KiecError("down_halves", options.down_halves, f"0 here: halves need {why}")
    whole = _rows_per_tile(g.rows, per_lane, TILE_ROWS)
    smaller = rows_per_tile * gemv_tiled(g.rows, g.cols // 2, warps).stride < whole * gemv_tiled(g.rows, g.cols, warps).stride
    return (rows_per_tile, half_tiles) if smaller or options.down_halves else None


def _copies_in_flight(target: Target, slot_bytes: int, block_bandwidth: float | None) -> int:
    """A block's weight copies in flight at most. Little's law: enough slots to cover the block's share of
    the device's peak bandwidth over one loaded memory latency (`Target.copy_latency_ns`), at least 2; fewer
    keep the queue at the memory system short, so the hops' activation and counter reads wait behind less.
    Fitted on two cards: 2 on the H100 (3.35 TB/s, 1.6-3.8% faster than 3 in three calls), 3 on the H200
    (4.8 TB/s, where 2 starved HBM in version 14). Where the device is unknown, the target's count."""
    if not (target.copy_latency_ns and target.copies_in_flight and block_bandwidth):
        return target.copies_in_flight
    return max(2, round(block_bandwidth * target.copy_latency_ns * 1e-9 / slot_bytes))


def _stream_copies_in_flight(copies: int) -> int:
    """A block's copies in flight while its consumers stream gate_up or down, when no hop of theirs waits
    behind the queue: twice the layers' count where that is 2 (the H100: 4 made a step 1.3-1.9% faster for
    both models, 0.5% slower at 8,192), else the same count. On the H200 (3 in the layers) every build with
    a count of its own while streaming was slower a step (Llama-1B 14-15%, Qwen-1.5B 8-9%), whichever the
    two counts (3 and 4 or 6, 2 and 3, 4 and 3: docs/PERF.md, version 39), so there the consumers' hint is
    left out altogether."""
    return 2 * copies if copies <= 2 else copies


def attention_splits(lo: int, pos: int, splits: int, batch: int, min_length: int,
                     by_head_keys: int = 0, by_head_splits: int = 1) -> tuple[int, int]:
    """(split length, splits used) for the keys lo..pos: whole batches, at least `min_length` keys
    (a multiple of batch), at most `splits` of them; or, where the context has at most `by_head_keys`
    keys (scored a query head a tile), one split, or `by_head_splits` of equal length (the last shorter,
    those past the context empty and not counted). The kernel works the same numbers out at every step."""
    n = pos + 1 - lo
    if n <= by_head_keys:
        if by_head_splits == 1:
            return -(-n // batch) * batch, 1
        length = -(-n // by_head_splits)
        return length, -(-n // length)
    length = max(-(-(-(-n // splits)) // batch) * batch, min_length)
    return length, -(-n // length)


def _rotate(stages: list, per_lane: int, blocks: int) -> list:
    out, rotation = [], 0
    for s in stages:
        width = blocks if s.kind == "lm_head" else per_lane
        out.append(dataclasses.replace(s, attrs=tuple(sorted(dict(s.attrs, rotation=rotation % width).items()))))
        rotation += s.tiles
    return out


def qkv_group_rows(stage: Stage, group: int) -> list:
    """The packed row ranges of a qkv stage that KV group `group` reads: its query heads, its k and its v."""
    q_rows, kv_rows, hd = stage.attr("q_rows"), stage.attr("kv_rows"), stage.attr("head_dim")
    q_per_group = q_rows // (kv_rows // hd)
    return [(group * q_per_group, (group + 1) * q_per_group),
            (q_rows + group * hd, q_rows + (group + 1) * hd),
            (q_rows + kv_rows + group * hd, q_rows + kv_rows + (group + 1) * hd)]


def qkv_tiles_of_group(stage: Stage, group: int) -> list:
    """Indices of the qkv tiles whose rows a KV group reads."""
    rpt = stage.gemv.rows_per_tile
    tiles = set()
    for lo, hi in qkv_group_rows(stage, group):
        tiles.update(range(lo // rpt, (hi - 1) // rpt + 1))
    return sorted(tiles)


def _attention_waits(stages: list) -> list:
    """Each attention stage learns how many qkv tiles signal each of its KV groups."""
    out = []
    for s in stages:
        if s.kind == "attention":
            qkv = stages[s.index - 1]
            counts = tuple(len(qkv_tiles_of_group(qkv, j)) for j in range(s.attr("kv_heads")))
            s = dataclasses.replace(s, attrs=tuple(sorted(dict(s.attrs, group_signals=counts).items())))
        out.append(s)
    return out


def _lm_head_passes(stages: list, warps: int, slot_bytes: int, ring_slots) -> list:
    """The LM head's (tiled) tile in passes where its partial sums alone keep a slot out of the ring
    (`ring_slots`: the slots beside a scratch size, as the grid will count them): as few passes as
    give the ring one more slot, each pass ending on a slot's boundary; else its tile in one pass.
    Llama-1B's twelfth slot took 5.7-6.9 us off a step in two calls (PERF 20d)."""
    lm = next((s for s in stages if s.kind == "lm_head"), None)
    if lm is None:
        return stages
    others = max(_stage_scratch(stages, s, warps) for s in stages if s is not lm)
    slots = ring_slots(max(others, _stage_scratch(stages, lm, warps)))
    g = lm.gemv
    groups = -(-g.rows_per_tile // TILE_ROWS)
    for passes in range(2, groups + 1):
        pass_groups = -(-groups // passes)
        if pass_groups * (g.stride // TILE_COLS) * TILE_BYTES % slot_bytes:
            continue
        split = dataclasses.replace(lm, gemv=dataclasses.replace(g, pass_rows=pass_groups * TILE_ROWS))
        if ring_slots(max(others, _stage_scratch(stages, split, warps))) > slots:
            return [split if s is lm else s for s in stages]
    return stages


def _stage_scratch(stages: list, s: Stage, warps: int) -> int:
    return _scratch_bytes(s, warps, stages[s.index - 1] if s.kind == "attn_out" else None)


def _scratch_bytes(s: Stage, warps: int, attention: Stage | None = None) -> int:
    """Shared memory one stage's consumers need beside the ring (`attention`: the one before attn_out)."""
    if s.gemv is not None:
        g = s.gemv
        partials = g.pass_rows * (warps if g.tiled else g.segments)
        # the LM head's raw h of one lane, a norm stage's weights, or the weights of the attention splits
        # attn_out combines: staged where the partials go later
        if s.kind in ("lm_head", "qkv", "gate_up"):
            partials = max(partials, g.cols)
        if attention is not None and attention.attr("combine_in_attn_out"):
            partials = max(partials, (2 * attention.attr("splits") + 1) * attention.attr("heads"))
        tiles_x = 2 * g.stride * 2 if g.tiled else 0      # x as the matrix units take it: rounded, and the rest
        # x in fp32, except where a tiled attn_out or down writes only the tiled form (keeps_f32_x)
        f32_x = 0 if g.tiled and s.kind in ("attn_out", "down") else 4 * g.stride
        return f32_x + 4 * partials + tiles_x + 4 * 64
    group = s.attr("heads") // s.attr("kv_heads")
    hd = s.attr("head_dim")
    floats = group * hd + warps * group * hd + 2 * warps * group + 64
    return 4 * floats
