"""Checks of the GPU kernel against the references, shared by the GPU tests and the device harness.

- `stage_diffs`: one step on the kernel with its trace on, the same step on the Python twin,
  relative error per stage (the first stage over tolerance is where a bug lives);
- `logit_errors`: per-step relative error and argmax agreement of two logit sequences.
NaN never passes: a non-finite value is an infinite error.
"""
from __future__ import annotations

import numpy as np


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or not np.all(np.isfinite(a)) or not np.all(np.isfinite(b)):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def logit_errors(got: np.ndarray, want: np.ndarray) -> tuple[np.ndarray, float]:
    """Per-step relative error and the share of steps whose argmax agrees."""
    errs = np.array([rel_err(g, w) for g, w in zip(got, want)])
    agree = float(np.mean(np.argmax(got, axis=-1) == np.argmax(want, axis=-1)))
    return errs, agree


def stage_diffs(backend, twin, token: int, pos: int) -> list:
    """[(stage name, relative error)] for one step at `pos` on both (their caches must hold the same prefix)."""
    got = backend.trace(token, pos)
    _, want = twin.step(token, pos)
    out = []
    for st in backend.sched.stages:
        g, w = np.asarray(got[st.index]), np.asarray(want[st.index])
        g = g.reshape(w.shape)
        out.append((st.name, rel_err(g, w)))
    return out
