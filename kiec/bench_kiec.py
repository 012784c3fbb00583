"""kiec's own decode timing, shared by `kiec bench` and its lane variants (kiec.bench_lanes)."""
from __future__ import annotations

import time

import numpy as np


def time_kiec(backend, context: int, steps: int, rng, clock=time.perf_counter) -> dict:
    """kiec's ms/token from position `context`: one launch per step, as a host loop that looks at every
    token pays it (launch to finish by the host's clock, the launch and the host's work between steps
    included; the kernel's own event time beside it), and one launch for all `steps` (median of 3
    launches, per token). Every step gets another token. Medians."""
    tokens = [int(t) for t in rng.integers(backend.vocab, size=steps)]
    backend._launch(tokens[:1], steps, context)          # warm-up: module load, first touch of the cache
    backend._finish()
    per_step, kernel = [], []
    for i, token in enumerate(tokens):
        start = clock()
        backend._launch([token], 1, context + i)
        kernel.append(backend._finish())
        per_step.append((clock() - start) * 1e3)
    per_sequence = []
    for token in tokens[:3]:
        backend._launch([token], steps, context)
        per_sequence.append(backend._finish() / steps)
    return {"kiec per-step": {"ms_per_token": float(np.median(per_step)), "kernel_ms_per_token": float(np.median(kernel)),
                              "launches": steps},
            "kiec per-sequence": {"ms_per_token": float(np.median(per_sequence)), "launches": len(per_sequence),
                                  "steps_per_launch": steps}}
