"""Helpers the CPU tests share: kiec's numpy reference on a spec, random Hugging Face models,
the per-step relative error. Test modules import it by name (pytest puts tests/ on sys.path)."""
from __future__ import annotations

import math

import numpy as np


def reference(spec, dtype=np.float64, graph=None):
    """kiec's numpy interpreter over the spec's graph (or `graph`) and checkpoint."""
    from kiec.pipeline import build_graph
    from kiec.reference.interpreter import Reference, reference_weights
    from kiec.weights import load_checkpoint
    graph = build_graph(spec) if graph is None else graph
    weights = reference_weights(graph, load_checkpoint(spec), dtype)
    return Reference(graph, weights, spec.config, spec.max_seq_len, dtype)


def prompt_then_decode(ref, tokens, prompt_len: int) -> np.ndarray:
    """Logits [T, V]: one prefill of tokens[:prompt_len], then one decode step per later token."""
    tokens = np.asarray(tokens)
    out = [ref.forward(tokens[:prompt_len])]
    out += [ref.forward(tokens[i:i + 1]) for i in range(prompt_len, len(tokens))]
    return np.concatenate(out)


def relative_errors(got, want) -> np.ndarray:
    """||got - want|| / ||want|| for every row (one row per position). NaN or inf never passes."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.isfinite(got).all(), "non-finite logits from kiec"
    assert np.isfinite(want).all(), "non-finite logits from the reference"
    return np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)


def hf_random_model(config, seed: int = 0):
    """A transformers model from `config` with every parameter drawn at a scale where attention
    is far from uniform (so RoPE, masks and windows change the logits): projections N(0, 1/fan_in),
    embeddings N(0, 1), biases N(0, 0.1), norm weights 1 + N(0, 0.1)."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "embed_tokens" in name or "lm_head" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    return model.eval()


def hf_logits(model, tokens) -> np.ndarray:
    """The model's logits [T, V] for one full forward of `tokens`, as float64."""
    import torch
    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)[None]).logits[0]
    return out.double().numpy()
