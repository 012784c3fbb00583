"""Compile options: the schedule's knobs, validated once. They reach the build's cache key
through the sources they change (every knob ends up as a constant in the generated code)."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import KiecError, nearest


@dataclass(frozen=True)
class CompileOptions:
    consumer_warps: int | None = None   # consumer warps per block (None: the target's default)
    slot_bytes: int | None = None       # one weight-ring slot (None: the target's)
    max_slots: int | None = None        # at most this many ring slots (None: as many as shared memory holds)
    prefill_chunk: int | None = None    # prompt tokens one prefill pass takes (None: 2048, or max_seq_len)
    reduce_batch: int | None = None     # a warp's dot products reduced together (None: 8; 1: each alone)
    warp_release: int | None = None     # 1: one arrive per consumer warp frees a ring slot (None/0: one per thread)
    gemv_tiles: int | None = None       # 1: decode GEMVs on the matrix units, 0: FMAs over rows (None: the target's, for bf16)
    slot_groups: int | None = None      # consumer warp groups taking turns at the ring's slots (None: 1; tiled only)
    tile_accumulators: int | None = None  # accumulators a warp's tile products go round (None: 2; tiled only)
    contiguous_units: int | None = None  # 1: a consumer warp takes a run of units of a slot, not every warps-th one (None: where a row of tiles is not whole slots, tiled, one slot group)
    slot_pairs: int | None = None       # 1: a warp takes two full slots in one go where both are in (None: where it can; 0: one at a time)
    steady_pairs: int | None = None     # 1: a tile's full pairs go round a loop of their own where rows are whole shares (None: where slot pairs are on, one device)
    copies_in_flight: int | None = None  # a block's weight copies in flight in the layers at most (None: the target's; 0: no cap)
    stream_copies_in_flight: int | None = None  # the same while the block's consumers stream a gate_up or down tile (None: twice copies_in_flight where that is 2, else the same; 0: no cap)
    lm_head_passes: int | None = None   # 1: the LM head's tile in one pass (None: in as few passes as give the ring another slot where the matrices are tiled)
    producer_registers: int | None = None  # registers a producer thread keeps, the consumers taking the rest (None: the target's)
    ring_evict_first: int | None = None  # 1: the ring's copies carry L2's evict-first hint, 0: the normal policy (None: the target's)
    producer_polls: int | None = None   # 1: the producer tests its ring barriers without try_wait's suspension (None: 0)
    kv_in_flight: int | None = None     # K and V rows an attention lane has in flight: 1, 2, 4 or 8, 2 and up with the next batch's prefetched (None: by query group)
    split_batches: int | None = None    # at least this many key batches an attention split takes (None: 4 where a batch is one pass over the keys, else 1)
    heads_per_pass: int | None = None   # at most this many query heads an attention pass over the keys scores, 1-8 (None: 4)
    attention_by_head: int | None = None  # N: a context of up to N keys is scored a query head a tile, whole, no combine (None: 512 where it can, without lanes; 0: never)
    by_head_splits: int | None = None   # a by-head attention tile's context in this many splits over as many blocks, attn_out combining their marked partials (None/1: whole)
    by_head_rows: int | None = None     # K and V rows a lane loads per batch in a by-head attention tile: 1, 2, 4 or 8 (None: 4 where the consumers take the producer's registers and no kv_in_flight is given, else the other tiles' rows)
    combine_in_attn_out: int | None = None  # 1: attn_out's prologue combines attention's splits (no last-split combine; None/0: the last split does)
    down_halves: int | None = None      # 1: down's columns in two halves, each a tile's whole input, the second half's sums kept apart for h's readers to add (None: where it makes the largest tile smaller, one lane, tiled; 0: never)
    marks_only: int | None = None       # 1: a stage reads its marked input (h, the FFN activation, attention's output) without its counter where this block's earlier tile read the write before; 2: attention's inputs too, and qkv has no fence (None: the target's on one lane, 0 with lanes; 0: counter, then marks)
    # debug: 1 stores the cache's copy of each step's K and V rows only at the step's end (with marks_only 2),
    # so that with the cache poisoned a read of this step's row from the cache, not its marked copy, is NaN
    kv_store_late: int | None = None
    # timing only, the outputs are wrong: 1 leaves the weight copies out (the consumers' own pace),
    # 2 leaves the consumers' arithmetic out (the stream and the handshakes alone), 3 leaves attention's
    # scoring out (its keys and values still load), 4 takes attention off the path (attn_out waits for
    # qkv), 5 has a by-head attention tile score the first half of its keys only (half its bytes), 6 has
    # each weight copy bring two thirds of its chunk (an H100 then reads the weights at an H200's pace)
    timing_only: int | None = None

    def __post_init__(self):
        if self.consumer_warps is not None and self.consumer_warps not in (4, 8, 16):
            raise KiecError("consumer_warps", self.consumer_warps, "4, 8 or 16")
        if self.slot_bytes is not None and (self.slot_bytes < 4096 or self.slot_bytes % 1024):
            raise KiecError("slot_bytes", self.slot_bytes, "a multiple of 1024, at least 4096")
        if self.max_slots is not None and self.max_slots < 2:
            raise KiecError("max_slots", self.max_slots, "at least 2")
        if self.prefill_chunk is not None and (self.prefill_chunk < 64 or self.prefill_chunk % 64):
            raise KiecError("prefill_chunk", self.prefill_chunk, "a multiple of 64, at least 64")
        if self.reduce_batch is not None and self.reduce_batch not in (1, 2, 4, 8, 16):
            raise KiecError("reduce_batch", self.reduce_batch, "1, 2, 4, 8 or 16")
        if self.warp_release not in (None, 0, 1):
            raise KiecError("warp_release", self.warp_release, "0 or 1")
        if self.gemv_tiles not in (None, 0, 1):
            raise KiecError("gemv_tiles", self.gemv_tiles, "0 (FMAs over rows) or 1 (the matrix units)")
        if self.slot_groups is not None and self.slot_groups not in (1, 2):
            raise KiecError("slot_groups", self.slot_groups, "1 or 2")
        if self.tile_accumulators is not None and self.tile_accumulators not in (1, 2, 4):
            raise KiecError("tile_accumulators", self.tile_accumulators, "1, 2 or 4")
        if self.contiguous_units not in (None, 0, 1):
            raise KiecError("contiguous_units", self.contiguous_units, "0 (a warp takes every warps-th unit of a slot) or 1 (a run of them)")
        if self.steady_pairs not in (None, 0, 1):
            raise KiecError("steady_pairs", self.steady_pairs, "0 (one loop for every slot) or 1 (full pairs in a loop of their own)")
        if self.slot_pairs not in (None, 0, 1):
            raise KiecError("slot_pairs", self.slot_pairs, "0 (a slot at a time) or 1 (two full slots in one go)")
        if self.copies_in_flight is not None and not 0 <= self.copies_in_flight <= 64:
            raise KiecError("copies_in_flight", self.copies_in_flight, "0 (no cap) to 64 weight copies a block has in flight")
        if self.stream_copies_in_flight is not None and not 0 <= self.stream_copies_in_flight <= 64:
            raise KiecError("stream_copies_in_flight", self.stream_copies_in_flight,
                            "0 (no cap) to 64 weight copies a block has in flight while its consumers stream gate_up or down")
        if self.lm_head_passes not in (None, 1):
            raise KiecError("lm_head_passes", self.lm_head_passes, "1 (the LM head's tile in one pass) or unset")
        if self.producer_registers is not None and not (24 <= self.producer_registers <= 128 and self.producer_registers % 8 == 0):
            raise KiecError("producer_registers", self.producer_registers, "a multiple of 8 from 24 to 128")
        if self.ring_evict_first not in (None, 0, 1):
            raise KiecError("ring_evict_first", self.ring_evict_first, "0 (the normal L2 policy) or 1 (evict first)")
        if self.producer_polls not in (None, 0, 1):
            raise KiecError("producer_polls", self.producer_polls, "0 (try_wait, which may suspend) or 1 (test_wait, at once)")
        if self.kv_in_flight not in (None, 1, 2, 4, 8):
            raise KiecError("kv_in_flight", self.kv_in_flight, "1, 2, 4 or 8 K and V rows a lane has in flight")
        if self.split_batches is not None and not 1 <= self.split_batches <= 64:
            raise KiecError("split_batches", self.split_batches, "1 to 64 key batches an attention split takes at least")
        if self.heads_per_pass is not None and not 1 <= self.heads_per_pass <= 8:
            raise KiecError("heads_per_pass", self.heads_per_pass, "1 to 8 query heads a pass over the keys scores")
        if self.by_head_rows not in (None, 1, 2, 4, 8):
            raise KiecError("by_head_rows", self.by_head_rows, "1, 2, 4 or 8 K and V rows a lane of a by-head attention tile loads per batch")
        if self.by_head_splits is not None and not 1 <= self.by_head_splits <= 16:
            raise KiecError("by_head_splits", self.by_head_splits, "1 to 16 splits of a by-head attention tile's context")
        if self.attention_by_head is not None and not 0 <= self.attention_by_head <= 65536:
            raise KiecError("attention_by_head", self.attention_by_head, "0 to 65536 keys a query head's tile scores at most")
        if self.combine_in_attn_out not in (None, 0, 1):
            raise KiecError("combine_in_attn_out", self.combine_in_attn_out, "0 (the last split combines) or 1 (attn_out does)")
        if self.down_halves not in (None, 0, 1):
            raise KiecError("down_halves", self.down_halves, "0 (down's rows take every column) or 1 (two column halves)")
        if self.marks_only not in (None, 0, 1, 2):
            raise KiecError("marks_only", self.marks_only, "0 (wait for the counter, then the marks), 1 (the marks alone "
                            "where safe) or 2 (attention's inputs marked too)")
        if self.kv_store_late not in (None, 0, 1):
            raise KiecError("kv_store_late", self.kv_store_late, "0 or 1 (a debug build: the cache's new rows stored at the step's end)")
        if self.timing_only not in (None, 0, 1, 2, 3, 4, 5, 6):
            raise KiecError("timing_only", self.timing_only, "0, 1 (no weight copies), 2 (no arithmetic), 3 "
                            "(attention's keys loaded, not scored), 4 (attention off the path: attn_out waits "
                            "for qkv and reads no attention output), 5 (a by-head attention tile scores half "
                            "its keys) or 6 (a weight copy brings two thirds of its chunk: an H100 at an H200's "
                            "read)")

    def label(self) -> str:
        """'slot_bytes=32768' style: only the knobs that differ from the defaults."""
        return ",".join(f"{k}={v}" for k, v in self.__dict__.items() if v is not None) or "default"

    @staticmethod
    def parse(text: str) -> "CompileOptions":
        """'consumer_warps=8,slot_bytes=32768' -> CompileOptions."""
        return CompileOptions(**parse_integers(text, "option", CompileOptions.__dataclass_fields__))


def parse_integers(text: str, what: str, keys) -> dict:
    """'a=1,b=2' -> {'a': 1, 'b': 2}: each key one of `keys`, given once, with an integer value; errors
    name `what` (the option or flag) and the key."""
    fields = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in keys:
            raise KiecError(what, key, "one of " + ", ".join(keys), nearest(key, keys))
        if key in fields:
            raise KiecError(f"{what} {key}", text, f"{key} given once")
        try:
            fields[key] = int(value)
        except ValueError:
            raise KiecError(f"{what} {key}", value, "an integer") from None
    return fields
