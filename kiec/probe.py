"""The device's read bandwidth, measured by kiec's own streaming-read kernel (the floor's yardstick)."""
from __future__ import annotations

import importlib.util

import numpy as np

from .codegen import _env
from .errors import KiecError
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


def read_bandwidth(nbytes: int = 2_470_000_000, iterations: int = 20, reads_per_event: int = 1, **kw) -> dict:
    """Median and best bytes/s of a full read of `nbytes` (rounded to 16 bytes), each timed alone or, with
    `reads_per_event`, that many back to back between one pair of events (per read: the launch's latency
    then falls out of each read's time; PERF, the twelfth session, estimates 1%)."""
    nbytes -= nbytes % 16
    if reads_per_event < 1:
        raise KiecError("reads_per_event", reads_per_event, "1 or more reads between one pair of events")
    ms = np.array(build_probe(**kw).read(nbytes, iterations, reads_per_event))
    return {"bytes": nbytes, "reads_per_event": reads_per_event, "median_ms": float(np.median(ms)), "best_ms": float(ms.min()),
            "median_bps": nbytes / (np.median(ms) * 1e-3), "best_bps": nbytes / (ms.min() * 1e-3)}
