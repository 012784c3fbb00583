"""How far Delayed Tensor Parallelism moves a model it was not trained for.

`past(d)` on a standard llama/qwen2/mistral is a different model. This runs both on the numpy
reference, teacher-forced on the same tokens: the exact model (`present` everywhere, which equals
the unsharded model) and the sharded one with past(d), and reports per position the KL divergence
KL(exact || past) of the next-token distributions and whether their top-1 tokens agree.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import KiecError
from .model import ModelSpec


@dataclass(frozen=True)
class DtpError:
    tokens: int
    kl: np.ndarray              # [tokens] nats
    top1: np.ndarray            # [tokens] bool

    def summary(self, spec: ModelSpec) -> str:
        return (f"dtp error  past({spec.dtp_delay}) at {spec.lanes} lanes vs exact, teacher-forced on {self.tokens} "
                f"random tokens: KL(exact || past) mean {self.kl.mean():.4g} nats, max {self.kl.max():.4g}; "
                f"top-1 agreement {100 * self.top1.mean():.1f}%")


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def check_dtp_error_spec(spec: ModelSpec, tokens: int = 32) -> None:
    """What dtp_error needs of the spec: a delay on a model not trained for it, over lanes."""
    if not spec.approximate:
        raise KiecError("dtp_delay", spec.dtp_delay, f"a delay d >= 1 on a model not trained with delay "
                        f"(got a {spec.config.arch} model{'' if spec.dtp_delay is None else ' trained for it'})")
    if spec.lanes < 2:
        raise KiecError("lanes", spec.lanes, "at least 2 (past(d) exchanges partials between lanes)")
    if tokens < 1 or tokens > spec.max_seq_len:
        raise KiecError("--tokens", tokens, f"1 .. max_seq_len ({spec.max_seq_len})")


def dtp_error(spec: ModelSpec, tokens: int = 32, seed: int = 0) -> DtpError:
    from .pipeline import build_graph
    from .reference.interpreter import Reference, reference_weights
    from .weights import load_checkpoint
    check_dtp_error_spec(spec, tokens)
    ckpt = load_checkpoint(spec)
    ids = np.random.default_rng(seed).integers(spec.config.vocab, size=tokens)
    logits = []
    for variant in (spec.replace(dtp_delay=None), spec):
        graph = build_graph(variant)
        ref = Reference(graph, reference_weights(graph, ckpt), variant.config, tokens, np.float32)
        logits.append(ref.forward(ids))
    exact, past = (_log_softmax(l) for l in logits)
    kl = (np.exp(exact) * (exact - past)).sum(axis=-1)
    return DtpError(tokens=tokens, kl=kl, top1=exact.argmax(-1) == past.argmax(-1))
