"""Files a test run writes once, however many pytest-xdist workers it has.

The GPU tests' session fixtures write random models at real shapes (Llama-1B and Qwen-1.5B: 5.6 GB of
bf16 for test_gpu, as much again for test_prefill_gpu) and compile a kernel for each. Under `-n 8`
every worker runs its own copy of a session fixture, so each model was written and compiled once a
worker: up to eight times 11 GB on a device machine of 64 GiB of disk. Here the first worker to ask
writes a model while holding its lock and the others reuse it, and builds go to one folder per run,
where kiec's toolchain lets one process at a time build a kernel's folder.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from kiec.locks import held
from kiec.synthetic import write_random_model


def run_folder(tmp_path_factory) -> Path:
    """A folder every worker of this run shares (a local xdist worker's base folder is the run's, one
    level down); conftest's pytest_sessionfinish removes it when the run ends."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "once"
    folder.mkdir(exist_ok=True)
    return folder


def build_root(tmp_path_factory) -> Path:
    """Where this run's kernels are built: one folder a source hash, shared by the workers."""
    return run_folder(tmp_path_factory) / "build"


def random_model(tmp_path_factory, config, seed: int, dtype: str) -> Path:
    """write_random_model's folder for (config, seed, dtype), written by the first worker that asks."""
    key = hashlib.sha256(json.dumps([config, seed, dtype], sort_keys=True).encode()).hexdigest()[:16]
    root = run_folder(tmp_path_factory)
    folder, written = root / f"model-{key}", root / f"model-{key}.written"
    with held(root / f"model-{key}.lock"):
        if not written.exists():
            shutil.rmtree(folder, ignore_errors=True)       # left half-written by a worker that died
            write_random_model(folder, config, seed=seed, dtype=dtype)
            written.touch()
    return folder
