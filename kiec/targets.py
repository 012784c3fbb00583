"""A target is data: the table of differences between HIP-on-NVIDIA and HIP-on-AMD.

Templates read these fields and nothing else about the target; there is no
`if amd:` anywhere below the renderer.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    name: str                 # the model.json spelling
    vendor: str               # "nvidia" | "amd" (selects the portability header's section)
    arch: str                 # sm_90a | gfx942
    warp_size: int
    multiprocessors: int      # used when no device is present to size the grid
    smem_bytes: int           # shared memory one block may use (the weight ring lives here)
    slot_bytes: int           # one ring slot: big enough for a unit, small enough for several slots
    gemv_tiles: bool          # decode GEMVs on the matrix units (tiled matrices); else FMAs over rows
    producer_warps: int       # the producer's warps: one streams; a whole warpgroup where registers move by warpgroup
    producer_registers: int   # registers a producer thread keeps once the block's pool is rebalanced (0: no rebalancing)
    copies_in_flight: int     # a block's weight copies in flight in the layers at most (0: no cap), where the device is unknown
    copy_latency_ns: int      # else the copies that cover a block's share of the device's peak bandwidth for this long (0: fixed)
    ring_evict_first: bool    # the ring's copies carry L2's evict-first hint (False: the target has none for them)
    marks_only: int           # on one lane, marked inputs read without counters (0-2): its argument needs one L2 as the point of coherence
    compiler: str             # builds the .so
    compile_flags: tuple
    check_compiler: str       # device-only compile check, no GPU needed
    check_flags: tuple


TARGETS = {
    "cuda:sm_90": Target(
        name="cuda:sm_90", vendor="nvidia", arch="sm_90a", warp_size=32, multiprocessors=132,
        smem_bytes=227 * 1024, slot_bytes=16 * 1024, gemv_tiles=True,
        producer_warps=4, producer_registers=40, copies_in_flight=3, copy_latency_ns=1300, ring_evict_first=True,
        marks_only=2,
        compiler="nvcc",
        compile_flags=("-O3", "-std=c++17", "-x", "cu", "-gencode=arch=compute_90a,code=sm_90a",
                       "--expt-relaxed-constexpr", "-Xptxas=-v", "-lineinfo"),
        check_compiler="nvcc",
        check_flags=("-O3", "-std=c++17", "-x", "cu", "-cubin", "-gencode=arch=compute_90a,code=sm_90a",
                     "-Xptxas=-v"),
    ),
    "hip:gfx942": Target(
        name="hip:gfx942", vendor="amd", arch="gfx942", warp_size=64, multiprocessors=304,
        smem_bytes=64 * 1024, slot_bytes=8 * 1024, gemv_tiles=False,
        producer_warps=1, producer_registers=0, copies_in_flight=0, copy_latency_ns=0, ring_evict_first=False,
        marks_only=0,             # MI300X's chiplets each have an L2; not yet run on AMD hardware
        compiler="hipcc",
        compile_flags=("-O3", "-std=c++17", "--offload-arch=gfx942", "-munsafe-fp-atomics"),
        check_compiler="clang++-19",
        check_flags=("-O3", "-std=c++17", "-x", "hip", "--offload-arch=gfx942", "--offload-device-only",
                     "-nogpulib", "-c"),
    ),
}


def get_target(name: str) -> Target:
    from .errors import KiecError, nearest
    if name not in TARGETS:
        raise KiecError("target", name, " or ".join(TARGETS), nearest(name, TARGETS))
    return TARGETS[name]
