"""ir.Schedule: the fused stages of one decode step, placed on a persistent grid.

A stage is a group of graph ops the kernel runs as one unit of work with one
dependency point. Most stages stream a weight matrix (a GEMV): the block's tiles are
row ranges of it, cut into `units` (a segment of a row, at most SEG_MAX elements) that
travel through a ring of shared-memory slots. STAGE_KINDS is the one table of stage
kinds: codegen emits the C++ enum from it, so the numbers never drift.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

# kind -> what the stage computes (the C++ side switches on the index)
STAGE_KINDS = {
    "qkv": "rms_norm(h) . [Wq; Wk; Wv] (+bias), RoPE on q and k, k and v appended to the KV cache",
    "attention": "decode attention of each KV head's query group over the cache, split along the sequence",
    "attn_out": "attention output . Wo, lane reduce, residual add",
    "gate_up": "rms_norm(h) . [Wgate; Wup] interleaved by rows, silu(gate) * up",
    "down": "act . Wdown, lane reduce, residual add",
    "lm_head": "final rms_norm (mean over lanes) . Wlm_head, per-tile best, the last tile selects the token",
}
STAGE_OPCODES = {name: i for i, name in enumerate(STAGE_KINDS)}

SEG_MAX = 1024        # elements of one unit: a row segment one warp reduces in one go
TILE_ROWS, TILE_COLS = 8, 32   # a tiled matrix's unit: rows x columns, row-major
TILE_BYTES = TILE_ROWS * TILE_COLS * 2
# the probe timing_only=6: a weight copy brings this share of its chunk (kernel.hip.j2's hbm_share), and
# the schedule counts the copies in flight for a card that much faster (an H100 at an H200's read)
HBM_SHARE = (2, 3)


@dataclass(frozen=True)
class Gemv:
    """The weight matrix a stage streams, as memplan packed it (per lane)."""
    rows: int               # packed rows
    cols: int               # logical input width
    segments: int           # a row is `segments` units of `seg_width` elements (tiled: one of `stride`)
    seg_width: int
    offset: int = 0         # byte offset of lane 0's packed matrix in the weight blob
    rows_per_tile: int = 0  # set by schedule
    pass_rows: int = 0      # set by schedule: the rows whose partial sums the scratch holds at once (a tile's, or fewer)
    tiled: bool = False     # groups of TILE_ROWS rows stored as TILE_ROWS x TILE_COLS tiles (kiec.pack)

    @property
    def stride(self) -> int:
        return self.segments * self.seg_width

    @property
    def unit_bytes(self) -> int:
        return TILE_BYTES if self.tiled else self.seg_width * 2

    @property
    def packed_rows(self) -> int:
        """Rows in the blob: a tiled matrix's last group is padded with zero rows."""
        return -(-self.rows // TILE_ROWS) * TILE_ROWS if self.tiled else self.rows

    @property
    def bytes(self) -> int:
        return self.packed_rows * self.stride * 2


def gemv_shape(rows: int, cols: int, max_segments: int = 8) -> Gemv:
    """Rows cut into a power-of-two number of segments (at most max_segments, each about SEG_MAX
    wide, a multiple of 8 elements): with 8 consumer warps, each warp then keeps one segment."""
    segments = 1
    while segments * SEG_MAX < cols and segments < max_segments:
        segments *= 2
    seg_width = -(-cols // segments)
    seg_width = -(-seg_width // 8) * 8          # 16-byte units
    return Gemv(rows=rows, cols=cols, segments=segments, seg_width=seg_width)


def gemv_tiled(rows: int, cols: int, warps: int) -> Gemv:
    """Rows of whole TILE_COLS-wide tiles, at least one tile per consumer warp (zero columns past
    cols): a warp's step of `warps` tiles then crosses at most one row's end."""
    stride = max(warps * TILE_COLS, -(-cols // TILE_COLS) * TILE_COLS)
    return Gemv(rows=rows, cols=cols, segments=1, seg_width=stride, tiled=True)


@dataclass(frozen=True)
class Stage:
    index: int
    kind: str
    layer: int | None
    ops: tuple                      # indices into graph.ops
    gemv: Gemv | None = None
    tiles: int = 0                  # per lane
    attrs: tuple = ()               # sorted (key, value) pairs, kind-specific

    def attr(self, key, default=None):
        return dict(self.attrs).get(key, default)

    @property
    def opcode(self) -> int:
        return STAGE_OPCODES[self.kind]

    @property
    def name(self) -> str:
        return f"{self.kind}" + (f"[layer {self.layer}]" if self.layer is not None else "")


@dataclass(frozen=True)
class Grid:
    blocks: int                     # persistent blocks of every device together (one per multiprocessor)
    lanes: int
    consumer_warps: int
    warp_size: int
    slot_bytes: int
    slots: int
    scratch_bytes: int
    devices: int = 1                # 1: every lane on one GPU; else one lane per GPU
    producer_warps: int = 1         # the producer's warps (a whole warpgroup where registers move by warpgroup)
    reduce_batch: int = 8           # a warp's dot products reduced together
    warp_release: bool = False      # one arrive per consumer warp frees a slot (else one per thread)
    timing_only: int = 0            # 1: no weight copies, 2: no consumer arithmetic, 3: no attention scoring,
                                    # 4: attention off the path, 5: a by-head attention tile on half its keys (outputs wrong)
    slot_groups: int = 1            # consumer warp groups taking turns at the ring's slots (tiled matrices)
    tile_accumulators: int = 2      # independent accumulators a warp's tile products go round (tiled matrices)
    slot_pairs: bool = False        # a consumer warp takes two full slots in one go where both are in (tiled matrices)
    contiguous_units: bool = False  # a consumer warp takes a run of a slot's units, not every warps-th one (tiled matrices)
    steady_pairs: bool = False      # a tile's full pairs go round a loop of their own where rows are whole shares
    copies_in_flight: int = 0       # a block's weight copies in flight at most (0: as many as free slots)
    stream_copies_in_flight: int = 0  # the same while its consumers stream a gate_up or down tile
    producer_registers: int = 0     # registers a producer thread keeps once the roles split (0: no rebalancing)
    consumer_registers: int = 0     # registers a consumer thread takes then (0: no rebalancing)
    ring_evict_first: bool = False  # the ring's copies carry L2's evict-first hint
    producer_polls: bool = False    # the producer tests its ring barriers without try_wait's suspension
    marks_only: int = 0             # marked inputs read without their counter where a block's earlier tile allows: 1, or 2 with attention's
    kv_store_late: bool = False     # debug: the cache's copy of a step's new K and V rows is stored at the step's end

    @property
    def copies_summary(self) -> str:
        """The copy caps as the tools print them."""
        hops = f"{self.copies_in_flight or 'no cap on'} copies in flight"
        if self.stream_copies_in_flight == self.copies_in_flight:
            return hops
        return f"{hops}, {self.stream_copies_in_flight or 'no cap'} while streaming"

    @property
    def blocks_per_lane(self) -> int:
        return self.blocks // self.lanes

    @property
    def lanes_per_device(self) -> int:
        return self.lanes // self.devices

    @property
    def launch_blocks(self) -> int:
        """The blocks of one device's launch."""
        return self.blocks // self.devices

    @property
    def threads(self) -> int:
        return (self.consumer_warps + self.producer_warps) * self.warp_size


@dataclass
class Schedule:
    """Everything codegen needs: stages in order, the grid, and memplan's offsets."""
    model: str
    arch: str
    lanes: int
    stages: list
    grid: Grid | None = None
    config: dict = field(default_factory=dict)      # the ArchConfig facts templates use
    memory: dict = field(default_factory=dict)      # memplan: buffer -> (offset, bytes), per region
    packing: list = field(default_factory=list)     # memplan: how each weight lands in the blob
    prefill: dict | None = None                     # passes/prefill: the prompt path's plan, or None

    def gemv_stages(self):
        return [s for s in self.stages if s.gemv is not None]

    def dump(self) -> str:
        lines = [f"schedule {self.model} ({self.arch}) lanes={self.lanes} grid={self.grid}"]
        for s in self.stages:
            g = s.gemv
            cut = (f"tiles of {TILE_ROWS}x{TILE_COLS}, stride {g.stride}" if g.tiled else f"seg {g.segments}x{g.seg_width}"
                   ) if g else ""
            passes = f" (passes of {g.pass_rows})" if g and g.pass_rows < g.rows_per_tile else ""
            shape = (f" gemv {g.rows}x{g.cols} {cut} rows/tile {g.rows_per_tile}{passes}"
                     f" @ {g.offset}" if g else "")
            attrs = " ".join(f"{k}={v}" for k, v in s.attrs)
            lines.append(f"  {s.index:3d} {s.name:<22} tiles={s.tiles}{shape} {attrs}".rstrip())
        for region, buffers in self.memory.items():
            for name, (offset, size) in buffers.items():
                lines.append(f"  mem {region}.{name} @ {offset} ({size} bytes)")
        if self.prefill is not None:
            lines.append(f"  prefill chunk={self.prefill['chunk']} key_tile={self.prefill['key_tile']}")
        elif "prefill_off" in self.config:
            lines.append(f"  prefill off: {self.config['prefill_off']}")
        return "\n".join(lines) + "\n"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)
