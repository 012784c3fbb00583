"""devcheck's timing of several builds (kiec.devcheck.time_builds) on fake backends whose launch
times are known: rounds interleave the builds, medians are reported, the profile is set beside the
unprofiled launches at its position, and a build that fails leaves the others timed."""
import json
from itertools import groupby

import numpy as np
import pytest

from kiec.devcheck import PROFILE_AT, main, time_builds
from kiec.errors import KiecError
from kiec.runtime.timeline import FIELDS, summarize

ROUND_PACE = [1.00, 1.50, 1.02]     # the device's pace in each round: round 1 is an outlier


class FakeBackend:
    """A step takes `per_step` ms times the round's pace (the round counts this build's 256-step
    launches); the profiled step takes `profiled_us`; `fail_in_round` raises there."""
    launches = []                  # every build's launches, in order (shared: the interleaving)

    def __init__(self, name, per_step, profiled_us, fail_in_round=None):
        self.name, self.per_step, self.profiled_us, self.fail_in_round = name, per_step, profiled_us, fail_in_round
        self.round = -1

    def _launch(self, forced, n_steps, start, profile=False):
        if n_steps == 256:         # time_round's one long launch: a new round begins
            self.round += 1
        if self.round == self.fail_in_round:
            raise RuntimeError("a wait timed out")
        self.n_steps = n_steps
        FakeBackend.launches.append((self.name, n_steps, start))

    def _finish(self):
        pace = ROUND_PACE[self.round] if self.round >= 0 else ROUND_PACE[0]
        return self.n_steps * self.per_step * pace

    def profile(self, token, start, steps=8):
        self.profiled_at = start
        raw = np.zeros((3, 2, len(FIELDS)), dtype=np.uint64)
        t0 = 1_000_000
        end = t0 + int(self.profiled_us * 1e3)
        raw[0, :, :5] = [t0, t0 + 100, t0 + 200, end - 100, end]
        raw[1:, :, :5] = [t0, t0 + 100, t0 + 200, t0 + 300, t0 + 400]
        raw[1:, 1, 4] += 500                        # block 1 ends both gate_up stages last
        out = summarize(raw, ["qkv", "gate_up", "gate_up"])
        out.update(launch_ms=steps * self.per_step, raw=raw, step=steps // 2, steps=steps, stage_names=STAGE_NAMES)
        return out


STAGE_NAMES = ["qkv[layer 0]", "gate_up[layer 0]", "gate_up[layer 1]"]


def test_rounds_interleave_the_builds_and_report_medians(tmp_path):
    FakeBackend.launches = []
    a = FakeBackend("a", per_step=0.80, profiled_us=900.0)
    b = FakeBackend("b", per_step=0.78, profiled_us=780.0)
    logged = []
    out = time_builds({"a": (a, 8192), "b": (b, 1024)}, rounds=3, out_dir=tmp_path, log=logged.append)
    # every round times all of a, then all of b
    assert [name for name, _ in groupby(FakeBackend.launches, key=lambda launch: launch[0])] == ["a", "b"] * 3
    # only the build whose context reaches 8192 is timed there
    assert ("a", 64, 8192 - 64) in FakeBackend.launches
    assert not any(start == 8192 - 64 for name, _, start in FakeBackend.launches if name == "b")
    for name, build in (("a", a), ("b", b)):
        r = out[name]
        assert r["rounds"] == 3
        # the median round (1.02): not the first (1.00), the mean (1.17) or the outlier (1.50)
        assert r["ms_per_token_one_launch"] == pytest.approx(build.per_step * 1.02, rel=1e-6)
        assert r["ms_per_token_8_steps"] == pytest.approx(build.per_step * 1.02, rel=1e-6)
        assert r["profile_overhead"] == pytest.approx(build.profiled_us / (1e3 * build.per_step * 1.02) - 1)
        assert (tmp_path / f"profile-{name}.npy").exists()
        assert json.loads((tmp_path / f"profile-{name}.json").read_text()) == {"stages": STAGE_NAMES}
        assert "gate_up: 1.00 of the lateness is the block's own over 2 stages" in r["profile_text"]
    assert out["a"]["profile_overhead"] > 0.1 and out["b"]["profile_overhead"] < 0
    assert a.profiled_at == b.profiled_at == PROFILE_AT and ("a", 8, PROFILE_AT) in FakeBackend.launches
    assert any("profile of step 4 of 8" in line and "a step unprofiled" in line for line in logged)


def test_a_build_that_fails_leaves_the_others_timed(tmp_path):
    FakeBackend.launches = []
    good = FakeBackend("good", per_step=0.80, profiled_us=800.0)
    bad = FakeBackend("bad", per_step=0.80, profiled_us=800.0, fail_in_round=1)
    logged = []
    out = time_builds({"bad": (bad, 1024), "good": (good, 1024)}, rounds=3, out_dir=None, log=logged.append)
    assert "timed out" in out["bad"]["timing_error"] and "ms_per_token_one_launch" not in out["bad"]
    assert out["good"]["ms_per_token_one_launch"] == pytest.approx(0.80 * 1.02, rel=1e-6)
    assert sum(1 for name, n, _ in FakeBackend.launches if name == "bad" and n == 256) == 1   # not retried
    assert any("bad: timing FAILED" in line for line in logged)


def test_rounds_below_one_are_refused_before_any_device_work(tmp_path):
    with pytest.raises(KiecError, match="--rounds"):
        main(["--rounds", "0", "--out", str(tmp_path)])


def test_positions_are_timed_where_the_model_reaches_them(tmp_path):
    FakeBackend.launches = []
    short = FakeBackend("short", per_step=0.70, profiled_us=700.0)
    logged = []
    out = time_builds({"short": (short, 1024)}, rounds=3, out_dir=None, log=logged.append, positions=(300, 1020))
    assert out["short"]["ms_per_token_at_300"] == pytest.approx(0.70 * 1.02, rel=1e-6)
    assert "ms_per_token_at_1020" not in out["short"]            # 8 steps from 1020 pass the model's 1024
    assert ("short", 8, 300) in FakeBackend.launches and not any(start == 1020 for _, _, start in FakeBackend.launches)
    assert any("from position 300: 0.7140" in line for line in logged)


def test_positions_must_be_whole_numbers(tmp_path):
    with pytest.raises(KiecError, match="--positions"):
        main(["--positions", "128,abc", "--out", str(tmp_path)])


def test_the_profile_and_its_8_step_launches_go_where_asked(tmp_path):
    FakeBackend.launches = []
    long = FakeBackend("long", per_step=0.90, profiled_us=900.0)
    out = time_builds({"long": (long, 8192)}, rounds=3, out_dir=None, log=lambda msg: None, profile_at=8100)
    assert long.profiled_at == 8100 and ("long", 8, 8100) in FakeBackend.launches
    assert not any(start == PROFILE_AT for _, _, start in FakeBackend.launches)
    assert out["long"]["ms_per_token_8_steps"] == pytest.approx(0.90 * 1.02, rel=1e-6)


def test_a_profile_past_a_models_length_is_refused_before_any_device_work(tmp_path):
    # Qwen-1.5B is built for 1,024 positions: 8 steps from 1,020 would run past them
    with pytest.raises(KiecError, match="--profile-at.*0 to 1016.*qwen2.5-1.5b"):
        main(["--models", "qwen2.5-1.5b", "--profile-at", "1020", "--out", str(tmp_path)])
    with pytest.raises(KiecError, match="--profile-at"):
        main(["--models", "llama-3.2-1b", "--profile-at", "-1", "--out", str(tmp_path)])
