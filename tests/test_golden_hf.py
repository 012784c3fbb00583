"""kiec's numpy reference against Hugging Face transformers (torch, CPU) on tiny random models.

The models are made and saved by transformers itself (`from_config`, `save_pretrained` in
safetensors), so nothing of kiec writes the golden. Both sides run in float64 (HF through
`model.double()`, kiec's Reference with dtype float64); HF computes its RoPE cos/sin in float32
even then, which puts the floor of the agreement near 1e-7 (measured 1.4e-7 to 3.1e-7), under the 2e-6
asserted: a norm's missing eps (1e-5) fails it.
kiec runs a prefill of the prompt and then one decode step per token (its KV cache); HF runs
one full forward over the same tokens (teacher forcing). Every position is checked.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from refcheck import hf_logits, hf_random_model, prompt_then_decode, reference, relative_errors

PROMPT, DECODE = 8, 32
TOLERANCE = 2e-6
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, vocab_size=160, max_position_embeddings=256, rms_norm_eps=1e-5)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}   # head_dim 16: low, smoothed and scaled bands all occur


def _config(family: str, **changes):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[family]
    return cls(**dict(SMALL, **changes))


CASES = {
    "llama": ("llama", {}),
    "llama-tied-mha": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-llama3-rope": ("llama", dict(rope_scaling=LLAMA3, rope_theta=10000.0)),
    "llama-linear-rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "qwen2-qkv-bias": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen2-window-upper-layers": ("qwen2", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=6,
                                                max_window_layers=1, tie_word_embeddings=False)),
    "mistral-window": ("mistral", dict(num_hidden_layers=3, sliding_window=8, head_dim=32, num_key_value_heads=1)),
    # 6 heads of 16 over a hidden size of 64: q and the attention output are 96 wide
    "qwen2-head-dim-not-hidden-over-heads": ("qwen2", dict(num_attention_heads=6, head_dim=16, tie_word_embeddings=False)),
}
# transformers saves the window's layers as `layer_types`; without it kiec reads max_window_layers itself
CASES["qwen2-window-max-window-layers"] = CASES["qwen2-window-upper-layers"]
NO_LAYER_TYPES = {"qwen2-window-max-window-layers"}


def _tokens(vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, PROMPT + DECODE)


def _saved(tmp_path, model, dtype=None, layer_types=True):
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert (tmp_path / "model.safetensors").exists()
    if not layer_types:
        config = json.loads((tmp_path / "config.json").read_text())
        assert config.pop("layer_types", None) is not None
        (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _kiec_logits(folder, tokens):
    from kiec.model import load_spec
    spec = load_spec(str(folder), {"max_seq_len": 64})
    return prompt_then_decode(reference(spec, np.float64), tokens, PROMPT)


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_matches_transformers(case, tmp_path):
    family, changes = CASES[case]
    model = hf_random_model(_config(family, **changes), seed=len(case))
    folder = _saved(tmp_path, model, layer_types=case not in NO_LAYER_TYPES)
    tokens = _tokens(SMALL["vocab_size"], seed=3)
    want = hf_logits(model.double(), tokens)
    err = relative_errors(_kiec_logits(folder, tokens), want)
    assert err.shape == (PROMPT + DECODE,)
    assert (err <= TOLERANCE).all(), f"{case}: worst step {err.argmax()} rel err {err.max():.3g}"


def test_bf16_safetensors_match_transformers(tmp_path):
    """A checkpoint stored in bf16: both sides read the same bf16 values and compute in float64."""
    import torch
    from transformers import AutoModelForCausalLM
    model = hf_random_model(_config("llama"), seed=11)
    folder = _saved(tmp_path, model, torch.bfloat16)
    from kiec.weights import read_safetensors
    store = read_safetensors(str(folder / "model.safetensors"))
    assert {store.entries[n][1] for n in store.names()} == {"bfloat16"}
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    tokens = _tokens(SMALL["vocab_size"], seed=4)
    err = relative_errors(_kiec_logits(folder, tokens), hf_logits(hf, tokens))
    assert (err <= TOLERANCE).all(), f"worst step {err.argmax()} rel err {err.max():.3g}"


@pytest.mark.parametrize("case, plain", [
    ("mistral-window", dict(sliding_window=None)),
    ("qwen2-window-upper-layers", dict(use_sliding_window=False)),
    ("llama-llama3-rope", dict(rope_scaling=None)),
])
def test_the_feature_matters_in_these_cases(case, plain):
    """The window and the rope scaling of the cases above change HF's own logits by far more than
    the tolerance, so a kiec that ignored them could not pass."""
    from transformers import AutoModelForCausalLM
    family, changes = CASES[case]
    model = hf_random_model(_config(family, **changes), seed=len(case)).double()
    other = AutoModelForCausalLM.from_config(_config(family, **dict(changes, **plain))).double().eval()
    other.load_state_dict(model.state_dict())
    tokens = _tokens(SMALL["vocab_size"], seed=3)
    err = relative_errors(hf_logits(other, tokens), hf_logits(model, tokens))
    assert err[-DECODE:].max() > 100 * TOLERANCE


@pytest.mark.parametrize("case", ["llama", "llama-llama3-rope", "llama-linear-rope"])
def test_rope_frequencies_are_transformers(case):
    """kiec's inverse frequencies (float64) against the buffer transformers computes (float32)."""
    from kiec.model import arch_config, rope_inv_freq
    family, changes = CASES[case]
    model = hf_random_model(_config(family, **changes))
    want = model.model.rotary_emb.inv_freq.double().numpy()
    got = rope_inv_freq(arch_config(family, model.config.to_dict()))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
