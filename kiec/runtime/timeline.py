"""Where a decode step's time goes: the kernel's profile of one steady-state step, summarised.

The kernel (`profile=True`) stamps the launch's middle step with the GPU's global timer, per
(stage, block): when the block's tile begins, when its wait, prologue, stream and epilogue end, the
time its consumers waited for weights that had not landed (`starved`), the time its producer waited
for a free ring slot while filling that stage's chunks (`producer_stall`: the block's HBM stream
stood still) and when the producer issued the stage's last chunk. A stage a block has no tile in
stays zero. `summarize` turns that into per-kind means and each stage's share of the critical path.
"""
from __future__ import annotations

import numpy as np

FIELDS = ("begin", "waited", "prologue", "stream", "epilogue", "starved", "producer_stall", "producer_last")


def summarize(raw: np.ndarray, kinds: list) -> dict:
    """raw: [stages, blocks, len(FIELDS)] uint64 ns; kinds: each stage's kind. Times in microseconds."""
    t = raw.astype(np.float64)
    begin, waited, prologue, stream, epilogue, starved, stall = (t[..., i] for i in range(7))
    has = begin > 0
    if not has.any():
        raise ValueError("the profile holds no stamps: was the launch profiled?")
    t0 = begin[has].min()
    end = np.where(has, epilogue, 0.0).max(axis=1)           # [stages] when the stage's last tile ended
    prev_end = np.concatenate([[t0], np.maximum.accumulate(end)[:-1]])
    critical = np.maximum(end - prev_end, 0.0)              # what each stage adds to the step
    blocks = raw.shape[1]
    step_ns = end.max() - t0
    out = {"step_us": step_ns / 1e3, "blocks": blocks,
           "producer_idle_share": float(stall.sum() / (blocks * step_ns)), "kinds": {}}
    for kind in dict.fromkeys(kinds):
        rows = [i for i, k in enumerate(kinds) if k == kind]
        h = has[rows]
        tiles = int(h.sum())

        def mean(x):
            return float(x[rows][h].mean() / 1e3) if tiles else 0.0
        out["kinds"][kind] = {
            "stages": len(rows), "tiles": tiles,
            "wait": mean(waited - begin), "prologue": mean(prologue - waited), "stream": mean(stream - prologue),
            "epilogue": mean(epilogue - stream), "starved": mean(starved),
            # stall is the producer's, summed over every block (a block may stall for a stage it has no tile in)
            "producer_stall": float(stall[rows].sum() / 1e3 / (len(rows) * blocks)),
            "critical": float(critical[rows].sum() / 1e3),
            "spread": float(np.mean([(end[i] - epilogue[i][has[i]].min()) / 1e3 for i in rows if has[i].any()])),
        }
    stamps = np.sort(np.unique(t[..., :5][has]))
    out["timer_resolution_ns"] = float(np.diff(stamps)[np.diff(stamps) > 0].min()) if len(stamps) > 1 else 0.0
    return out


def format_summary(s: dict) -> str:
    lines = [f"  step {s['step_us']:.1f} us over {s['blocks']} blocks; producers idle (ring full) "
             f"{100 * s['producer_idle_share']:.1f}% of it; timer resolution {s['timer_resolution_ns']:.0f} ns",
             f"  {'kind':<10}{'stages':>7}{'tiles':>7}{'wait':>8}{'prolog':>8}{'stream':>8}{'epilog':>8}"
             f"{'starved':>9}{'p.stall':>9}{'critical':>10}{'spread':>8}   (us; critical: summed over the kind)"]
    for kind, v in s["kinds"].items():
        lines.append(f"  {kind:<10}{v['stages']:>7}{v['tiles']:>7}{v['wait']:>8.2f}{v['prologue']:>8.2f}"
                     f"{v['stream']:>8.2f}{v['epilogue']:>8.2f}{v['starved']:>9.2f}{v['producer_stall']:>9.2f}"
                     f"{v['critical']:>10.1f}{v['spread']:>8.2f}")
    return "\n".join(lines)
