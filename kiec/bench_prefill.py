"""Time to first token (`kiec bench --prompts`): kiec's prefill against the FLOP floor and torch.

For each prompt length n (fresh random tokens, positions from 0): kiec's time to first token is the
host's wall time of `GpuBackend.forward(prompt, 0)` -- the matrix-unit prefill of n - 1 tokens, the
decode step that makes the logits, the logits back on the host -- median of `repeats` after a
warm-up of the same length; its prefill part is the GPU's event time. The torch peer runs the prompt
as one batched forward (baselines/torch_prefill.py: cuBLAS GEMMs, SDPA attention) to the last
logits, CUDA events around it, median. The floor is the matrix FLOPs the prompt needs,
2 x (every layer's matrix parameters) x n, over the bf16 matrix rate measured in the same run
(`matrix_rate`: torch.matmul of 8192^3, cuBLAS); attention's FLOPs are left out of it, so the
floor is below what any prefill reaches, more so for long prompts.
"""
from __future__ import annotations

import time

import numpy as np


def layer_matrix_params(spec) -> int:
    """Weights a prompt token is multiplied by: Q, K, V, O, gate, up and down of every layer."""
    c = spec.config
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    return c.layers * (c.hidden * (q + 2 * kv) + q * c.hidden + 3 * c.hidden * c.ffn)


def _median_event_ms(run, repeats: int) -> float:
    """Median of `repeats` calls of `run`, each between two CUDA events (after one untimed call)."""
    import torch
    run()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return float(np.median(times))


def matrix_rate(size: int = 8192, repeats: int = 20) -> dict:
    """The device's bf16 matrix rate: torch.matmul (cuBLAS) of two size x size matrices, median."""
    import torch
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    ms = _median_event_ms(lambda: a @ b, repeats)
    return {"size": size, "ms": ms, "flops_per_s": 2 * size ** 3 / ms * 1e3}


def time_kiec_prefill(backend, prompts, rng, repeats: int = 5) -> dict:
    """n -> {ttft_ms, prefill_ms, repeats}: kiec's time to first token for a prompt of n tokens."""
    out = {}
    for n in prompts:
        tokens = [int(t) for t in rng.integers(backend.vocab, size=n)]
        backend.forward(tokens, 0)                         # warm-up: scratch buffers, first touch
        walls, gpu = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            backend.forward(tokens, 0)
            walls.append((time.perf_counter() - t0) * 1e3)
            gpu.append(backend.last_prefill_ms)
        out[n] = {"ttft_ms": float(np.median(walls)), "prefill_ms": float(np.median(gpu)), "repeats": repeats}
    return out


def time_torch_prefill(spec, checkpoint, prompts, rng, repeats: int = 5) -> dict:
    """n -> {ttft_ms, repeats}: the plain-torch batched prefill to the last logits, on the same weights."""
    import torch
    from .baselines.torch_decode import TorchDecoder
    from .baselines.torch_prefill import prefill
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype]
    decoder = TorchDecoder(spec, checkpoint, max(prompts), device="cuda", dtype=dtype)
    out = {}
    with torch.no_grad():
        for n in prompts:
            tokens = torch.tensor(rng.integers(spec.config.vocab, size=n), device="cuda")
            ms = _median_event_ms(lambda: prefill(decoder, tokens).cpu(), repeats)
            out[n] = {"ttft_ms": ms, "repeats": repeats}
    del decoder
    torch.cuda.empty_cache()
    return out


def summarize_prefill(raw: dict) -> dict:
    """raw: {matrix_rate, layer_matrix_params, kiec: {n: ...}, torch: {n: ...} or absent} -> one row per
    prompt length with the floor, prefill tok/s, the share of the floor and the speedup over torch."""
    rate, params, torch_rows = raw["matrix_rate"], raw["layer_matrix_params"], raw.get("torch")
    rows = []
    for n, k in raw["kiec"].items():
        floor_ms = 2 * params * n / rate["flops_per_s"] * 1e3
        row = {"tokens": n, **k, "prefill_tok_s": (n - 1) / k["prefill_ms"] * 1e3 if k["prefill_ms"] else None,
               "floor_ms": floor_ms, "floor_share": floor_ms / k["ttft_ms"]}
        if torch_rows and "not_run" not in torch_rows and n in torch_rows:
            row["torch_ttft_ms"] = torch_rows[n]["ttft_ms"]
            row["speedup_vs_torch"] = torch_rows[n]["ttft_ms"] / k["ttft_ms"]
        rows.append(row)
    out = {"matrix_rate": rate, "layer_matrix_params": params, "rows": rows}
    if torch_rows and "not_run" in torch_rows:
        out["torch_not_run"] = torch_rows["not_run"]
    return out


def format_prefill(summary: dict) -> list:
    rate = summary["matrix_rate"]
    lines = ["", f"time to first token (prefill on the matrix units, then one decode step); floor = "
                 f"2 x {summary['layer_matrix_params'] / 1e9:.3f} G matrix parameters x tokens over "
                 f"{rate['flops_per_s'] / 1e12:.0f} TFLOP/s (torch.matmul {rate['size']}^3 in this run)",
             f"{'tokens':>7}{'TTFT ms':>10}{'prefill ms':>12}{'prefill tok/s':>15}{'floor ms':>10}{'% floor':>9}"
             f"{'torch ms':>10}{'vs torch':>10}"]
    for r in summary["rows"]:
        torch_ms = f"{r['torch_ttft_ms']:>10.2f}" if "torch_ttft_ms" in r else f"{'-':>10}"
        speedup = f"{r['speedup_vs_torch']:>9.2f}x" if "speedup_vs_torch" in r else f"{'-':>10}"
        tok_s = f"{r['prefill_tok_s']:>15.0f}" if r["prefill_tok_s"] else f"{'-':>15}"
        lines.append(f"{r['tokens']:>7}{r['ttft_ms']:>10.2f}{r['prefill_ms']:>12.2f}{tok_s}{r['floor_ms']:>10.2f}"
                     f"{100 * r['floor_share']:>8.1f}%{torch_ms}{speedup}")
    if "torch_not_run" in summary:
        lines.append(f"torch prefill not run: {summary['torch_not_run']}")
    return lines
