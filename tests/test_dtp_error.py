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
