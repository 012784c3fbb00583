"""Golden tests of the matrix-unit prefill on a GPU (`pytest -m gpu`; skipped where there is none).

- logits after a prefill (every prompt token but the last) and one decode step match transformers
  in fp32 within relative error 2e-2, with the same argmax, at the Llama-3.2-1B and Qwen2.5-1.5B
  shapes, a sliding window, head dims 16 to 256 and prompts of several chunks;
- the prefill writes exactly the cache positions of its tokens (the cache is poisoned with NaN
  first), close to what token-by-token decode writes, and decode after it matches decode after a
  token-by-token prefill;
- a prefill that starts after a cached prefix (prefix reuse) gives the logits a whole prefill gives;
- bad input is an error that names it.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kiec.golden import logit_errors, rel_err
from kiec.model import load_spec
from kiec.synthetic import preset

import once

pytestmark = pytest.mark.gpu

# name -> (config, max_seq_len, prefill chunk or None, prompt length)
MODELS = {
    "llama-3.2-1b": (preset("llama-3.2-1b"), 1024, None, 700),
    "qwen2.5-1.5b": (preset("qwen2.5-1.5b"), 1024, None, 520),
    "tiny-mistral-window16": (preset("tiny-mistral"), 512, None, 300),
    "tiny-qwen2-hd16-bias": (preset("tiny-qwen2"), 512, None, 200),
    "hd128-kv1": (preset("tiny-llama", hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=704, vocab_size=1001), 512, None, 333),
    "hd256": (preset("tiny-llama", hidden_size=512, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                     intermediate_size=512, vocab_size=512), 512, None, 257),
    "chunk64-tiny-llama": (preset("tiny-llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=512, vocab_size=500), 512, 64, 450),
}


@pytest.fixture(scope="session")
def prefill_built(tmp_path_factory):
    from kiec.options import CompileOptions
    from kiec.runtime.gpu import CompiledModel, device_multiprocessors
    specs = {}
    for name, (cfg, seq, _, _) in MODELS.items():
        folder = once.random_model(tmp_path_factory, cfg, seed=31, dtype="bf16")
        specs[name] = load_spec({"weights": str(folder), "max_seq_len": seq})
    sms = device_multiprocessors()
    with ThreadPoolExecutor(len(specs)) as pool:
        jobs = {n: pool.submit(CompiledModel, s, sms, once.build_root(tmp_path_factory), True,
                               options=CompileOptions(prefill_chunk=MODELS[n][2])) for n, s in specs.items()}
        return {n: (specs[n], job.result()) for n, job in jobs.items()}


def backend(prefill_built, name, prefill=True):
    from kiec.runtime.gpu import GpuBackend
    spec, compiled = prefill_built[name]
    out = GpuBackend(spec, compiled=compiled, quiet=True, prefill=prefill)
    out.kernel.poison_cache()
    out.poison()
    return out


def prompt(spec, n, seed=None):
    return [int(t) for t in np.random.default_rng(seed).integers(spec.config.vocab, size=n)]


def hf_last_logits(folder, tokens):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        out = model(torch.tensor([tokens], device="cuda")).logits[0, -1].float().cpu().numpy()
    del model
    torch.cuda.empty_cache()
    return out


def kv_cache(gpu, spec):
    """[2 (k, v), layers, kv heads, max_seq, head_dim] float32 of lane 0."""
    import ml_dtypes
    from kiec.runtime.gpu import REGION_KV
    cfg = spec.config
    shape = (2, cfg.layers, cfg.kv_heads, spec.max_seq_len, cfg.head_dim)
    raw = gpu.kernel.read(REGION_KV, 0, 2 * int(np.prod(shape)))
    return raw.view(ml_dtypes.bfloat16).astype(np.float32).reshape(shape)


def test_every_model_here_has_prefill_kernels(prefill_built):
    for name, (_, compiled) in prefill_built.items():
        assert compiled.module.info()["prefill_chunk"] == (MODELS[name][2] or min(2048, MODELS[name][1])), name


@pytest.mark.parametrize("name", list(MODELS))
def test_prefill_then_decode_matches_transformers(prefill_built, name):
    spec, _ = prefill_built[name]
    gpu = backend(prefill_built, name)
    tokens = prompt(spec, MODELS[name][3])
    got = gpu.forward(tokens, 0)
    want = hf_last_logits(spec.weights, tokens)
    err = rel_err(got, want)
    print(f"{name}: {len(tokens)} tokens, prefill {gpu.last_prefill_ms:.3f} ms, rel err {err:.3g}")
    assert np.all(np.isfinite(got))
    assert err <= 2e-2, err
    assert int(np.argmax(got)) == int(np.argmax(want))


@pytest.mark.parametrize("name", list(MODELS))
def test_prefill_writes_its_positions_and_decode_continues_as_after_token_by_token(prefill_built, name):
    spec, _ = prefill_built[name]
    fast, slow = backend(prefill_built, name), backend(prefill_built, name, prefill=False)
    n = MODELS[name][3]
    tokens = prompt(spec, n)
    first_fast, first_slow = fast.forward(tokens, 0), slow.forward(tokens, 0)
    cache_fast, cache_slow = kv_cache(fast, spec), kv_cache(slow, spec)
    assert np.all(np.isfinite(cache_fast[..., :n, :])), "a position the prompt fills was not written"
    assert np.all(np.isnan(cache_fast[..., n:, :])), "something wrote past the prompt"
    cache_err = max(rel_err(cache_fast[i, layer, ..., :n, :], cache_slow[i, layer, ..., :n, :])
                    for i in range(2) for layer in range(spec.config.layers))
    assert cache_err <= 1e-2, cache_err
    assert rel_err(first_fast, first_slow) <= 2e-2
    follow = prompt(spec, 32)
    errs, agree = logit_errors(fast.teacher_forced(follow, n), slow.teacher_forced(follow, n))
    print(f"{name}: cache rel err {cache_err:.3g}, decode after: max rel err {errs.max():.3g}, argmax {agree:.3f}")
    assert errs.max() <= 2e-2 and agree >= 0.98, (errs.max(), agree)


@pytest.mark.parametrize("name", ["llama-3.2-1b", "chunk64-tiny-llama", "tiny-mistral-window16"])
def test_a_prefill_after_a_cached_prefix_gives_the_logits_of_a_whole_prefill(prefill_built, name):
    spec, _ = prefill_built[name]
    reused, whole = backend(prefill_built, name), backend(prefill_built, name)
    tokens = prompt(spec, MODELS[name][3])
    cut = len(tokens) // 3 + 1
    reused.forward(tokens[:cut], 0)                 # the cached request: K/V of tokens[:cut]
    got = reused.forward(tokens[cut:], cut)         # the next request only computes its new tokens
    want = whole.forward(tokens, 0)
    err = rel_err(got, want)
    assert err <= 1e-2 and int(np.argmax(got)) == int(np.argmax(want)), err


def test_bad_prefill_input_is_an_error_naming_it(prefill_built):
    from kiec.errors import KiecError
    spec, _ = prefill_built["tiny-mistral-window16"]
    gpu = backend(prefill_built, "tiny-mistral-window16")
    with pytest.raises(KiecError, match="max_seq_len"):
        gpu.prefill([1] * 10, spec.max_seq_len - 5)
    with pytest.raises(KiecError, match=r"token: got 300; expected token ids in \[0, 300\)"):   # before any launch
        gpu.prefill([1, 2, 300], 0)
    assert np.all(np.isfinite(gpu.forward(prompt(spec, 20), 0)))     # and the instance still works


def test_the_prefill_profile_accounts_for_every_kind_of_launch(prefill_built):
    from kiec.runtime.gpu import PREFILL_KINDS
    spec, _ = prefill_built["chunk64-tiny-llama"]
    gpu = backend(prefill_built, "chunk64-tiny-llama")
    prof = gpu.prefill_profile(prompt(spec, 300), 0)
    assert set(prof) == {"total_ms", *PREFILL_KINDS}
    assert all(prof[k] > 0 for k in PREFILL_KINDS), prof
    assert sum(prof[k] for k in PREFILL_KINDS) >= 0.9 * prof["total_ms"], prof
