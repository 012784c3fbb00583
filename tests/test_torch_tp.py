"""The NCCL baseline's sharding (kiec/baselines/torch_tp.py) against kiec's numpy reference, on CPU.

Two gloo ranks run the sharded torch step (heads, FFN columns and vocabulary rows split, the o and
down partials all-reduced, the logits' slices gathered) eagerly in float32; their logits over a
teacher-forced sequence equal the float64 reference within 2e-6 (the unsharded peer's tolerance),
on a llama and on a qwen2 (QKV biases; a vocabulary of 333 that does not split evenly, so the LM
head's padding is exercised). One rank is the unsharded decoder. Shapes that do not split are refused.
On a GPU (marked gpu): the same over NCCL, one rank per GPU present (up to 2).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from kiec.errors import KiecError
from kiec.model import load_spec
from kiec.synthetic import preset, write_random_model
from kiec.weights import load_checkpoint
from refcheck import reference, relative_errors

torch = pytest.importorskip("torch")
from kiec.baselines.torch_decode import TorchDecoder  # noqa: E402
from kiec.baselines.torch_tp import run_ranks, shard_decoder, teacher_forced  # noqa: E402

CPU_TOLERANCE = 2e-6       # float32 gloo ranks on the CPU against float64 (measured near 1e-7)
TOLERANCE = 1e-4           # NCCL ranks on GPUs, not yet measured tighter


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def model(request, tmp_path_factory):
    folder = write_random_model(tmp_path_factory.mktemp(request.param), preset(request.param), seed=5, dtype="fp32")
    return load_spec(str(folder), {"max_seq_len": 64})


@pytest.mark.parametrize("world", [1, 2])
def test_sharded_decode_matches_the_reference(model, world):
    tokens = [int(t) for t in np.random.default_rng(world).integers(model.config.vocab, size=12)]
    got = run_ranks(teacher_forced, world, model, tokens, backend="gloo", timeout_s=300)
    ref = reference(model, np.float64)
    want = np.stack([ref.forward([t])[-1] for t in tokens])
    errs = relative_errors(got, want)
    print(f"{model.config.arch} over {world} rank(s): max rel err {errs.max():.3g}")
    assert got.shape == (len(tokens), model.config.vocab)
    assert np.all(np.isfinite(got)) and errs.max() <= CPU_TOLERANCE
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


def test_shapes_that_do_not_split_are_refused(model):
    decoder = TorchDecoder(model, load_checkpoint(model), 16)
    with pytest.raises(KiecError, match="num_key_value_heads: got 2; expected a multiple of the tensor-parallel ranks"):
        shard_decoder(decoder, 0, 4)


def _exit_silently(rank: int, world: int) -> None:
    os._exit(0)


def test_a_rank_that_exits_without_an_answer_is_reported():
    with pytest.raises(RuntimeError, match=r"rank \d of 2 exited with code 0 without an answer"):
        run_ranks(_exit_silently, 2, backend="gloo", timeout_s=120)


def test_a_failing_rank_is_reported():
    with pytest.raises(RuntimeError, match=r"rank \d of 2 failed:\nTraceback"):
        run_ranks(teacher_forced, 2, "not a spec", [1, 2], backend="gloo", timeout_s=120)


@pytest.mark.gpu
def test_sharded_decode_over_nccl_matches_the_reference(model):
    from kiec.runtime.gpu import gpu_count
    world = min(2, gpu_count())
    tokens = [int(t) for t in np.random.default_rng(7).integers(model.config.vocab, size=12)]
    got = run_ranks(teacher_forced, world, model, tokens, backend="nccl", timeout_s=300)
    ref = reference(model, np.float64)
    errs = relative_errors(got, np.stack([ref.forward([t])[-1] for t in tokens]))
    print(f"{model.config.arch} over {world} NCCL rank(s): max rel err {errs.max():.3g}")
    assert errs.max() <= TOLERANCE
