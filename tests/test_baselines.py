"""The torch peers (kiec/baselines/torch_decode.py) against kiec's numpy reference.

On CPU: the plain step, eager, float32, one token per call, equals the float64 Reference
within 2e-6 (relative norm per position) over a prompt and 32 decode steps, on tiny random
llama (also with llama3 RoPE scaling), qwen2 (QKV biases) and mistral (sliding window 16,
so the later steps are past it). The decoder's own argmax is what it feeds itself, as on the
GPU, and it must be the reference's argmax at every step.
The batched prefill peer (torch_prefill.py) gives the reference's logits for a whole prompt at
once, and a decode step from the cache it filled gives the next position's.
On the GPU (marked gpu): the same step captured in one CUDA graph, and its torch.compile form
captured the same way, replayed with the token fed back on the device, in float32 against the
reference at 1e-4, and in bf16 at the bf16 tolerance.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from kiec.errors import KiecError
from kiec.model import load_spec
from kiec.synthetic import preset, write_random_model
from kiec.weights import load_checkpoint
from refcheck import reference, relative_errors

torch = pytest.importorskip("torch")
from kiec.baselines.torch_decode import GraphedStep, TorchDecoder, compile_step  # noqa: E402
from kiec.baselines.torch_prefill import prefill  # noqa: E402

PROMPT, DECODE = 8, 32
MAX_SEQ = 64
CPU_TOLERANCE = 2e-6           # float32 on the CPU against float64: measured 1.4e-7 to 3.1e-7
TOLERANCE = 1e-4               # float32 on the GPU (other reduction orders), not yet measured tighter
BF16_TOLERANCE = 2e-2          # bf16 weights and activations: 2^-8 per rounding, over a few layers
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}   # head_dim 16: low, smoothed and scaled bands all occur
MODELS = {
    "llama": preset("tiny-llama"),
    "llama-llama3-rope": preset("tiny-llama", rope_scaling=LLAMA3),
    "qwen2-qkv-bias": preset("tiny-qwen2"),
    "mistral-window": preset("tiny-mistral"),      # sliding_window 16 < PROMPT + DECODE
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, tmp_path_factory):
    folder = write_random_model(tmp_path_factory.mktemp(request.param), MODELS[request.param], seed=1, dtype="fp32")
    return load_spec(str(folder), {"max_seq_len": MAX_SEQ})


def _prompt(spec) -> list:
    return [int(t) for t in np.random.default_rng(0).integers(spec.config.vocab, size=PROMPT)]


def _reference_logits(spec, tokens) -> np.ndarray:
    """The float64 reference, one position per call, over exactly the tokens the peer was fed."""
    ref = reference(spec, np.float64)
    return np.stack([ref.forward([t])[-1] for t in tokens])


def _check_against_reference(spec, fed, logits, chosen, tolerance) -> None:
    want = _reference_logits(spec, fed)
    errors = relative_errors(logits, want)
    assert errors.max() < tolerance, f"worst position {int(errors.argmax())}: {errors.max():.3g}"
    # the token the peer selected after each position is the reference's greedy choice there
    assert chosen == [int(t) for t in want.argmax(axis=-1)]


def _eager_decode(decoder, prompt):
    """Feeds the prompt, then DECODE tokens the decoder chose itself; (fed, logits, chosen)."""
    fed, logits, chosen = list(prompt), [], []
    with torch.no_grad():
        for pos in range(PROMPT + DECODE):
            out, token = decoder(torch.tensor([fed[pos]]), torch.tensor([pos]))
            logits.append(out.numpy())
            chosen.append(int(token))
            if pos >= PROMPT - 1 and len(fed) < PROMPT + DECODE:
                fed.append(chosen[-1])
    return fed, np.stack(logits), chosen


def test_eager_step_equals_reference(model):
    decoder = TorchDecoder(model, load_checkpoint(model), MAX_SEQ)
    fed, logits, chosen = _eager_decode(decoder, _prompt(model))
    _check_against_reference(model, fed, logits, chosen, CPU_TOLERANCE)


def test_batched_prefill_equals_reference_and_decode_continues_it(model):
    """The prompt (longer than mistral's window) as one forward; then one decode step from its cache."""
    decoder = TorchDecoder(model, load_checkpoint(model), MAX_SEQ)
    tokens = [int(t) for t in np.random.default_rng(3).integers(model.config.vocab, size=PROMPT + DECODE + 1)]
    want = _reference_logits(model, tokens)
    with torch.no_grad():
        last = prefill(decoder, torch.tensor(tokens[:-1])).numpy()
        step, _ = decoder(torch.tensor(tokens[-1:]), torch.tensor([len(tokens) - 1]))
    errors = relative_errors(np.stack([last, step.numpy()]), want[-2:])
    assert errors.max() < CPU_TOLERANCE, errors


def test_mistral_window_matters(tmp_path):
    """The comparison above can see the window: without it the reference moves well past the tolerance."""
    config = MODELS["mistral-window"]
    windowed = load_spec(str(write_random_model(tmp_path / "w", config, seed=1, dtype="fp32")), {"max_seq_len": MAX_SEQ})
    folder = write_random_model(tmp_path / "full", dict(config, sliding_window=None), seed=1, dtype="fp32")
    full = load_spec(str(folder), {"max_seq_len": MAX_SEQ})
    assert full.config.sliding_window == 0 and windowed.config.sliding_window == 16
    tokens = [int(t) for t in np.random.default_rng(0).integers(config["vocab_size"], size=PROMPT + DECODE)]
    errors = relative_errors(_reference_logits(full, tokens), _reference_logits(windowed, tokens))
    assert errors[:16].max() < CPU_TOLERANCE          # inside the window both see every key
    assert errors[16:].min() > 10 * TOLERANCE         # past it, the window changes every position


def test_tied_head_shares_the_embedding(tmp_path):
    spec = load_spec(str(write_random_model(tmp_path, "tiny-qwen2", seed=1, dtype="fp32")), {"max_seq_len": MAX_SEQ})
    assert spec.config.tie_embeddings
    decoder = TorchDecoder(spec, load_checkpoint(spec), MAX_SEQ)
    assert decoder.lm_head.data_ptr() == decoder.embed.data_ptr()
    assert decoder.k_cache.shape == (2, 2, MAX_SEQ, 16)


def test_resize_cache_and_its_errors(tmp_path):
    spec = load_spec(str(write_random_model(tmp_path, "tiny-llama", seed=1, dtype="fp32")), {"max_seq_len": MAX_SEQ})
    decoder = TorchDecoder(spec, load_checkpoint(spec), 8)
    decoder.resize_cache(40)
    assert decoder.k_cache.shape == (2, 2, 40, 16) and decoder.key_positions.shape == (40,)
    assert not decoder.k_cache.any()
    with pytest.raises(KiecError, match="max_seq: got 0; expected a positive integer"):
        decoder.resize_cache(0)


def test_laneformer_is_refused(tmp_path):
    config = dict(preset("laneformer-2b"), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, vocab_size=96, num_lanes=2, broadcast_delay=1)
    folder = tmp_path / "lf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    spec = load_spec({"weights": str(folder), "max_seq_len": MAX_SEQ})
    with pytest.raises(KiecError, match="architecture: got 'laneformer with 2 lane"):
        TorchDecoder(spec, None, MAX_SEQ)


# --- GPU: the captured step, plain and compiled -----------------------------------------------------

def _graph_decode(graphed, prompt):
    """The prompt fed from the host, then DECODE replays that feed themselves on the device."""
    fed, logits, chosen = list(prompt), [], []
    for pos, token in enumerate(prompt):
        graphed.feed(token, pos)
        graphed.replay()
        logits.append(graphed.logits.cpu().numpy())
        chosen.append(int(graphed.token))
    for _ in range(DECODE):
        fed.append(chosen[-1])
        graphed.replay()                      # reads the token the last replay wrote
        logits.append(graphed.logits.cpu().numpy())
        chosen.append(int(graphed.token))
    assert int(graphed.pos) == PROMPT + DECODE
    return fed, np.stack(logits).astype(np.float64), chosen


def _graphed(spec, dtype, compiled: bool):
    decoder = TorchDecoder(spec, load_checkpoint(spec), MAX_SEQ, device="cuda", dtype=dtype)
    return GraphedStep(compile_step(decoder) if compiled else decoder, decoder)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["graph", "compiled-graph"])
def test_cuda_graph_equals_reference_fp32(model, compiled):
    torch.backends.cuda.matmul.allow_tf32 = False     # the default; TF32 would be a 1e-3 peer
    fed, logits, chosen = _graph_decode(_graphed(model, torch.float32, compiled), _prompt(model))
    _check_against_reference(model, fed, logits, chosen, TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["graph", "compiled-graph"])
def test_cuda_graph_bf16_follows_reference(model, compiled):
    fed, logits, chosen = _graph_decode(_graphed(model, torch.bfloat16, compiled), _prompt(model))
    want = _reference_logits(model, fed)
    errors = relative_errors(logits, want)
    assert errors.max() < BF16_TOLERANCE, f"worst position {int(errors.argmax())}: {errors.max():.3g}"
    assert chosen == [int(t) for t in logits.argmax(axis=-1)]    # the device's argmax of its own logits
