"""The Hugging Face peer: transformers' own `generate` (eager, greedy, batch 1) on a model folder.

Timing is on the host, one timestamp per token through a streamer: on CUDA, `generate`
copies every new token to the host before it queues the next step (its stop check reads
the device), so the gap between two tokens is one whole decode step as a user sees it.
The first new token also carries the prefill and is left out.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..errors import KiecError
from ..model import is_gguf


def load_hf_model(source: str, device: str = "cuda", dtype: str = "bf16"):
    """transformers' model for a model folder (config.json + safetensors) or a GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM
    path = Path(source)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    if is_gguf(path):
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch_dtype)
    elif (path if path.is_dir() else path.parent).joinpath("config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(path if path.is_dir() else path.parent, dtype=torch_dtype)
    else:
        raise KiecError("weights", source, "a model folder with config.json, or a GGUF file, for transformers")
    return model.to(device).eval()


class _TokenClock:
    """A `generate` streamer that only notes when each batch of tokens reached the host."""

    def __init__(self):
        self.times: list = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def time_generate(model, context: int, new_tokens: int, seed: int = 0) -> dict:
    """Greedy decode of `new_tokens` after a random prompt of `context` tokens: median ms per token."""
    import torch
    if new_tokens < 2:
        raise KiecError("steps", new_tokens, "at least 2 (the first new token carries the prefill)")
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    ids = torch.from_numpy(np.random.default_rng(seed).integers(vocab, size=(1, context))).to(device)
    options = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:, :8], attention_mask=torch.ones_like(ids[:, :8]), **dict(options, max_new_tokens=4,
                                                                                       min_new_tokens=4))
        clock = _TokenClock()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), streamer=clock, **options)
    made = out.shape[1] - context
    if made != new_tokens or len(clock.times) != new_tokens + 1:       # the first put is the prompt
        raise KiecError("HF generate", f"{made} new tokens, {len(clock.times)} streamed",
                        f"{new_tokens} tokens, one streamed per step")
    gaps = np.diff(clock.times[1:]) * 1e3                                # from the first new token on
    return {"ms_per_token": float(np.median(gaps)), "ms_mean": float(gaps.mean()), "tokens": len(gaps)}
