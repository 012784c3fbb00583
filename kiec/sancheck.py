"""A small run of the monokernel for compute-sanitizer: `compute-sanitizer --tool memcheck python -m kiec.sancheck`.

Random tiny weights in memory (a preset, its config changed by `--set`, built with `--options`), a few single-step launches,
one multi-step launch; exits non-zero if anything the kernel returns is not finite.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from .errors import KiecError, is_int

# integer fields of a Hugging Face config that kiec.model reads and the presets may leave out
OPTIONAL_INTEGERS = ("head_dim", "sliding_window", "max_window_layers", "sliding_window_n_layers", "num_lanes",
                     "broadcast_delay")


def preset_with(name: str, changes: str) -> dict:
    """The preset's config with --set's changes: its integer and true/false fields (0 or 1), or an integer
    field the loader reads that presets leave out; a misspelt key (which would add one nothing reads) is
    a KiecError naming it."""
    from .options import parse_integers
    from .synthetic import preset
    base = preset(name)
    flags = [k for k, v in base.items() if isinstance(v, bool)]
    fields = [k for k, v in base.items() if is_int(v)] + flags + [k for k in OPTIONAL_INTEGERS if k not in base]
    return dict(base, **{k: bool(v) if k in flags else v for k, v in parse_integers(changes, "--set", fields).items()})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny-llama")
    ap.add_argument("--set", default="", help="config changes to the preset, e.g. 'hidden_size=1536,num_hidden_layers=1'")
    ap.add_argument("--options", default="", help="compile options, e.g. 'slot_pairs=0'")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)
    from .model import load_spec
    from .options import CompileOptions
    from .runtime.gpu import CompiledModel, GpuBackend, device_multiprocessors
    from .synthetic import random_checkpoint
    try:
        options = CompileOptions.parse(args.options)
        cfg = preset_with(args.preset, args.set)
    except KiecError as err:
        print(f"kiec.sancheck: error: {err}", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="kiec-sancheck-"))
    (folder / "config.json").write_text(json.dumps(cfg))
    spec = load_spec({"weights": str(folder), "max_seq_len": 256})
    compiled = CompiledModel(spec, device_multiprocessors(), quiet=True, options=options)
    backend = GpuBackend(spec, checkpoint=random_checkpoint(cfg, seed=1), quiet=True, timeout_s=30.0, compiled=compiled)
    logits = backend.forward([1, 2, 3], 0)
    for i in range(args.steps):
        logits = backend.forward([int(np.argmax(logits))], 3 + i)
    tokens = list(backend.generate_on_device([5, 6], 3 + args.steps, args.steps))
    ok = bool(np.all(np.isfinite(logits))) and len(tokens) == args.steps
    print(f"sancheck {'ok' if ok else 'FAILED'}: {len(tokens)} tokens, logits finite {np.all(np.isfinite(logits))}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
