"""The DTP approximation report: past(d) on a standard model against the exact model, on the reference."""
from __future__ import annotations

import numpy as np
import pytest

from kiec.cli import main
from kiec.dtp_error import dtp_error
from kiec.errors import KiecError
from kiec.model import load_spec


def test_past_moves_a_standard_model_and_the_report_says_how_far(tiny_llama):
    spec = load_spec(str(tiny_llama), {"lanes": 2, "dtp_delay": 1, "max_seq_len": 64})
    err = dtp_error(spec, tokens=20, seed=1)
    assert err.kl.shape == (20,) and err.top1.shape == (20,)
    assert np.all(np.isfinite(err.kl)) and np.all(err.kl >= -1e-9)
    assert err.kl.max() > 1e-6                                  # a different model, not a copy of the exact one
    # the report's numbers from the two models' logits, computed here: KL(exact || past) and top-1
    from kiec.pipeline import build_graph
    from kiec.reference.interpreter import Reference, reference_weights
    from kiec.weights import load_checkpoint
    ids = np.random.default_rng(1).integers(spec.config.vocab, size=20)
    ckpt = load_checkpoint(spec)
    logp = []
    for variant in (spec.replace(dtp_delay=None), spec):
        graph = build_graph(variant)
        x = Reference(graph, reference_weights(graph, ckpt), variant.config, 20, np.float32).forward(ids)
        x = np.asarray(x, np.float64)
        logp.append(x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)))
    p_exact = np.exp(logp[0])
    assert err.kl == pytest.approx((p_exact * (logp[0] - logp[1])).sum(-1), rel=1e-5, abs=1e-9)
    assert (err.top1 == (logp[0].argmax(-1) == logp[1].argmax(-1))).all()
    text = err.summary(spec)
    assert text.startswith("dtp error  past(1) at 2 lanes vs exact, teacher-forced on 20 random tokens: KL")


def test_exact_or_one_lane_models_are_refused(tiny_llama):
    with pytest.raises(KiecError, match="dtp_delay: got None; expected a delay d >= 1"):
        dtp_error(load_spec(str(tiny_llama), {"lanes": 2}))
    with pytest.raises(KiecError, match="lanes: got 1; expected at least 2"):
        dtp_error(load_spec(str(tiny_llama), {"dtp_delay": 1}))


def test_inspect_prints_the_report(tiny_llama, capsys):
    assert main(["inspect", str(tiny_llama), "--lanes", "2", "--dtp-delay", "1", "--dtp-error", "--tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "WARNING    past(1) on a llama model not trained with delay" in out
    assert out.splitlines()[-1].startswith("dtp error  past(1) at 2 lanes vs exact, teacher-forced on 8 random tokens")
