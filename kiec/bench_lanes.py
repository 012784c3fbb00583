"""`kiec bench --lanes`: kiec at several lane counts and placements, and the NCCL baseline.

Every lane variant is built side by side first (nvcc is single-threaded), then uploaded and timed
one at a time (kiec.bench_kiec.time_kiec). A placement that needs more GPUs than the machine has, and an
NCCL baseline that cannot run or fails, is a row that says so: the rest of the run is kept.
"""
from __future__ import annotations

from .errors import KiecError


def exchange_bytes_per_lane(sched) -> int:
    """Bytes one lane stores into its peers' memory per token: a full-width fp32 partial per peer for
    every sublayer it sends (codegen.senders); across devices also its last residual, mirrored to
    every other device for the LM head."""
    from .codegen import senders
    mirrored = 1 if sched.grid.devices > 1 else 0
    return (len(senders(sched)) + mirrored) * sched.config["hidden"] * 4 * (sched.lanes - 1)


def time_lanes(model, checkpoint, options, rng, log):
    """Yields one row per (lane count, mode, placement, context) as it is timed: kiec's ms/token; a
    placement that needs more GPUs than this machine has is a row that says so."""
    from .bench_kiec import time_kiec
    from .runtime.gpu import GpuBackend, gpu_count
    gpus = gpu_count()
    devices = [placement_devices(placement, lanes) if placement != "spread" or gpus >= lanes else None
               for lanes, _, placement, _ in model.lane_specs]      # None: this machine cannot place it
    builds = build_all({i: (spec, devices[i]) for i, (*_, spec) in enumerate(model.lane_specs) if devices[i]}, log)
    for i, (lanes, mode, placement, spec) in enumerate(model.lane_specs):
        head = {"lanes": lanes, "mode": mode, "placement": placement}
        if devices[i] is None:
            yield from (dict(head, context=c, not_run=f"needs {lanes} GPUs, this machine has {gpus}")
                        for c in options.contexts)
            continue
        log(f"kiec with {lanes} lane(s), {mode}, {placement}: upload")
        backend = GpuBackend(spec, checkpoint=checkpoint, quiet=True, devices=devices[i], compiled=builds[i])
        for context in options.contexts:
            log(f"kiec with {lanes} lane(s), {mode}, {placement}, at context {context}")
            timed = time_kiec(backend, context, options.steps, rng)
            yield dict(head, context=context, blocks=backend.sched.grid.blocks,
                       ms_per_token=timed["kiec per-sequence"]["ms_per_token"],
                       ms_per_token_per_step=timed["kiec per-step"]["ms_per_token"],
                       exchange_bytes_per_lane=exchange_bytes_per_lane(backend.sched))
        del backend


def placement_devices(placement: str, lanes: int) -> list:
    return {"one-launch": [0], "shared": [0] * lanes, "spread": list(range(lanes))}[placement]


def build_all(jobs: dict, log) -> dict:
    """key -> CompiledModel for every key -> (spec, devices), built side by side (nvcc is single-threaded)."""
    import os
    from concurrent.futures import ThreadPoolExecutor
    from .runtime.gpu import CompiledModel, lane_multiprocessors
    if not jobs:
        return {}
    log(f"kiec: building {len(jobs)} lane variant(s) side by side")
    with ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1)) as pool:
        futures = {key: pool.submit(CompiledModel, spec, lane_multiprocessors(devices), None, True)
                   for key, (spec, devices) in jobs.items()}
        return {key: future.result() for key, future in futures.items()}


def time_nccl(model, options, log):
    """The NCCL baseline (kiec.baselines.torch_tp) at each lane count of --lanes that this machine's
    GPUs allow: yields one row per (lane count, context); the others are rows that say what they need."""
    from .baselines.torch_tp import run_ranks, timed_decode
    from .runtime.gpu import gpu_count
    gpus = gpu_count()
    for lanes in options.lanes:
        if lanes > gpus:
            yield from ({"lanes": lanes, "context": c, "not_run": f"needs {lanes} GPUs, this machine has {gpus}"}
                        for c in options.contexts)
            continue
        log(f"NCCL baseline over {lanes} GPU(s)")
        try:
            timed = run_ranks(timed_decode, lanes, model, options.contexts, options.steps)
        except (RuntimeError, KiecError) as failure:     # kiec's rows of this run are kept
            log(f"NCCL baseline over {lanes} GPU(s) failed: {failure}")
            yield from ({"lanes": lanes, "context": c, "not_run": f"failed: {str(failure).splitlines()[0]}"}
                        for c in options.contexts)
            continue
        yield from ({"lanes": lanes, "context": c, "ms_per_token": timed[c]["ms_per_token"]} for c in options.contexts)
