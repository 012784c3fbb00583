"""What `kiec bench` reports: the floor, each row's share of it and its speedup over each peer, as a
table and as JSON. Pure arithmetic on the measurements (no GPU), so it is tested on any machine.

floor (ms/token) = bytes per token / the best read bandwidth of the same run; a row's share of the
floor = floor / its ms per token; its speedup over a peer = the peer's ms per token / its own. A row
whose work is spread over several GPUs (lanes `spread`, the NCCL baseline past one rank) has no share:
one GPU's floor does not bound it. A peer that failed is a row with `not_run` and no ratios.
"""
from __future__ import annotations

ROWS = ("kiec per-step", "kiec per-sequence", "torch graph", "torch.compile graph", "HF generate")
PEERS = ROWS[2:]
FLOOR_BANDWIDTH = "best_bps"      # the floor is what the device's best streaming read allows
PLACEMENTS = {"one-launch": "every lane in one grid on this GPU",
              "shared": "one launch per lane (the multi-GPU build), all on GPU 0",
              "spread": "one launch per lane, lane i on GPU i"}


def summarize(raw: dict) -> dict:
    """`raw` (run_bench's measurements) plus, per context, the floor and one derived row per measurement."""
    bandwidth = raw["bandwidth"][FLOOR_BANDWIDTH]
    contexts = []
    for ctx in raw["contexts"]:
        measured = ctx["measured"]
        unknown = sorted(set(measured) - set(ROWS))
        if unknown:
            raise ValueError(f"unknown bench rows {unknown}; known: {ROWS}")
        floor_ms = ctx["bytes_per_token"]["total"] / bandwidth * 1e3
        peers = [p for p in PEERS if p in measured and "not_run" not in measured[p]]
        rows = []
        for name in (r for r in ROWS if r in measured):
            if "not_run" in measured[name]:
                rows.append({"name": name, "not_run": measured[name]["not_run"]})
                continue
            ms = measured[name]["ms_per_token"]
            rows.append({"name": name, "ms_per_token": ms, "tok_s": 1e3 / ms, "floor_share": floor_ms / ms,
                         "speedup": {p: measured[p]["ms_per_token"] / ms for p in peers if p != name}})
        contexts.append(dict(ctx, floor_ms=floor_ms, rows=rows))
    floors = {c["context"]: c["floor_ms"] for c in contexts}
    def timed(row: dict) -> dict:
        if "not_run" in row:
            return row
        out = dict(row, tok_s=1e3 / row["ms_per_token"])
        if row["lanes"] == 1 or row.get("placement", "spread") != "spread":    # on one GPU
            out["floor_share"] = floors[row["context"]] / row["ms_per_token"]
        return out
    lanes = [timed(row) for row in raw.get("lanes", [])]
    nccl = {(r["lanes"], r["context"]): r for r in map(timed, raw.get("nccl", []))}
    for row in lanes:                 # kiec's lanes against the NCCL baseline at the same lane count
        base = nccl.get((row["lanes"], row["context"]), {})
        if "ms_per_token" in row and "ms_per_token" in base:
            row["speedup_vs_nccl"] = base["ms_per_token"] / row["ms_per_token"]
    prefill = raw.get("prefill")
    if prefill and "kiec" in prefill:
        from .bench_prefill import summarize_prefill
        prefill = summarize_prefill(prefill)
    return dict(raw, floor_bandwidth=FLOOR_BANDWIDTH, contexts=contexts, lanes=lanes, nccl=list(nccl.values()),
                prefill=prefill)


NAME, NUM, PCT = 22, 11, 9


def _share(row: dict) -> str:
    """'% floor' cell: '-' where the row ran on several GPUs."""
    return f"{100 * row['floor_share']:>{PCT - 1}.1f}%" if "floor_share" in row else f"{'-':>{PCT}}"


