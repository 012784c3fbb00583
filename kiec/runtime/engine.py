"""Engine: one model, one sequence at a time (batch 1), on a backend.

A backend owns the KV cache and computes logits: `reference` (the numpy interpreter,
any machine) or `gpu` (the compiled monokernel). The engine keeps the tokens that are
in the cache, so a new request that shares a prefix with the last one only computes
the rest (coding agents resend the same context), samples, applies stop conditions and
streams `Token` events.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from ..errors import Cancelled, KiecError
from ..model import ModelSpec
from ..progress import report
from .gpu import check_token_ids
from .sampling import Sampler, SamplingParams, StopStrings

log = logging.getLogger("kiec")


@dataclass
class Token:
    id: int
    text: str                       # the text this token adds ("" inside a multi-byte char, or while it
                                    # may begin a stop string: held-back text comes with a later token)
    logprob: float | None = None
    top_logprobs: dict = field(default_factory=dict)
    finish_reason: str | None = None  # None, "stop" or "length" on the last event


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0

    @property
    def decode_tok_s(self) -> float:
        gen = self.total_s - self.ttft_s
        return (self.completion_tokens - 1) / gen if gen > 0 and self.completion_tokens > 1 else 0.0


PROMPT_CHUNK = 256     # prompt tokens the reference takes at once (its progress and cancel checks between)


class ReferenceBackend:
    """The numpy interpreter as a backend."""
    name = "reference"

    def __init__(self, spec: ModelSpec, dtype=np.float32, progress=None):
        from ..pipeline import build_graph
        from ..reference.interpreter import Reference
        from ..weights import load_checkpoint, materialize
        graph = build_graph(spec)
        report(progress, "open weights", 0, 1)
        checkpoint = load_checkpoint(spec)
        report(progress, "open weights", 1, 1)
        weights, tensors = {}, graph.weights()
        for done, tensor in enumerate(tensors, 1):      # reference_weights, one tensor at a time for progress
            weights[tensor.name] = materialize(checkpoint, tensor, dtype)
            report(progress, "convert weights", done, len(tensors))
        self.model = Reference(graph, weights, spec.config, spec.max_seq_len, dtype)
        self.max_seq_len = spec.max_seq_len
        self.vocab = spec.config.vocab
        self.progress = progress

    def forward(self, tokens, start: int, cancelled=None) -> np.ndarray:
        """Logits [vocab] after appending `tokens` at position `start` (the cache below stays). A long
        prompt goes in chunks (numpy takes about 25 ms a token for SmolLM2), its progress shown, and
        `cancelled()` asked between them: Cancelled once it says so."""
        self.model.reset(start)
        tokens = list(tokens)
        shown = self.progress is not None and len(tokens) > PROMPT_CHUNK
        for done in range(0, len(tokens), PROMPT_CHUNK):
            if done and cancelled is not None and cancelled():
                raise Cancelled(f"after {done} of the prompt's {len(tokens)} tokens")
            if shown:
                report(self.progress, "prompt", done, len(tokens))
            logits = self.model.forward(tokens[done:done + PROMPT_CHUNK])
        if shown:
            report(self.progress, "prompt", len(tokens), len(tokens))
        return np.asarray(logits[-1], dtype=np.float32)


def backend_kind(backend: str) -> str:
    """'gpu' or 'reference' for a --backend value, refused at once where it cannot run here."""
    from .gpu import gpu_available
    if backend == "auto":
        return "gpu" if gpu_available() else "reference"
    if backend == "gpu" and not gpu_available():     # before the build, which takes a while and then fails
        raise KiecError("backend", "gpu", "a machine with an NVIDIA GPU (nvidia-smi) and nvcc",
                        "--backend reference runs the numpy reference")
    if backend not in ("gpu", "reference"):
        raise KiecError("backend", backend, "'auto', 'gpu' or 'reference'")
    return backend


def make_backend(spec: ModelSpec, kind: str, **options):
    """The backend of a kind backend_kind gave."""
    if kind == "reference":
        return ReferenceBackend(spec, **options)
    from .gpu import GpuBackend
    return GpuBackend(spec, **options)


class Engine:
    def __init__(self, spec: ModelSpec, backend="auto", tokenizer=None, **options):
        from .tokenizer import load_tokenizer
        self.spec = spec
        if isinstance(backend, str):
            backend = backend_kind(backend)          # a GPU asked for where there is none: said at once
        if tokenizer is None:        # then: a missing tokenizer fails before minutes of building and uploading
            report(options.get("progress"), "tokenizer", 0, 1)
            tokenizer = load_tokenizer(spec.tokenizer)
            report(options.get("progress"), "tokenizer", 1, 1)
        self.tokenizer = tokenizer
        if tokenizer.vocab_size > spec.config.vocab:     # said at load, not as each request's error
            log.warning(f"the tokenizer knows {tokenizer.vocab_size} tokens and {spec.name} has {spec.config.vocab} "
                        f"embedding rows: a prompt with an id past {spec.config.vocab - 1} will be refused (is "
                        f"`tokenizer` the model's own?)")
        self.backend = make_backend(spec, backend, **options) if isinstance(backend, str) else backend
        self.cached: list[int] = []      # the tokens whose K/V the backend holds, in order
        self.last_stats = Stats()

    @property
    def max_seq_len(self) -> int:
        return self.backend.max_seq_len

    @property
    def vocab(self) -> int:
        return self.backend.vocab

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def check_request(self, prompt: list[int], params: SamplingParams) -> list[int]:
        """`prompt` as ints, or the error generate would raise at its first token: a caller echoing the
        prompt checks first, so the error is not glued to the echo."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise KiecError("prompt", [], "at least one token")
        check_token_ids(prompt, self.vocab, "prompt")     # the reference backend's too, not only the GPU's
        if len(prompt) >= self.max_seq_len:
            raise KiecError("prompt", f"{len(prompt)} tokens",
                            f"fewer than max_seq_len ({self.max_seq_len}) tokens, leaving room to generate")
        params.check_vocab(self.vocab)
        return prompt

    def generate(self, prompt: list[int], params: SamplingParams | None = None, cancelled=None) -> Iterator[Token]:
        """Streams the completion of `prompt` (token ids). `cancelled()`, where given, is asked while the
        prompt goes in (a long one takes a while on the reference): Cancelled once it says so."""
        params = params or SamplingParams()
        prompt = self.check_request(prompt, params)
        stats = Stats(prompt_tokens=len(prompt))
        start = time.perf_counter()
        # prefix reuse: keep the cache up to the first token that differs (at least one token is recomputed)
        common = 0
        for a, b in zip(self.cached, prompt[:-1]):
            if a != b:
                break
            common += 1
        stats.cached_tokens = common
        self.cached = self.cached[:common]
        logits = self.backend.forward(prompt[common:], common, cancelled)
        self.cached = list(prompt)
        sampler = Sampler(params, self.tokenizer.eos_ids)
        decoder = self.tokenizer.stream_decoder()
        stops = StopStrings(params.stop)
        history = list(prompt)
        limit = min(params.max_tokens, self.max_seq_len - len(prompt))
        for n in range(limit):
            if n:   # the last token's K/V, computed only once the consumer asks for the next token
                logits = self.backend.forward([history[-1]], len(self.cached))
                self.cached.append(history[-1])
            token, logprob, top = sampler.sample(logits, history)
            if n == 0:
                stats.ttft_s = time.perf_counter() - start
            history.append(token)
            stats.completion_tokens = n + 1
            ends = sampler.is_stop_token(token)     # a stop token adds no text of its own
            text = "" if ends else decoder.push(token)
            if ends or n == limit - 1:
                text += decoder.flush()
            piece, stopped = stops.push(text)
            finish = "stop" if stopped or ends else "length" if n == limit - 1 else None
            if finish is not None and not stopped:
                piece += stops.flush()
            stats.total_s = time.perf_counter() - start
            self.last_stats = stats
            yield Token(token, piece, logprob, top, finish)
            if finish:
                return
