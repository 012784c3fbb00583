"""Where a decode step's time goes: the kernel's profile of one steady-state step, summarised.

The kernel (`profile=True`) stamps the launch's middle step with the GPU's global timer, per
(stage, block): when the block's tile begins, when its wait, prologue, stream and epilogue end, the
time its consumers waited for weights that had not landed (`starved`), the time its producer waited
for a free ring slot while filling that stage's chunks (`producer_stall`: the block's HBM stream
stood still), when the producer issued the stage's last chunk, and the multiprocessor the block ran
on. A stage a block has no tile in stays zero. `summarize` turns that into per-kind means and each
stage's share of the critical path.
"""
from __future__ import annotations

import numpy as np

FIELDS = ("begin", "waited", "prologue", "stream", "epilogue", "starved", "producer_stall", "producer_last", "sm")


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


def kinds_of(names: list) -> list:
    """Each stage's kind from its name (Stage.name: `gate_up[layer 3]`)."""
    return [n.split("[")[0] for n in names]


def late_blocks(raw: np.ndarray, kinds: list, kind: str, show: int = 5) -> dict:
    """Whether the blocks that end a kind's stages last are the same in every layer. A block's lateness
    in a stage is when its tile ended less the stage's median end; over the blocks with a tile in every
    one of the kind's stages, `own` is the share of the lateness's variance that is the block's mean
    over the stages (near 1: the same blocks are late every layer, so a static share of the rows by
    block could even the stage; near 1 / stages: lateness moves from layer to layer, and only taking
    work as it frees up would). `latest`: the `show` latest blocks, (block, its multiprocessor, mean
    lateness in µs)."""
    rows = [i for i, k in enumerate(kinds) if k == kind]
    end = raw[rows][..., FIELDS.index("epilogue")].astype(np.float64)
    every = (end > 0).all(axis=0)
    if len(rows) < 2 or every.sum() < 2:
        return {"stages": len(rows), "blocks": int(every.sum()), "own": float("nan"), "latest": []}
    late = (end[:, every] - np.median(end[:, every], axis=1, keepdims=True)) / 1e3
    mean = late.mean(axis=0)
    total = ((late - late.mean()) ** 2).mean()
    # the blocks' means hold at most all of the variance: min() keeps a rounding above it out
    own = float(min(1.0, ((mean - late.mean()) ** 2).mean() / total)) if total > 0 else float("nan")
    blocks = np.flatnonzero(every)
    order = np.argsort(-mean)[:show]
    sm = raw[rows[0], :, FIELDS.index("sm")]
    return {"stages": len(rows), "blocks": int(every.sum()), "own": own,
            "latest": [(int(blocks[i]), int(sm[blocks[i]]), float(mean[i])) for i in order]}


def format_late(s: dict, kind: str) -> str:
    if not s["latest"]:
        return f"  {kind}: {s['stages']} stages and {s['blocks']} blocks with a tile in each, too few to tell late blocks"
    latest = ", ".join(f"{b} on {sm} ({m:+.2f})" for b, sm, m in s["latest"])
    return (f"  {kind}: {s['own']:.2f} of the lateness is the block's own over {s['stages']} stages and "
            f"{s['blocks']} blocks (1 / stages: {1 / max(s['stages'], 1):.2f}); latest blocks on their multiprocessors "
            f"(µs): {latest}")


def stage_rows(raw: np.ndarray, names: list, stages: range) -> str:
    """Each stage's tiles on the step's clock: min / median / max over its blocks of when a tile began,
    its wait, prologue, stream and epilogue ended, and when the producer issued the stage's last chunk
    (µs from the step's first stamp). A stage's boundaries show here as they do not in the means."""
    t = raw.astype(np.float64)
    has = t[..., 0] > 0
    t0 = t[..., 0][has].min()
    cols = ("begin", "waited", "prologue", "stream", "epilogue", "producer_last")
    lines = [f"  {'stage':<20}{'tiles':>6}" + "".join(f"{c:>22}" for c in cols) + "   (us: min / median / max)"]
    for s in stages:
        h = has[s]
        if not h.any():
            lines.append(f"  {names[s]:<20}{0:>6}")
            continue
        cells = []
        for c in cols:
            v = t[s, :, FIELDS.index(c)][h]
            v = (v[v > 0] - t0) / 1e3                  # a block that issued none of the stage's chunks has no stamp
            cells.append(f"{v.min():7.2f}/{np.median(v):7.2f}/{v.max():7.2f}" if len(v) else "-")
        lines.append(f"  {names[s]:<20}{int(h.sum()):>6}" + "".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    """python -m kiec.runtime.timeline PROFILE.npy [--stages 40-45 | --late gate_up]: a profile devcheck
    saved (with PROFILE.json beside it naming the stages), stage by stage, or which blocks end a kind's
    stages last."""
    import argparse
    import json
    from pathlib import Path
    ap = argparse.ArgumentParser(prog="python -m kiec.runtime.timeline")
    ap.add_argument("profile", type=Path)
    ap.add_argument("--stages", help="a range of stage indices, e.g. 40-45 (default: all)")
    ap.add_argument("--late", metavar="KIND", help="whether the same blocks end KIND's stages last in every layer "
                    "(e.g. gate_up), from the stage names")
    args = ap.parse_args(argv)
    raw = np.load(args.profile)
    side = args.profile.with_suffix(".json")
    names = json.loads(side.read_text())["stages"] if side.exists() else [f"stage {i}" for i in range(raw.shape[0])]
    first, last = 0, raw.shape[0] - 1
    if args.stages:
        lo, _, hi = args.stages.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            ap.error(f"--stages: got {args.stages!r}; expected A-B, stage indices")
        if not 0 <= first <= last < raw.shape[0]:
            ap.error(f"--stages: got {args.stages}; expected A-B with 0 <= A <= B < {raw.shape[0]}")
    if args.late:
        kinds = kinds_of(names)
        if args.late not in kinds:
            ap.error(f"--late: got {args.late!r}; expected a stage kind of this profile: {', '.join(dict.fromkeys(kinds))}")
        print(format_late(late_blocks(raw, kinds, args.late), args.late))
        return 0
    print(stage_rows(raw, names, range(first, last + 1)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
