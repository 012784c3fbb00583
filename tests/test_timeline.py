"""The profile summary (kiec.runtime.timeline) on stamps whose answers are known."""
import numpy as np
import pytest

from kiec.runtime.timeline import FIELDS, format_summary, summarize


def stamps(begin, waited, prologue, stream, epilogue, starved=0, stall=0, last=0, sm=0):
    return [begin, waited, prologue, stream, epilogue, starved, stall, last, sm]


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


def test_stage_rows_put_each_stage_on_the_step_s_clock(tmp_path, capsys):
    import json
    from kiec.runtime.timeline import main, stage_rows
    t0 = 5_000_000
    raw = np.zeros((2, 3, len(FIELDS)), dtype=np.uint64)
    for b, late in enumerate((0, 1000, 4000)):          # stage 0 on three blocks, ending 1 and 4 us apart
        raw[0, b] = stamps(t0, t0 + 500 + late, t0 + 1000 + late, t0 + 3000 + late, t0 + 4000 + late,
                           last=t0 + 2000 + late)
    raw[1, 2] = stamps(t0 + 8000, t0 + 9000, t0 + 9500, t0 + 10000, t0 + 12000)   # one tile, no chunks
    text = stage_rows(raw, ["qkv[layer 0]", "attention[layer 0]"], range(2))
    qkv, att = text.splitlines()[1:]
    assert qkv.split()[:3] == ["qkv[layer", "0]", "3"]
    assert "4.00/   5.00/   8.00" in qkv                 # epilogue ends: min / median / max in us
    assert "2.00/   3.00/   6.00" in qkv                 # the producer's last chunk
    assert att.split()[:3] == ["attention[layer", "0]", "1"] and att.rstrip().endswith("-")
    # the command line reads the names devcheck saves beside the stamps
    np.save(tmp_path / "profile-x.npy", raw)
    (tmp_path / "profile-x.json").write_text(json.dumps({"stages": ["qkv[layer 0]", "attention[layer 0]"]}))
    assert main([str(tmp_path / "profile-x.npy"), "--stages", "1-1"]) == 0
    out = capsys.readouterr().out
    assert "attention[layer 0]" in out and "qkv[layer 0]" not in out
    with pytest.raises(SystemExit):
        main([str(tmp_path / "profile-x.npy"), "--stages", "1-5"])
    assert "0 <= A <= B < 2" in capsys.readouterr().err


def test_late_blocks_tell_the_same_late_blocks_from_lateness_that_moves(tmp_path, capsys):
    """Block 2 (on multiprocessor 102) ends every gate_up 3 us after the others: its lateness is all its
    own. Lateness drawn afresh each layer is not: about 1 / stages of it is."""
    from kiec.runtime.timeline import late_blocks, main
    layers, blocks, t0 = 16, 8, 1_000_000
    kinds = ["gate_up", "down"] * layers
    rng = np.random.default_rng(3)
    for same, want in ((True, (0.95, 1.0)), (False, (0.0, 0.3))):
        raw = np.zeros((len(kinds), blocks, len(FIELDS)), dtype=np.uint64)
        for s in range(len(kinds)):
            for b in range(blocks):
                late = (3000 if b == 2 else 0) if same else int(rng.integers(0, 3000))
                raw[s, b] = stamps(t0, t0 + 100, t0 + 200, t0 + 900, t0 + 1000 + late + (b if same else 0),
                                   sm=100 + b)
        got = late_blocks(raw, kinds, "gate_up")
        assert got["stages"] == layers and got["blocks"] == blocks
        assert want[0] <= got["own"] <= want[1], (same, got["own"])
        if same:
            assert got["latest"][0][:2] == (2, 102) and got["latest"][0][2] == pytest.approx(3.0, abs=0.01)
    np.save(tmp_path / "profile-y.npy", raw)
    (tmp_path / "profile-y.json").write_text(__import__("json").dumps({"stages": [f"{k}[layer 0]" for k in kinds]}))
    assert main([str(tmp_path / "profile-y.npy"), "--late", "down"]) == 0
    assert "of the lateness is the block's own over 16 stages" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(tmp_path / "profile-y.npy"), "--late", "attention"])
    assert "expected a stage kind of this profile: gate_up, down" in capsys.readouterr().err
