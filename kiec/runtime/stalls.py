"""Where the kernel's warps stall, instruction by instruction: Nsight Compute's warp-state samples.

The profile comes from one launch of the decode kernel under `ncu` on the GPU machine, e.g. a 4-layer
model at Qwen-1.5B's widths (about 20 s):

    ncu -k regex:decode_kernel --launch-skip 3 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters -f -o stalls \\
        python -m kiec.sancheck --preset qwen2.5-1.5b --set num_hidden_layers=4
    ncu -i stalls.ncu-rep --page source --csv --print-source sass | gzip > stalls.csv.gz

`python -m kiec.runtime.stalls stalls.csv.gz` then says how the samples split by stall reason, by
opcode, and over the hottest runs of instructions (a loop's body executes as often from its head to its
back edge, so a run is consecutive instructions executed at least a given share of the hottest count),
and lists the hottest instructions. PERF version 38 is the first reading: the GEMV's slot loop.
"""
from __future__ import annotations

import csv
import gzip
import sys
from dataclasses import dataclass, field
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class Instruction:
    index: int
    sass: str
    samples: int
    executed: int
    reasons: dict = field(default_factory=dict)       # stall reason -> samples

    @property
    def opcode(self) -> str:
        words = [w for w in self.sass.split() if not w.startswith("@")]
        return words[0].split(".")[0] if words else ""


def _count(text: str) -> int:
    text = text.replace(",", "").strip()
    return int(text) if text not in ("", "-") else 0


def read_source(path: Path) -> list:
    """The instructions of ncu's source page exported as CSV (`--page source --csv --print-source sass`,
    gzipped or not): their samples in total and by stall reason, and how often each was executed."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    header_at = next((i for i, r in enumerate(rows) if SAMPLES in r and "Source" in r), None)
    if header_at is None:
        raise ValueError(f"{path}: no '{SAMPLES}' column; export the source page of a report collected with "
                         "--section SourceCounters (--page source --csv --print-source sass)")
    header = rows[header_at]
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    out = []
    for r in rows[header_at + 1:]:
        if len(r) < len(header):
            continue
        out.append(Instruction(index=len(out), sass=r[col["Source"]].strip(), samples=_count(r[col[SAMPLES]]),
                               executed=_count(r[col[EXECUTED]]) if EXECUTED in col else 0,
                               reasons={h[len("stall_"):]: _count(r[col[h]]) for h in reasons}))
    return out


def _reasons(instructions) -> dict:
    total: dict = {}
    for ins in instructions:
        for k, v in ins.reasons.items():
            total[k] = total.get(k, 0) + v
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def hot_runs(instructions: list, share: float = 0.1, show: int = 6) -> list:
    """Runs of consecutive instructions each executed at least `share` of the hottest one's count, the
    `show` with the most samples: (first, last, samples, most executed, stall reasons)."""
    top = max((i.executed for i in instructions), default=0)
    runs, start = [], None
    for ins in instructions + [Instruction(len(instructions), "", 0, 0)]:
        hot = top > 0 and ins.executed >= share * top
        if hot and start is None:
            start = ins.index
        elif not hot and start is not None:
            body = instructions[start:ins.index]
            runs.append((start, ins.index - 1, sum(i.samples for i in body), max(i.executed for i in body), _reasons(body)))
            start = None
    return sorted(runs, key=lambda r: -r[2])[:show]


def summarize(instructions: list, top: int = 15) -> dict:
    samples = sum(i.samples for i in instructions)
    opcodes: dict = {}
    for ins in instructions:
        opcodes[ins.opcode] = opcodes.get(ins.opcode, 0) + ins.samples
    return {"samples": samples, "instructions": len(instructions),
            "executed": sum(i.executed for i in instructions),
            "reasons": _reasons(instructions),
            "opcodes": dict(sorted(opcodes.items(), key=lambda kv: -kv[1])[:12]),
            "runs": hot_runs(instructions),
            "hottest": [(i.index, i.executed, i.samples, i.sass) for i in sorted(instructions, key=lambda i: -i.samples)[:top]]}


def format_summary(s: dict) -> str:
    n = max(s["samples"], 1)
    lines = [f"{s['samples']} samples over {s['instructions']} instructions ({s['executed']} executed, warp-level)",
             "stall reasons: " + ", ".join(f"{k} {100 * v / n:.1f}%" for k, v in s["reasons"].items() if v),
             "by opcode: " + ", ".join(f"{k} {100 * v / n:.1f}%" for k, v in s["opcodes"].items() if v),
             "hottest runs (instructions executed at least a tenth as often as the hottest one):"]
    for first, last, samples, executed, reasons in s["runs"]:
        why = ", ".join(f"{k} {100 * v / max(samples, 1):.0f}%" for k, v in list(reasons.items())[:4])
        lines.append(f"  {first:>6}-{last:<6} {100 * samples / n:5.1f}% of the samples, executed up to {executed}: {why}")
    lines.append("hottest instructions (index, executed, samples):")
    lines += [f"  {i:>6} {e:>9} {smp:>6}  {sass}" for i, e, smp, sass in s["hottest"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    import json
    ap = argparse.ArgumentParser(prog="python -m kiec.runtime.stalls", description=__doc__.split("\n\n")[0])
    ap.add_argument("source", type=Path, help="ncu's source page as CSV (.csv or .csv.gz)")
    ap.add_argument("--json", type=Path, help="also write the summary here")
    args = ap.parse_args(argv)
    try:
        summary = summarize(read_source(args.source))
    except (OSError, ValueError) as err:
        print(f"kiec.runtime.stalls: error: {err}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
