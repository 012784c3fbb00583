"""The decode GEMV's product on the matrix units, modelled lane by lane on the CPU.

A tiled unit is 8 weight rows x 32 columns (kiec.pack.tile_rows). The kernel gives it to one
mma.sync.m16n8k16 as A, each lane's 16 bytes as loaded, and x as B in the layout the prologue writes
(stage_gemv.j2: x_tiles_at, store_x4_tiles, x_fragment); tiled_flush then adds D[r][0..1] of lane 4r
and D[r + 8][2..3] of lane 4r + 1. This test composes those three layouts with the instruction's
fragment ownership as the PTX ISA states it, and checks that each row comes out as its dot product.
"""
import re
from pathlib import Path

import numpy as np
import pytest

import kiec
from kiec.ir.schedule import TILE_COLS, TILE_ROWS
from kiec.pack import tile_rows

# The layout is read from the template the kernel is rendered from, not copied here: a change to the
# kernel's x_tiles_at or X_ERROR is what this test then checks.
TEMPLATE = (Path(kiec.__file__).parent / "templates" / "stage_gemv.j2").read_text()
X_ERROR = int(re.search(r"constexpr uint32_t X_ERROR = (\d+);", TEMPLATE).group(1))
_BODY = re.search(r"T\* x_tiles_at\(T\* xt, uint32_t i\) \{\n(.*?)\n\}", TEMPLATE, re.S).group(1)
_DECL = re.search(r"const uint32_t c = (.*?), pair = (.*?);", _BODY)
_C, _PAIR, _AT = (e.replace("/", "//") for e in          # unsigned C division: Python's floor division
                  (_DECL.group(1), _DECL.group(2), re.search(r"return xt \+ (.*?);", _BODY).group(1)))


def x_tiles_at(i: int) -> int:
    """The kernel's x_tiles_at (its C arithmetic, evaluated): the half index of x[i]'s rounding."""
    env = {"i": i, "TILE_COLS": TILE_COLS}
    env["c"] = eval(_C, {}, env)
    env["pair"] = eval(_PAIR, {}, env)
    return eval(_AT, {}, env)


def bf16_round(v: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (round to nearest even), as float64."""
    u = v.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


# PTX ISA, mma.m16n8k16 with .bf16: which (row, col) each lane's register halves hold
def a_fragment(lane):        # 4 registers x 2 halves of A (16 x 16, row-major)
    g, t = lane // 4, lane % 4
    return [(g + 8 * (r % 2), 2 * t + h + 8 * (r // 2)) for r in range(4) for h in range(2)]


def b_fragment(lane):        # 2 registers x 2 halves of B (16 x 8): (k, n)
    g, t = lane // 4, lane % 4
    return [(2 * t + h + 8 * r, g) for r in range(2) for h in range(2)]


def d_fragment(lane):        # 4 floats of D (16 x 8)
    g, t = lane // 4, lane % 4
    return [(g + 8 * (e // 2), 2 * t + e % 2) for e in range(4)]


def warp_product(tile: np.ndarray, xt: np.ndarray, col_tile: int) -> np.ndarray:
    """D of one unit: A from the lanes' 16 bytes of `tile` (8 x 32, row-major), B from x_fragment."""
    flat = tile.reshape(-1)
    a, b = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        for (row, k), value in zip(a_fragment(lane), flat[lane * 8:lane * 8 + 8]):
            a[row, k] = value
        halves = xt[col_tile * 2 * TILE_COLS + lane % 16 * 4:][:4]      # lanes 16-31 load what 0-15 do
        for (k, n), value in zip(b_fragment(lane), halves):
            b[k, n] = value
    return a @ b


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_product_per_tile_gives_each_row_s_dot_product(seed):
    rng = np.random.default_rng(seed)
    cols = 3 * TILE_COLS
    w = bf16_round(rng.standard_normal((TILE_ROWS, cols)))
    x = rng.standard_normal(cols).astype(np.float32)
    # the prologue's x: per element its rounding and the rounding's error (store_x4_tiles)
    hi = bf16_round(x)
    lo = bf16_round(x - hi)
    xt = np.full(2 * cols, np.nan)
    for i in range(cols):
        xt[x_tiles_at(i)] = hi[i]
        xt[x_tiles_at(i) + X_ERROR] = lo[i]
    assert not np.isnan(xt).any()                      # every half of the layout is written once
    units = tile_rows(w).reshape(-1, TILE_ROWS, TILE_COLS)       # one row group: its column tiles, in order
    d = sum(warp_product(unit, xt, col_tile) for col_tile, unit in enumerate(units))
    # tiled_flush: lane 4r's D[r][0] + D[r][1], plus lane 4r + 1's D[r + 8][2] + D[r + 8][3]
    per_lane = {lane: [d[rc] for rc in d_fragment(lane)] for lane in range(32)}
    rows = np.array([per_lane[4 * r][0] + per_lane[4 * r][1] + per_lane[4 * r + 1][2] + per_lane[4 * r + 1][3]
                     for r in range(TILE_ROWS)])
    want = w @ (hi + lo)
    assert np.allclose(rows, want, rtol=1e-12, atol=1e-12)
    # lanes 16-31 (B's columns 4-7) reach only D's columns 4-7, which the flush never reads
    assert all(col < 4 for lane in range(0, 32, 4) for _, col in d_fragment(lane)[:2])
    assert all(col < 4 for lane in range(1, 32, 4) for _, col in d_fragment(lane)[2:])
    assert {n for lane in range(16, 32) for _, n in b_fragment(lane)} == {4, 5, 6, 7}
    # x's two halves keep about 16 bits: far closer to w @ x than the rounding alone
    exact = w @ x.astype(np.float64)
    assert np.abs(rows - exact).max() < 1e-3 * np.abs(exact).max()
    assert np.abs(rows - exact).max() < np.abs(w @ hi - exact).max()
