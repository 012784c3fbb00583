"""Token selection on the host: greedy, temperature, top-k, top-p, min-p, penalties, seed.

Order (as in the common servers): penalties on the logits, then temperature, then
top-k, top-p and min-p filters on the probabilities, then one draw from a
`numpy.random.Generator` seeded per request (same seed, same tokens). Logprobs are
those of the model's own distribution (log-softmax of the raw logits).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from ..errors import KiecError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0        # 0: greedy
    top_k: int = 0                  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple = ()                # stop strings
    stop_token_ids: tuple = ()
    logprobs: int | None = None     # how many top alternatives to report
    ignore_eos: bool = False

    def __post_init__(self):
        def bad(name, expected):
            raise KiecError(name, getattr(self, name), expected)
        num = (int, float)
        if not isinstance(self.temperature, num) or not 0 <= self.temperature <= 100 or math.isnan(self.temperature):
            bad("temperature", "a number in [0, 100]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "an integer >= 0 (0: off)")
        if not isinstance(self.top_p, num) or not 0 < self.top_p <= 1:
            bad("top_p", "a number in (0, 1]")
        if not isinstance(self.min_p, num) or not 0 <= self.min_p <= 1:
            bad("min_p", "a number in [0, 1]")
        if not isinstance(self.repetition_penalty, num) or not 0 < self.repetition_penalty <= 10:
            bad("repetition_penalty", "a number in (0, 10]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not isinstance(getattr(self, name), num) or not -2 <= getattr(self, name) <= 2:
                bad(name, "a number in [-2, 2]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad("seed", "an integer or null")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "a positive integer")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "token ids (integers >= 0)")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= 20):
            bad("logprobs", "an integer in [0, 20] or null")

    @classmethod
    def names(cls) -> tuple:
        return tuple(f.name for f in fields(cls))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """One request's sampling state: its generator and the tokens it has produced."""

    def __init__(self, params: SamplingParams, eos_ids=()):
        self.params = params
        seed = params.seed if params.seed is not None else np.random.SeedSequence().entropy
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.generated: list[int] = []

    def probabilities(self, logits: np.ndarray, history) -> np.ndarray:
        """The distribution the next token is drawn from, after every option [vocab] (float64)."""
        p = self.params
        x = np.asarray(logits, dtype=np.float64).copy()
        if p.repetition_penalty != 1.0 and len(history):
            seen = np.unique(np.asarray(history, dtype=np.int64))
            x[seen] = np.where(x[seen] > 0, x[seen] / p.repetition_penalty, x[seen] * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self.generated:
            ids, counts = np.unique(np.asarray(self.generated, dtype=np.int64), return_counts=True)
            x[ids] -= p.presence_penalty + p.frequency_penalty * counts
        if p.greedy:
            out = np.zeros_like(x)
            out[int(np.argmax(x))] = 1.0
            return out
        x = x / p.temperature
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        keep = np.ones(len(probs), dtype=bool)
        if p.top_k and p.top_k < len(probs):
            kth = np.partition(probs, -p.top_k)[-p.top_k]
            keep &= probs >= kth
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            cut = np.searchsorted(cum, p.top_p) + 1      # smallest set whose mass reaches top_p
            mask = np.zeros(len(probs), dtype=bool)
            mask[order[:cut]] = True
            keep &= mask
        if p.min_p > 0:
            keep &= probs >= p.min_p * probs.max()
        probs = np.where(keep, probs, 0.0)
        return probs / probs.sum()

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
            x = np.asarray(logits, dtype=np.float64)
            logp = x - x.max() - np.log(np.exp(x - x.max()).sum())
            logprob = float(logp[token])
            if self.params.logprobs:
                best = np.argsort(-logp, kind="stable")[: self.params.logprobs]
                top = {int(t): float(logp[t]) for t in best}
        return token, logprob, top

    def is_stop_token(self, token: int) -> bool:
        return token in self.stop_ids

    def stop_string(self, text: str, new: int):
        """Index in `text` where a stop string begins, if one ends in the last `new` characters."""
        best = None
        for s in self.params.stop:
            at = text.find(s, max(0, len(text) - new - len(s) + 1))
            if at >= 0 and (best is None or at < best):
                best = at
        return best
