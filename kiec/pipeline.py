"""The pipeline, as one readable list of named steps. The names key the dumps.

    model.json -> ModelSpec -> lower -> shard -> dtp -> verify -> fuse -> schedule -> memplan
               -> prefill -> codegen (.hip) -> build (ninja) -> .so
"""
from __future__ import annotations

from pathlib import Path

from .ir.graph import Graph, verify
from .model import ModelSpec
from .passes.dtp import dtp
from .passes.lower import lower
from .passes.shard import shard


def graph_steps(spec: ModelSpec):
    """(name, function) for every graph-to-graph step, in order."""
    return [
        ("lower", lambda _: lower(spec)),                                 # the model as ops, natural layout
        ("shard", lambda g: shard(g, spec.lanes)),                        # heads and FFN columns over lanes
        ("dtp", lambda g: dtp(g, spec.config, spec.dtp_delay)),          # each LaneReduce's mode
        ("verify", verify),                                               # shapes and def-before-use
    ]


def build_graph(spec: ModelSpec, dump: Path | None = None) -> Graph:
    graph = None
    for index, (name, step) in enumerate(graph_steps(spec)):
        graph = step(graph)
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            (dump / f"{index:02d}-{name}.ir").write_text(graph.dump())
    return graph


def schedule_steps(spec: ModelSpec, multiprocessors: int | None = None, options=None, block_bandwidth=None):
    """(name, function) for the steps from a graph to a placed, memory-planned Schedule."""
    from .passes.fuse import fuse
    from .passes.memplan import memplan
    from .passes.prefill import prefill
    from .passes.schedule import schedule
    from .options import CompileOptions
    from .targets import get_target
    target = get_target(spec.target)
    options = options or CompileOptions()
    return [
        ("fuse", lambda g: fuse(g, spec.config)),                                     # ops -> stages
        ("schedule", lambda s: schedule(s, target, multiprocessors, spec.max_seq_len, options, spec.gpus,
                                        spec.dtype, block_bandwidth)),                  # tiles
        ("memplan", lambda s: memplan(s, spec.config, spec.max_seq_len, spec.dtype)),  # offsets of everything
        ("prefill", lambda s: prefill(s, target, options.prefill_chunk)),           # the prompt path's plan
    ]


def build_schedule(spec: ModelSpec, multiprocessors: int | None = None, dump: Path | None = None, options=None,
                   block_bandwidth: float | None = None):
    graph = build_graph(spec, dump)
    sched = graph
    first = len(graph_steps(spec))
    for index, (name, step) in enumerate(schedule_steps(spec, multiprocessors, options, block_bandwidth), start=first):
        sched = step(sched)
        if dump is not None:
            (dump / f"{index:02d}-{name}.sched").write_text(sched.dump())
    return graph, sched


def render_sources(spec: ModelSpec, multiprocessors: int | None = None, dump: Path | None = None, options=None,
                   block_bandwidth: float | None = None):
    """(graph, schedule, files, module name): everything before the compiler. `multiprocessors` and
    `block_bandwidth` (a multiprocessor's share of the peak memory bandwidth, bytes/s) describe the device;
    None: the target's defaults."""
    from .codegen import render
    from .targets import get_target
    from .toolchain import source_key
    target = get_target(spec.target)
    graph, sched = build_schedule(spec, multiprocessors, dump, options, block_bandwidth)
    files = render(sched, target, "kiec_model")
    name = f"kiec_{source_key(files, target)}"
    files = render(sched, target, name)
    return graph, sched, files, name
