"""Token selection on the host: greedy, temperature, top-k, top-p, min-p, penalties, seed; stop strings.

Order (as in the common servers): penalties on the logits, then temperature, then the
filters in turn, each on the distribution the one before left (renormalised): top-k
(ties with the k-th token are kept), top-p (the smallest set of most probable tokens
whose mass reaches top_p), min-p (tokens at least min_p times the most probable one).
Then one draw from a `numpy.random.Generator` seeded per request (same seed, same
tokens). Logprobs are those of the model's own distribution (log-softmax of the raw
logits), as OpenAI reports them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from ..errors import KiecError, first_outside, is_int, is_number

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def _in_range(value, low, high, low_open=False) -> bool:
    if not is_number(value) or math.isnan(value):
        return False
    return (low < value if low_open else low <= value) and value <= high


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0        # 0: greedy
    top_k: int = 0                  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # on every token seen (prompt and completion), as in transformers
    presence_penalty: float = 0.0    # on completion tokens, as OpenAI defines them
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple = ()                # stop strings
    stop_token_ids: tuple = ()
    logprobs: int | None = None     # None: none; n: the chosen token's logprob and the n most likely
    ignore_eos: bool = False

    def __post_init__(self):
        for name in ("stop", "stop_token_ids"):
            if isinstance(getattr(self, name), list):      # frozen and hashable: keep tuples
                object.__setattr__(self, name, tuple(getattr(self, name)))

        def bad(name, expected):
            raise KiecError(name, getattr(self, name), expected)
        if not _in_range(self.temperature, 0, 100):
            bad("temperature", "a number in [0, 100] (0: greedy)")
        if not is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "an integer >= 0 (0: off)")
        if not _in_range(self.top_p, 0, 1):
            bad("top_p", "a number in [0, 1] (0 keeps the most probable token alone)")
        if not _in_range(self.min_p, 0, 1):
            bad("min_p", "a number in [0, 1]")
        if not _in_range(self.repetition_penalty, 0, 10, low_open=True):
            bad("repetition_penalty", "a number in (0, 10] (1: off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _in_range(getattr(self, name), -2, 2):
                bad(name, "a number in [-2, 2]")
        if self.seed is not None and (not is_int(self.seed) or not -2 ** 63 <= self.seed < 2 ** 64):
            bad("seed", "an integer in [-2**63, 2**64) or null")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "a positive integer")
        if (not isinstance(self.stop, tuple) or len(self.stop) > MAX_STOP_STRINGS
                or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop)):
            bad("stop", f"at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters")
        if not isinstance(self.stop_token_ids, tuple) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "token ids (integers >= 0)")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "an integer in [0, 20] or null")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "true or false")

    def check_vocab(self, vocab: int) -> None:
        """The stop token ids are the model's: a KiecError names the first past its vocabulary."""
        bad = first_outside(self.stop_token_ids, vocab)
        if bad is not None:
            raise KiecError("stop_token_ids", bad, f"token ids below the vocabulary size ({vocab})")

    @classmethod
    def names(cls) -> tuple:
        return tuple(f.name for f in fields(cls))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def log_softmax(logits) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


class Sampler:
    """One request's sampling state: its generator and the tokens it has produced."""

    def __init__(self, params: SamplingParams, eos_ids=()):
        self.params = params
        seed = params.seed % 2 ** 64 if params.seed is not None else np.random.SeedSequence().entropy
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.generated: list[int] = []

    def penalised(self, logits: np.ndarray, history) -> np.ndarray:
        """The logits after the repetition, presence and frequency penalties [vocab] (float64)."""
        p = self.params
        x = np.asarray(logits, dtype=np.float64).copy()
        if p.repetition_penalty != 1.0 and len(history):
            seen = np.unique(np.asarray(history, dtype=np.int64))
            x[seen] = np.where(x[seen] > 0, x[seen] / p.repetition_penalty, x[seen] * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self.generated:
            ids, counts = np.unique(np.asarray(self.generated, dtype=np.int64), return_counts=True)
            x[ids] -= p.presence_penalty + p.frequency_penalty * counts
        # a tiny repetition_penalty can divide a logit past float64's range, and inf - inf is NaN
        big = np.finfo(np.float64).max
        return np.clip(x, -big, big, out=x)

    def probabilities(self, logits: np.ndarray, history) -> np.ndarray:
        """The distribution the next token is drawn from, after every option [vocab] (float64)."""
        p = self.params
        x = self.penalised(logits, history)
        if p.greedy:
            out = np.zeros_like(x)
            out[int(np.argmax(x))] = 1.0
            return out
        probs = np.exp((x - x.max()) / p.temperature)
        probs /= probs.sum()
        if p.top_k and p.top_k < len(probs):
            kth = np.partition(probs, -p.top_k)[-p.top_k]
            probs = _renormalised(np.where(probs >= kth, probs, 0.0))
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cut = np.searchsorted(np.cumsum(probs[order]), p.top_p) + 1
            keep = np.zeros(len(probs), dtype=bool)
            keep[order[:cut]] = True
            probs = _renormalised(np.where(keep, probs, 0.0))
        if p.min_p > 0:
            probs = _renormalised(np.where(probs >= p.min_p * probs.max(), probs, 0.0))
        return probs

    def sample(self, logits: np.ndarray, history) -> tuple:
        """(token, logprob of it, {token: logprob} of the top alternatives)."""
        probs = self.probabilities(logits, history)
        if self.params.greedy:
            token = int(np.argmax(probs))
        else:
            token = int(self.rng.choice(len(probs), p=probs))
        self.generated.append(token)
        logprob, top = None, {}
        if self.params.logprobs is not None:
            logp = log_softmax(logits)
            logprob = float(logp[token])
            if self.params.logprobs:
                best = np.argsort(-logp, kind="stable")[: self.params.logprobs]
                top = {int(t): float(logp[t]) for t in best}
        return token, logprob, top

    def is_stop_token(self, token: int) -> bool:
        return token in self.stop_ids


def _renormalised(probs: np.ndarray) -> np.ndarray:
    return probs / probs.sum()


class StopStrings:
    """Cuts streamed text at the first stop string. Any tail that could still begin one
    is held back, so no part of a stop string is ever emitted, even one split across tokens."""

    def __init__(self, stops=()):
        self.stops = tuple(stops)
        self.held = ""

    def push(self, piece: str) -> tuple[str, bool]:
        """(text that is safe to emit now, whether a stop string was reached)."""
        text = self.held + piece
        hits = [at for at in (text.find(s) for s in self.stops) if at >= 0]
        if hits:
            self.held = ""
            return text[: min(hits)], True
        keep = max((n for s in self.stops for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:n])), default=0)
        self.held = text[len(text) - keep:]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back text, when generation ends without reaching a stop string."""
        out, self.held = self.held, ""
        return out
