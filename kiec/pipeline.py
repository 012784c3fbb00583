"""The pipeline, as one readable list of named steps. The names key the dumps.

    model.json -> ModelSpec -> lower -> shard -> dtp -> verify -> fuse -> schedule -> memplan
               -> codegen (.hip) -> build (ninja) -> .so
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