def format_table(summary: dict) -> str:
    """One table per context: rows bandwidth, floor, then each measurement; ms/token, tok/s, % of floor,
    and 'vs PEER' (how many times faster than that peer) for every peer that was run."""
    bw = summary["bandwidth"]
    built = summary.get("options", {}).get("kernel_options")
    lines = [f"kiec bench: {summary['model']} ({summary['arch']}, {summary['dtype']}) on "
             f"{summary.get('device') or 'the GPU'}, {summary['steps']} steps per measurement"
             + (f", kiec built with {built}" if built else "")]
    if summary.get("partial"):
        lines.append("partial: the run stopped before its last measurement; these are the ones it finished")
    for ctx in summary["contexts"]:
        b = ctx["bytes_per_token"]
        peers = [r["name"] for r in ctx["rows"] if r["name"] in PEERS and "not_run" not in r]
        columns = [f"vs {p}" for p in peers]
        lines += ["", f"context {ctx['context']}: {b['total'] / 1e9:.4f} GB per token (weights "
                      f"{b['weights'] / 1e9:.4f} GB + KV cache {b['kv_cache'] / 1e6:.2f} MB)",
                  f"{'':<{NAME}}{'ms/token':>{NUM}}{'tok/s':>{NUM}}{'% floor':>{PCT}}"
                  + "".join(f"  {c:>{len(c)}}" for c in columns),
                  f"{'bandwidth':<{NAME}}{bw['best_bps'] / 1e12:>{NUM}.3f} TB/s best read, "
                  f"{bw['median_bps'] / 1e12:.3f} median, over {bw['bytes'] / 1e9:.2f} GB",
                  f"{'floor':<{NAME}}{ctx['floor_ms']:>{NUM}.4f}{1e3 / ctx['floor_ms']:>{NUM}.1f}{100.0:>{PCT - 1}.1f}%"]
        for row in ctx["rows"]:
            if "not_run" in row:
                lines.append(f"{row['name']:<{NAME}}  not run: {row['not_run']}")
                continue
            cells = [f"{row['speedup'][p]:.2f}x" if p in row["speedup"] else "-" for p in peers]
            lines.append(f"{row['name']:<{NAME}}{row['ms_per_token']:>{NUM}.4f}{row['tok_s']:>{NUM}.1f}"
                         f"{100 * row['floor_share']:>{PCT - 1}.1f}%"
                         + "".join(f"  {cell:>{len(c)}}" for cell, c in zip(cells, columns)))
    if summary.get("lanes"):
        lines += ["", "lanes (each its own blocks, weights, KV cache and inbox; one launch a sequence); placements: "
                  + "; ".join(f"{k}: {v}" for k, v in PLACEMENTS.items()),
                  f"{'lanes':>5}  {'mode':<22}{'placement':<12}{'context':>8}{'blocks':>7}{'ms/token':>{NUM}}"
                  f"{'tok/s':>{NUM}}{'% floor':>{PCT}}{'sent/lane/token':>17}{'vs NCCL':>9}"]
        for row in summary["lanes"]:
            head = f"{row['lanes']:>5}  {row['mode']:<22}{row['placement']:<12}{row['context']:>8}"
            if "not_run" in row:
                lines.append(f"{head}  not run: {row['not_run']}")
                continue
            vs = f"{row['speedup_vs_nccl']:.2f}x" if "speedup_vs_nccl" in row else "-"
            lines.append(f"{head}{row['blocks']:>7}{row['ms_per_token']:>{NUM}.4f}{row['tok_s']:>{NUM}.1f}"
                         f"{_share(row)}{row['exchange_bytes_per_lane'] / 1e3:>14.1f} kB{vs:>9}")
    if summary.get("nccl"):
        lines += ["", "NCCL baseline (torch step sharded over L GPUs, all-reduce between kernels, one CUDA graph)",
                  f"{'lanes':>5}{'context':>8}{'ms/token':>{NUM}}{'tok/s':>{NUM}}{'% floor':>{PCT}}"]
        for row in summary["nccl"]:
            head = f"{row['lanes']:>5}{row['context']:>8}"
            lines.append(f"{head}  not run: {row['not_run']}" if "not_run" in row else
                         f"{head}{row['ms_per_token']:>{NUM}.4f}{row['tok_s']:>{NUM}.1f}{_share(row)}")
    prefill = summary.get("prefill")
    if prefill and "rows" in prefill:
        from .bench_prefill import format_prefill
        lines += format_prefill(prefill)
    elif prefill:
        lines += ["", f"time to first token: not measured ({prefill['off']}: the decode kernel takes the prompt)"]
    return "\n".join(lines)
