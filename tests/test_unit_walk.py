"""The tiled GEMV's walk over a tile's slots, modelled warp by warp on the CPU.

A consumer warp takes WARP_UNITS of each 32-tile slot: units q, q + 8, ... (strided) or the q-th run of
them (`contiguous_units`). It places each product in a row group by the unit's column, writes a group's
partials when it moves past the group (zeros for a group it had no unit in), and takes two full slots in
one go where each lies in one row group for it (`slot_pairs`). This model follows stage_gemv_tiles.j2's
tiled_units (its short path and its per-unit path), pair_in_groups, tiled_pair and tiled_advance step
by step, and checks on many row widths (SmolLM2's 18 tiles, Qwen-1.5B's 48 and 140, Llama-1B's 64 and
256) that every unit is multiplied once, by the x of its own column, into its own row group, and that
each warp writes each group's partials exactly once, in order. The GPU tests check the same bits on
the shapes they build; this covers the widths they do not.
"""
from __future__ import annotations

import pytest

WARPS, WARP_UNITS = 8, 4
SLOT_UNITS = WARPS * WARP_UNITS


class Warp:
    def __init__(self, q: int, row_tiles: int, contiguous: bool):
        self.first = q * WARP_UNITS if contiguous else q       # warp_first_unit
        self.step = 1 if contiguous else WARPS                 # UNIT_STEP
        self.row_tiles = row_tiles
        self.group = self.group_start = 0
        self.products: list = []      # (unit, group, column)
        self.flushed: list = []       # groups whose partials the warp wrote, in order

    def product(self, unit: int, col: int):
        self.products.append((unit, self.group, col))

    def flush(self):
        self.flushed.append(self.group)
        self.group += 1
        self.group_start += self.row_tiles

    def advance(self, unit: int):                               # tiled_advance
        while unit >= self.group_start + self.row_tiles:
            self.flush()

    def units(self, u0: int, n: int):                           # tiled_units
        q, rt = self.first, self.row_tiles
        if q >= n:
            return
        first = u0 + q
        if first >= self.group_start + rt:
            self.advance(first)
        col = first - self.group_start
        if n == SLOT_UNITS and col + (WARP_UNITS - 1) * self.step < rt:     # the short path
            for i in range(WARP_UNITS):
                self.product(first + i * self.step, col + i * self.step)
            return
        at, cols = col, []                                      # each unit placed on its own
        for i in range(WARP_UNITS):
            cols.append(at)
            at += self.step
            if at >= rt:
                at -= rt
        for i in range(WARP_UNITS):
            u = q + i * self.step
            if u >= n:
                return
            self.advance(u0 + u)
            self.product(u0 + u, cols[i])

    def pair_in_groups(self, u0: int) -> bool:
        rt = self.row_tiles
        first = u0 + self.first
        if first >= self.group_start + rt:
            self.advance(first)
        col, span = first - self.group_start, (WARP_UNITS - 1) * self.step
        nxt = col + SLOT_UNITS - rt if col + SLOT_UNITS >= rt else col + SLOT_UNITS
        return col + span < rt and nxt + span < rt

    def pair(self, u0: int):                                    # tiled_pair
        rt = self.row_tiles
        col = u0 + self.first - self.group_start
        next_group = col + SLOT_UNITS >= rt
        cols = [col, col + SLOT_UNITS - rt if next_group else col + SLOT_UNITS]
        for i in range(WARP_UNITS):
            self.product(u0 + self.first + i * self.step, cols[0] + i * self.step)
        if next_group:
            self.flush()
        for i in range(WARP_UNITS):
            self.product(u0 + SLOT_UNITS + self.first + i * self.step, cols[1] + i * self.step)


def walk(row_tiles: int, groups: int, contiguous: bool, pairs: bool) -> list:
    """Every warp's walk over a tile of `groups` row groups (gemv_consume's slot loop, every slot in)."""
    units = groups * row_tiles
    warps = [Warp(q, row_tiles, contiguous) for q in range(WARPS)]
    for w in warps:
        u0 = 0
        while u0 < units:
            n = min(SLOT_UNITS, units - u0)
            if pairs and n == SLOT_UNITS and u0 + 2 * SLOT_UNITS <= units and w.pair_in_groups(u0):
                w.pair(u0)
                u0 += 2 * SLOT_UNITS
                continue
            w.units(u0, n)
            u0 += SLOT_UNITS
        w.advance(units)                                        # past the tile's end: its last groups
    return warps


@pytest.mark.parametrize("row_tiles", [8, 18, 48, 64, 140, 256])
@pytest.mark.parametrize("groups", [1, 2, 3, 17])
@pytest.mark.parametrize("contiguous", [False, True])
@pytest.mark.parametrize("pairs", [False, True])
def test_every_unit_once_in_its_own_row_group_and_every_group_written_once(row_tiles, groups, contiguous, pairs):
    warps = walk(row_tiles, groups, contiguous, pairs)
    taken = sorted(unit for w in warps for unit, _, _ in w.products)
    assert taken == list(range(groups * row_tiles))                 # every unit, once
    for w in warps:
        for unit, group, col in w.products:
            assert (group, col) == divmod(unit, row_tiles), (unit, group, col)
        assert w.flushed == list(range(groups))                     # each group's partials once, in order


@pytest.mark.parametrize("row_tiles", [48, 140])
def test_runs_of_units_keep_a_warp_s_share_of_each_slot_in_one_row_group(row_tiles):
    """Qwen-1.5B's rows (48 and 140 tiles, multiples of a warp's 4): with runs no warp's share of a full
    slot crosses a row group, so every slot takes a pair or the short path; strided shares cross."""
    def crossings(contiguous: bool) -> int:
        count = 0
        for w in (Warp(q, row_tiles, contiguous) for q in range(WARPS)):
            for u0 in range(0, 17 * row_tiles - SLOT_UNITS + 1, SLOT_UNITS):
                share = [u0 + w.first + i * w.step for i in range(WARP_UNITS)]
                count += share[0] // row_tiles != share[-1] // row_tiles
        return count
    assert crossings(True) == 0 and crossings(False) > 0
