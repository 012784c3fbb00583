"""devcheck's timing of several builds (kiec.devcheck.time_builds) on fake backends whose launch
times are known: rounds interleave the builds, medians are reported, and the profile is set beside
the unprofiled launches at its position."""
from itertools import groupby

import numpy as np
import pytest

from kiec.devcheck import PROFILE_AT, main, time_builds
from kiec.errors import KiecError
from kiec.runtime.timeline import FIELDS, summarize


class FakeBackend:
    """Launch times in ms per step: `per_step` plus `drift` more for every launch any build made before
    (a device that slows down over the run); the profiled step takes `profiled_us`."""
    launches = []                  # every build's launches, in order (shared: the interleaving)

    def __init__(self, name, per_step, drift, profiled_us):
        self.name, self.per_step, self.drift, self.profiled_us = name, per_step, drift, profiled_us

    def _launch(self, forced, n_steps, start, profile=False):
        self.n_steps = n_steps
        FakeBackend.launches.append((self.name, n_steps, start))

    def _finish(self):
        return self.n_steps * (self.per_step + self.drift * len(FakeBackend.launches))

    def profile(self, token, start, steps=8):
        assert start == PROFILE_AT
        raw = np.zeros((1, 1, len(FIELDS)), dtype=np.uint64)
        t0 = 1_000_000
        end = t0 + int(self.profiled_us * 1e3)
        raw[0, 0, :5] = [t0, t0 + 100, t0 + 200, end - 100, end]
        out = summarize(raw, ["qkv"])
        out.update(launch_ms=steps * self.per_step, raw=raw, step=steps // 2, steps=steps)
        return out


def test_rounds_interleave_the_builds_and_report_medians(tmp_path):
    FakeBackend.launches = []
    a = FakeBackend("a", per_step=0.80, drift=1e-5, profiled_us=900.0)
    b = FakeBackend("b", per_step=0.78, drift=1e-5, profiled_us=780.0)
    logged = []
    out = time_builds({"a": (a, 8192), "b": (b, 1024)}, rounds=3, out_dir=tmp_path, log=logged.append)
    # every round times all of a, then all of b
    assert [name for name, _ in groupby(FakeBackend.launches, key=lambda launch: launch[0])] == ["a", "b"] * 3
    # only the build whose context reaches 8192 is timed there
    assert ("a", 64, 8192 - 64) in FakeBackend.launches and not any(s == 8192 - 64 for n, _, s in FakeBackend.launches if n == "b")
    for name, build, profiled in (("a", a, 900.0), ("b", b, 780.0)):
        r = out[name]
        assert r["rounds"] == 3
        # a median of the drifting rounds sits near the build's own pace, and b stays ahead of a
        assert r["ms_per_token_one_launch"] == pytest.approx(build.per_step, rel=0.05)
        assert r["ms_per_token_8_steps"] == pytest.approx(build.per_step, rel=0.05)
        assert r["profile_overhead"] == pytest.approx(profiled / (1e3 * r["ms_per_token_8_steps"]) - 1)
        assert (tmp_path / f"profile-{name}.npy").exists()
    assert out["b"]["ms_per_token_one_launch"] < out["a"]["ms_per_token_one_launch"]
    assert out["a"]["profile_overhead"] > 0.1 and abs(out["b"]["profile_overhead"]) < 0.02
    assert any("profile of step 4 of 8" in line and "a step unprofiled" in line for line in logged)


def test_rounds_below_one_are_refused_before_any_device_work(tmp_path):
    with pytest.raises(KiecError, match="--rounds"):
        main(["--rounds", "0", "--out", str(tmp_path)])
