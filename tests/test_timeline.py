"""The profile summary (kiec.runtime.timeline) on stamps whose answers are known."""
import numpy as np
import pytest

from kiec.runtime.timeline import FIELDS, format_summary, summarize


def stamps(begin, waited, prologue, stream, epilogue, starved=0, stall=0, last=0):
    return [begin, waited, prologue, stream, epilogue, starved, stall, last]


def test_means_critical_path_and_producer_idle():
    t0 = 1_000_000                       # ns; the global timer does not start at zero
    raw = np.zeros((3, 2, len(FIELDS)), dtype=np.uint64)
    # stage 0 (qkv): block 0 ends at +10 us, block 1 at +12 us
    raw[0, 0] = stamps(t0, t0 + 1000, t0 + 2000, t0 + 8000, t0 + 10000, starved=500, stall=0)
    raw[0, 1] = stamps(t0, t0 + 2000, t0 + 3000, t0 + 10000, t0 + 12000, starved=1500, stall=2000)
    # stage 1 (attention): block 1 only, ends at +15 us
    raw[1, 1] = stamps(t0 + 12000, t0 + 13000, t0 + 13500, t0 + 14000, t0 + 15000)
    # stage 2 (qkv again): both blocks, ends at +20 us; block 0's producer stalled 3 us filling it
    raw[2, 0] = stamps(t0 + 15000, t0 + 16000, t0 + 17000, t0 + 19000, t0 + 20000, stall=3000)
    raw[2, 1] = stamps(t0 + 15000, t0 + 15500, t0 + 16500, t0 + 18500, t0 + 19500)
    s = summarize(raw, ["qkv", "attention", "qkv"])
    assert s["step_us"] == pytest.approx(20.0)
    assert s["producer_idle_share"] == pytest.approx((2000 + 3000) / (2 * 20000))
    qkv, att = s["kinds"]["qkv"], s["kinds"]["attention"]
    assert (qkv["stages"], qkv["tiles"], att["tiles"]) == (2, 4, 1)
    assert qkv["wait"] == pytest.approx((1 + 2 + 1 + 0.5) / 4)
    assert qkv["stream"] == pytest.approx((6 + 7 + 2 + 2) / 4)
    assert qkv["starved"] == pytest.approx((0.5 + 1.5) / 4)
    assert qkv["producer_stall"] == pytest.approx((2 + 3) / 4)     # per stage and block
    # each stage's share of the critical path: 12 us, then 3 us, then 5 us
    assert qkv["critical"] == pytest.approx(12 + 5) and att["critical"] == pytest.approx(3)
    assert qkv["spread"] == pytest.approx((2 + 0.5) / 2)            # last tile's end minus the first's
    assert s["timer_resolution_ns"] == pytest.approx(500)
    text = format_summary(s)
    assert "attention" in text and "20.0 us" in text


def test_an_unprofiled_launch_is_named():
    with pytest.raises(ValueError, match="no stamps"):
        summarize(np.zeros((2, 3, len(FIELDS)), dtype=np.uint64), ["qkv", "down"])
