"""The device's read bandwidth, measured by kiec's own streaming-read kernel (the floor's yardstick)."""
from __future__ import annotations

import importlib.util

import numpy as np

from .codegen import _env
from .targets import get_target
from .toolchain import build, source_key


def build_probe(target_name: str = "cuda:sm_90", folder=None, threads: int = 512, blocks_per_sm: int = 8,
                unroll: int = 4):
    from .fetch import cache_dir
    target = get_target(target_name)
    env = _env()
    files = {"kiec_port.h": env.get_template("port.h.j2").render(target=target)}
    files["kernel.hip"] = env.get_template("probe.hip.j2").render(threads=threads, blocks_per_sm=blocks_per_sm,
                                                                  unroll=unroll)
    name = "kiec_probe_" + source_key(files, target)
    files["module.cpp"] = env.get_template("probe_module.cpp.j2").render(module_name=name)
    folder = folder or cache_dir() / "build" / name
    result = build(files, target, folder, name, quiet=True)
    spec = importlib.util.spec_from_file_location(name, result.module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_bandwidth(nbytes: int = 2_470_000_000, iterations: int = 20, **kw) -> dict:
    """Median and best bytes/s of a full read of `nbytes` (rounded to 16 bytes)."""
    nbytes -= nbytes % 16
    ms = np.array(build_probe(**kw).read(nbytes, iterations))
    return {"bytes": nbytes, "median_ms": float(np.median(ms)), "best_ms": float(ms.min()),
            "median_bps": nbytes / (np.median(ms) * 1e-3), "best_bps": nbytes / (ms.min() * 1e-3)}
