"""`kiec bench`: the floor / share / speedup arithmetic and the table on given measurements (any
machine), the command's argument checks and its one-line failure without a GPU; on the GPU (marked
gpu) a whole run on a tiny model with every row."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from kiec.bench import BenchModel, BenchOptions
from kiec.bench_report import PEERS, ROWS, format_table, summarize
from kiec.cli import main
from kiec.runtime.gpu import gpu_available

# 2.0 GB per token over a 4.0 TB/s best read: a floor of exactly 0.5 ms/token
MEASURED = {"kiec per-step": 0.8, "kiec per-sequence": 0.625, "torch graph": 2.0, "torch.compile graph": 1.25,
            "HF generate": 50.0}


def _raw(rows=MEASURED) -> dict:
    return {"model": "llama-3.2-1b", "arch": "llama", "dtype": "bf16", "steps": 128, "device": "NVIDIA H200",
            "bandwidth": {"bytes": 2_470_000_000, "best_bps": 4.0e12, "median_bps": 3.8e12,
                          "median_ms": 0.65, "best_ms": 0.6175},
            "contexts": [{"context": 128,
                          "bytes_per_token": {"weights": 1_990_000_000, "kv_cache": 10_000_000, "total": 2_000_000_000,
                                              "per_lane_weights": 0, "shared": 0},
                          "measured": {name: {"ms_per_token": ms} for name, ms in rows.items()}}]}


def _line(table: str, name: str) -> list:
    return next(l for l in table.splitlines() if l.startswith(name + " ")).split()


def test_floor_share_and_speedups():
    summary = summarize(_raw())
    ctx = summary["contexts"][0]
    assert summary["floor_bandwidth"] == "best_bps"
    assert ctx["floor_ms"] == pytest.approx(0.5)
    rows = {r["name"]: r for r in ctx["rows"]}
    assert list(rows) == list(ROWS)
    seq = rows["kiec per-sequence"]
    assert seq["tok_s"] == pytest.approx(1600.0)
    assert seq["floor_share"] == pytest.approx(0.8)                       # 0.5 / 0.625
    assert seq["speedup"] == pytest.approx({"torch graph": 3.2, "torch.compile graph": 2.0, "HF generate": 80.0})
    assert rows["kiec per-step"]["floor_share"] == pytest.approx(0.625)
    assert rows["torch graph"]["speedup"] == pytest.approx({"torch.compile graph": 0.625, "HF generate": 25.0})
    assert rows["HF generate"]["tok_s"] == pytest.approx(20.0)
    assert json.loads(json.dumps(summary)) == summary                       # what --json writes


def test_table_rows_and_columns():
    table = format_table(summarize(_raw()))
    assert table.splitlines()[0] == ("kiec bench: llama-3.2-1b (llama, bf16) on NVIDIA H200, "
                                     "128 steps per measurement")
    assert "context 128: 2.0000 GB per token (weights 1.9900 GB + KV cache 10.00 MB)" in table
    header = next(l for l in table.splitlines() if "ms/token" in l)
    assert header.split("  ")[-3:] == ["vs torch graph", "vs torch.compile graph", "vs HF generate"]
    assert _line(table, "bandwidth")[:6] == ["bandwidth", "4.000", "TB/s", "best", "read,", "3.800"]
    assert _line(table, "floor") == ["floor", "0.5000", "2000.0", "100.0%"]
    assert _line(table, "kiec per-sequence") == ["kiec", "per-sequence", "0.6250", "1600.0", "80.0%",
                                                 "3.20x", "2.00x", "80.00x"]
    assert _line(table, "torch.compile graph") == ["torch.compile", "graph", "1.2500", "800.0", "40.0%",
                                                   "1.60x", "-", "40.00x"]
    assert _line(table, "HF generate") == ["HF", "generate", "50.0000", "20.0", "1.0%", "0.04x", "0.03x", "-"]
    built = format_table(summarize(dict(_raw(), options={"kernel_options": "stream_copies_in_flight=4"})))
    assert built.splitlines()[0].endswith("128 steps per measurement, kiec built with stream_copies_in_flight=4")


def test_table_without_peers():
    kiec_only = {k: v for k, v in MEASURED.items() if k not in PEERS}
    table = format_table(summarize(_raw(kiec_only)))
    assert "vs " not in table
    assert _line(table, "kiec per-step") == ["kiec", "per-step", "0.8000", "1250.0", "62.5%"]
    assert not any(l.startswith(p) for p in PEERS for l in table.splitlines())


def test_a_run_stopped_halfway_keeps_what_it_measured(tmp_path, monkeypatch, capsys):
    """The GPU part stands in here: it saves kiec's rows at 128, then is stopped (^C) in a peer's
    autotuning. --json holds those rows, marked partial, and the table of them is printed."""
    import kiec.bench as bench
    out = tmp_path / "bench.json"

    def stopped(model, options, log, save):
        raw = _raw({k: v for k, v in MEASURED.items() if k.startswith("kiec")})
        save(raw)
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "require_gpu", lambda peers: None)
    monkeypatch.setattr(bench, "run_bench", stopped)
    assert main(["bench", "llama-3.2-1b", "--contexts", "128", "--no-prefill", "--json", str(out)]) == 130
    summary = json.loads(out.read_text())
    assert summary["partial"] is True and not (tmp_path / "bench.json.part").exists()
    assert [r["name"] for r in summary["contexts"][0]["rows"]] == ["kiec per-step", "kiec per-sequence"]
    assert summary["contexts"][0]["rows"][1]["floor_share"] == pytest.approx(0.8)
    table = capsys.readouterr().out
    assert "partial: the run stopped before its last measurement" in table
    assert _line(table, "kiec per-sequence")[:5] == ["kiec", "per-sequence", "0.6250", "1600.0", "80.0%"]


def test_lane_rows_share_speedup_and_table():
    raw = _raw()
    raw["lanes"] = [{"lanes": 1, "mode": "exact TP", "placement": "one-launch", "context": 128, "blocks": 132,
                     "ms_per_token": 0.625, "ms_per_token_per_step": 0.7, "exchange_bytes_per_lane": 0},
                    {"lanes": 8, "mode": "DTP past(2)", "placement": "shared", "context": 128, "blocks": 128,
                     "ms_per_token": 1.0, "ms_per_token_per_step": 1.1, "exchange_bytes_per_lane": 917504},
                    {"lanes": 8, "mode": "DTP past(2)", "placement": "spread", "context": 128,
                     "not_run": "needs 8 GPUs, this machine has 1"}]
    raw["nccl"] = [{"lanes": 1, "context": 128, "ms_per_token": 1.25},
                   {"lanes": 8, "context": 128, "not_run": "needs 8 GPUs, this machine has 1"}]
    summary = summarize(raw)
    assert [r.get("floor_share") for r in summary["lanes"]] == pytest.approx([0.8, 0.5, None])
    assert summary["lanes"][0]["speedup_vs_nccl"] == pytest.approx(2.0)
    assert "speedup_vs_nccl" not in summary["lanes"][1]          # no baseline at 8 lanes on this machine
    assert summary["nccl"][0]["floor_share"] == pytest.approx(0.4)
    table = format_table(summary).splitlines()
    row = next(l for l in table if "DTP past(2)" in l and "shared" in l).split()
    assert row == ["8", "DTP", "past(2)", "shared", "128", "128", "1.0000", "1000.0", "50.0%", "917.5", "kB", "-"]
    assert next(l for l in table if "one-launch" in l and "exact TP" in l).split()[-1] == "2.00x"
    assert next(l for l in table if "spread" in l and "past" in l).endswith("not run: needs 8 GPUs, this machine has 1")
    assert table[-2].split() == ["1", "128", "1.2500", "800.0", "40.0%"]
    assert table[-1].split()[:4] == ["8", "128", "not", "run:"]


def test_spread_rows_have_no_share_of_one_gpus_floor_and_the_columns_line_up():
    raw = _raw()
    raw["lanes"] = [{"lanes": 8, "mode": "exact TP", "placement": "spread", "context": 128, "blocks": 1056,
                     "ms_per_token": 0.2, "ms_per_token_per_step": 0.25, "exchange_bytes_per_lane": 1892400}]
    raw["nccl"] = [{"lanes": 8, "context": 128, "ms_per_token": 0.3}]
    summary = summarize(raw)
    assert "floor_share" not in summary["lanes"][0] and "floor_share" not in summary["nccl"][0]
    table = format_table(summary).splitlines()
    header = next(l for l in table if "sent/lane/token" in l)
    row = next(l for l in table if "spread" in l and "exact TP" in l)
    assert row.split()[-4:] == ["-", "1892.4", "kB", "1.50x"]
    for column in ("ms/token", "% floor", "sent/lane/token", "vs NCCL"):       # right-aligned under its header
        end = header.index(column) + len(column)
        assert row[end - 1] != " " and (end == len(row) or row[end] == " "), column


def test_a_failed_peer_is_a_row_that_says_so():
    from kiec.bench import peer_row

    def out_of_memory():
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
    raw = _raw()
    raw["contexts"][0]["measured"]["torch.compile graph"] = peer_row(out_of_memory)
    summary = summarize(raw)
    rows = {r["name"]: r for r in summary["contexts"][0]["rows"]}
    assert rows["torch.compile graph"] == {"name": "torch.compile graph",
                                           "not_run": "failed: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"}
    assert set(rows["kiec per-sequence"]["speedup"]) == {"torch graph", "HF generate"}
    table = format_table(summary)
    assert "torch.compile graph     not run: failed: RuntimeError: CUDA out of memory" in table
    assert "vs torch.compile graph" not in table
    assert peer_row(lambda: {"ms_per_token": 1.0}) == {"ms_per_token": 1.0}


def test_prefill_floor_share_speedup_and_table():
    from kiec.bench_prefill import layer_matrix_params
    from kiec.synthetic import preset
    from kiec.model import arch_config
    cfg = arch_config("llama", preset("llama-3.2-1b"))
    spec = type("Spec", (), {"config": cfg})()
    assert layer_matrix_params(spec) == 16 * (2048 * 3072 + 2048 * 2048 + 3 * 2048 * 8192)    # 0.973 G
    raw = _raw()
    # 1 G matrix parameters, 2048 tokens, 400 TFLOP/s: a floor of 10.24 ms
    raw["prefill"] = {"matrix_rate": {"size": 8192, "ms": 2.75, "flops_per_s": 4.0e14}, "layer_matrix_params": 10 ** 9,
                      "kiec": {2048: {"ttft_ms": 20.48, "prefill_ms": 19.5, "repeats": 5}},
                      "torch": {2048: {"ttft_ms": 40.96, "repeats": 5}}}
    summary = summarize(raw)
    row = summary["prefill"]["rows"][0]
    assert row["floor_ms"] == pytest.approx(10.24) and row["floor_share"] == pytest.approx(0.5)
    assert row["speedup_vs_torch"] == pytest.approx(2.0) and row["prefill_tok_s"] == pytest.approx(2047 / 19.5e-3)
    table = format_table(summary)
    assert "time to first token" in table and "400 TFLOP/s" in table
    assert table.splitlines()[-1].split() == ["2048", "20.48", "19.50", "104974", "10.24", "50.0%", "40.96", "2.00x"]
    raw["prefill"] = {"off": "2 lanes: the prompt goes through the lanes' exchange in the decode kernel"}
    assert "time to first token: not measured (2 lanes" in format_table(summarize(raw))


def test_lane_modes_placements_and_exchange_bytes(tmp_path):
    from kiec.bench_lanes import exchange_bytes_per_lane
    from kiec.pipeline import build_schedule
    model = BenchModel("llama-3.2-1b", BenchOptions(contexts=(16,), steps=8, peers=False, lanes=(1, 8), dtp_delay=2,
                                                    placements=("one-launch", "shared")), tmp_path)
    rows = [(n, mode, placement, spec.lanes, spec.gpus, spec.dtp_delay) for n, mode, placement, spec in model.lane_specs]
    assert rows == [(1, "exact TP", "one-launch", 1, 1, None),
                    (8, "exact TP", "one-launch", 8, 1, None), (8, "exact TP", "shared", 8, 8, None),
                    (8, "DTP past(2)", "one-launch", 8, 1, 2), (8, "DTP past(2)", "shared", 8, 8, 2)]
    # exact: 16 layers x 2 sublayers x 2048 floats x 7 peers; past(2): the last 2 layers' partials are never
    # read; across devices one more full-width row per peer: the last residual, mirrored for the LM head
    for (_, _, _, spec), sends in zip(model.lane_specs[1:], (32, 33, 28, 29)):
        assert exchange_bytes_per_lane(build_schedule(spec, 128 // spec.gpus)[1]) == sends * 2048 * 4 * 7
    assert exchange_bytes_per_lane(build_schedule(model.lane_specs[0][3], 132)[1]) == 0


def test_placements_that_need_more_gpus_are_rows_that_say_so(tmp_path, monkeypatch):
    from kiec import bench_lanes
    from kiec.runtime import gpu
    monkeypatch.setattr(gpu, "gpu_count", lambda: 1)
    options = BenchOptions(contexts=(16, 32), steps=8, lanes=(2,), placements=("spread",), prompts=())
    model = BenchModel("tiny-llama", options, tmp_path)
    rows = list(bench_lanes.time_lanes(model, None, options, None, lambda m: None))
    assert [(r["lanes"], r["placement"], r["context"]) for r in rows] == [(2, "spread", 16), (2, "spread", 32)]
    assert all(r["not_run"] == "needs 2 GPUs, this machine has 1" for r in rows)
    assert [r["not_run"] for r in bench_lanes.time_nccl(model, options, lambda m: None)] == ["needs 2 GPUs, this machine has 1"] * 2


def test_unknown_row_is_refused():
    with pytest.raises(ValueError, match="unknown bench rows"):
        summarize(_raw(dict(MEASURED, vllm=1.0)))


def test_help_works_without_torch():
    code = ("import sys\nfrom kiec.cli import main\ntry:\n    main(['bench', '--help'])\nexcept SystemExit as e:\n"
            "    print('exit', e.code)\nprint('torch imported:', 'torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    for flag in ("--contexts", "--steps", "--no-peers", "--hf", "--json", "llama-3.2-1b"):
        assert flag in run.stdout
    assert run.stdout.splitlines()[-2:] == ["exit 0", "torch imported: False"]


@pytest.mark.skipif(gpu_available(), reason="this machine has a GPU")
def test_without_a_gpu_one_error_line():
    run = subprocess.run([sys.executable, "-m", "kiec.cli", "bench", "tiny-llama", "--contexts", "16", "--steps", "8",
                          "--prompts", "64,256"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.splitlines() == ["kiec: error: device: got 'no GPU'; expected an NVIDIA GPU with nvidia-smi "
                                       "and nvcc (kiec bench times kernels on it)"]


@pytest.mark.parametrize("args, message", [
    (["tiny-llama", "--contexts", "128,8192"], "--contexts: got 8192; expected context + steps (8320) at most the "
                                               "model's max_position_embeddings (512)"),
    (["tiny-llama", "--contexts", "16", "--prompts", "8192"],
     "--prompts: got 8192; expected prompts of at most the model's max_position_embeddings (512) tokens (shorter "
     "--prompts, or --no-prefill)"),
    (["tiny-llama", "--contexts", "16", "--prompts", "1"], "--prompts: got (1,); expected prompt lengths of at least 2"),
    (["tiny-llama", "--contexts", "16", "--prompts", "a"], "--prompts: got 'a'; expected comma-separated integers"),
    (["tiny-llama", "--contexts", "16,x"], "--contexts: got '16,x'; expected comma-separated integers, e.g. 128,8192"),
    (["tiny-llama", "--contexts", "0"], "--contexts: got (0,); expected positive context lengths"),
    (["tiny-llama", "--steps", "1"], "--steps: got 1; expected an integer of at least 2"),
    (["tiny-llama", "--contexts", "16,16", "--no-prefill"], "--contexts: got (16, 16); expected each context once"),
    (["tiny-llama", "--contexts", "16", "--prompts", "64,64"], "--prompts: got (64, 64); expected each prompt length once"),
    (["tiny-llama", "--contexts", "16", "--no-prefill", "--seed", "-1"], "--seed: got -1; expected an integer >= 0"),
    (["tiny-lama"], "model: got 'tiny-lama'; expected a model.json, a model folder, a safetensors or GGUF file, smollm2 or a "
                    "synthetic preset (llama-3.2-1b, "),
    (["laneformer-2b", "--contexts", "16"], "model: got 'laneformer-2b'; expected a llama, qwen2 or mistral model "
                                            "for the torch peers (pass --no-peers to time kiec alone)"),
    (["tiny-llama", "--contexts", "16", "--no-prefill", "--lanes", "2,x"], "--lanes: got '2,x'; expected comma-separated integers"),
    (["tiny-llama", "--contexts", "16", "--no-prefill", "--lanes", "2", "--placement", "one-launch,everywhere"],
     "--placement: got 'one-launch,everywhere'; expected a comma-separated choice of one-launch, shared, spread"),
    (["tiny-llama", "--contexts", "16", "--no-prefill", "--lanes", "2,2"], "--lanes: got (2, 2); expected each lane count once"),
    (["tiny-llama", "--contexts", "16", "--no-prefill", "--lanes", "0"], "--lanes: got (0,); expected positive lane counts"),
    (["tiny-llama", "--contexts", "16", "--no-prefill", "--lanes", "3", "--no-peers"], "lanes: got 3; expected a divisor of"),
    (["tiny-llama", "--contexts", "16", "--no-prefill", "--dtp-delay", "1"], "--dtp-delay: got 1; expected --lanes as well"),
    (["tiny-llama", "--contexts", "16", "--no-prefill", "--lanes", "2", "--dtp-delay", "5", "--no-peers"],
     "dtp_delay: got 5; expected a delay smaller than the layer count (2)"),
    (["tiny-llama", "--contexts", "16,32", "--no-prefill", "--compile-at", "64"],
     "--compile-at: got (64,); expected some of the timed contexts (16, 32)"),
    (["tiny-llama", "--contexts", "16", "--no-prefill", "--compile-at", "x"],
     "--compile-at: got 'x'; expected comma-separated integers, e.g. 128"),
    (["tiny-llama", "--contexts", "16", "--no-prefill", "--compile-at", "16", "--no-compile"],
     "--compile-at: got (16,); expected the torch.compile peer timed (not --no-compile or --no-peers)"),
    (["tiny-llama", "--contexts", "16", "--no-prefill", "--json", "/no/such/folder/out.json"],
     "--json: got '/no/such/folder/out.json'; expected a file in an existing folder"),
    (["tiny-llama", "--contexts", "16", "--no-prefill", "--options", "foo=1"], "option: got 'foo'; expected one of "),
    (["tiny-llama", "--contexts", "16", "--no-prefill", "--options", "slot_pairs=2"], "slot_pairs: got 2; expected 0"),
    (["tiny-llama", "--contexts", "16", "--no-prefill", "--options", "slot_pairs=0", "--lanes", "2"],
     "--options: got 'slot_pairs=0'; expected unset with --lanes"),
])
def test_argument_errors(capsys, args, message):
    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiec: error: " + message), err
    assert len(err.splitlines()) == 1


def test_the_default_contexts_and_prompts_are_lowered_to_the_model_s_positions(tmp_path):
    """tiny-llama has 512 positions: the defaults become contexts 128 and 384 (with 128 steps) and one
    prompt of 512; what was given is not lowered (test_argument_errors)."""
    defaults = BenchOptions(fit_contexts=True, fit_prompts=True, compile_at=(8192,))
    model = BenchModel("tiny-llama", defaults, tmp_path)
    assert (model.options.contexts, model.options.compile_at, model.options.prompts) == ((128, 384), (384,), (512,))
    assert model.spec.max_seq_len == 512
    given = BenchOptions(contexts=(16,), steps=8, prompts=(100,), fit_contexts=True, fit_prompts=True)
    (tmp_path / "given").mkdir()
    assert BenchModel("tiny-llama", given, tmp_path / "given").options == given     # already fits: unchanged


@pytest.mark.skipif(gpu_available(), reason="this machine has a GPU")
def test_the_lowered_defaults_are_said_before_the_gpu_check():
    run = subprocess.run([sys.executable, "-m", "kiec.cli", "bench", "tiny-llama"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        "[kiec bench] contexts 128,384, prompts 512 (the defaults, lowered to the model's positions)",
        "kiec: error: device: got 'no GPU'; expected an NVIDIA GPU with nvidia-smi and nvcc (kiec bench times kernels on it)"]


def test_model_spec_fits_the_run(tmp_path, tiny_llama):
    options = BenchOptions(contexts=(16, 64), steps=8, prompts=())
    for name in ("tiny-llama", str(tiny_llama)):
        (tmp_path / "work").mkdir(exist_ok=True)
        assert BenchModel(name, options, tmp_path / "work").spec.max_seq_len == 72
    longer = BenchOptions(contexts=(16,), steps=8, prompts=(100, 300))
    assert BenchModel("tiny-llama", longer, tmp_path / "work").spec.max_seq_len == 300     # the longest prompt


def test_preset_folder_for_transformers_has_the_benchmarked_weights(tmp_path):
    from kiec.weights import load_checkpoint
    model = BenchModel("tiny-qwen2", BenchOptions(contexts=(16,), steps=8, seed=3, prompts=()), tmp_path)
    in_memory = model.checkpoint()
    on_disk = load_checkpoint(model.spec.replace(weights=model.hf_source()))
    for name in ("embed", "layers.1.wq", "layers.0.bk", "final_norm"):
        assert np.array_equal(in_memory.get(name), on_disk.get(name)), name


# --- GPU: one whole run ---------------------------------------------------------------------------

@pytest.mark.gpu
def test_bench_run_on_a_tiny_model(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "tiny-llama", "--contexts", "16,256", "--steps", "16", "--hf", "--json", str(out),
                 "--lanes", "1,2", "--dtp-delay", "1", "--placement", "one-launch,shared", "--prompts", "64,300",
                 "--compile-at", "16", "--quiet"]) == 0
    table = capsys.readouterr().out
    summary = json.loads(out.read_text())
    assert "partial" not in summary and "partial" not in table      # the run's end rewrote the progress
    assert summary["bandwidth"]["best_bps"] > 1e12              # any HBM GPU reads over 1 TB/s
    assert [c["context"] for c in summary["contexts"]] == [16, 256]
    for ctx in summary["contexts"]:                            # torch.compile at 16 only (--compile-at)
        assert [r["name"] for r in ctx["rows"]] == [r for r in ROWS if ctx["context"] == 16 or r != "torch.compile graph"]
        for row in ctx["rows"]:
            assert math.isfinite(row["ms_per_token"]) and row["ms_per_token"] > 0
            assert 0 < row["floor_share"] < 1, row                # ~100 kB of weights: launch latency dominates
        assert f"context {ctx['context']}:" in table
    assert summary["contexts"][1]["bytes_per_token"]["kv_cache"] > summary["contexts"][0]["bytes_per_token"]["kv_cache"]
    lanes = [(r["lanes"], r["mode"], r["placement"], r["context"]) for r in summary["lanes"]]
    assert lanes == [(1, "exact TP", "one-launch", c) for c in (16, 256)] + [
        (2, mode, placement, c) for mode in ("exact TP", "DTP past(1)") for placement in ("one-launch", "shared")
        for c in (16, 256)]
    assert all(math.isfinite(r["ms_per_token"]) and r["ms_per_token"] > 0 for r in summary["lanes"])
    nccl = {(r["lanes"], r["context"]): r for r in summary["nccl"]}          # the baseline where GPUs allow
    assert all(nccl[(1, c)]["ms_per_token"] > 0 and ("not_run" in nccl[(2, c)] or nccl[(2, c)]["ms_per_token"] > 0)
               for c in (16, 256))
    assert "NCCL baseline" in table
    prefill = summary["prefill"]
    assert [r["tokens"] for r in prefill["rows"]] == [64, 300] and "time to first token" in table
    for r in prefill["rows"]:
        assert 0 < r["prefill_ms"] < r["ttft_ms"] and r["torch_ttft_ms"] > 0 and 0 < r["floor_share"] < 1, r


def test_time_kiec_reports_medians_one_launch_per_step_and_per_sequence():
    from kiec.bench_kiec import time_kiec

    class Fake:
        """A launch of n steps takes n ms, except the single-step launches: 1, 2, ... ms in turn."""
        vocab = 100

        def __init__(self):
            self.launches, self.singles = [], 0

        def _launch(self, tokens, n_steps, start):
            self.launches.append((len(tokens), n_steps, start))
            self.n = n_steps

        def _finish(self):
            if self.n == 1:
                self.singles += 1
                return float(self.singles)
            return float(self.n)

    fake = Fake()
    ticks = iter(range(0, 1000, 2))                 # the host's clock: 2 ms from each launch to its finish
    out = time_kiec(fake, 128, 5, np.random.default_rng(0), clock=lambda: next(ticks) / 1e3)
    # a warm-up of the whole sequence, 5 single steps at positions 128..132, 3 whole sequences
    assert fake.launches == [(1, 5, 128)] + [(1, 1, 128 + i) for i in range(5)] + [(1, 5, 128)] * 3
    # per step: what the host loop pays (2 ms by its clock), the kernel's median of 1..5 beside it
    assert out["kiec per-step"] == {"ms_per_token": 2.0, "kernel_ms_per_token": 3.0, "launches": 5}
    assert out["kiec per-sequence"] == {"ms_per_token": 1.0, "launches": 3, "steps_per_launch": 5}


def test_torch_peers_that_cannot_be_built_are_rows_that_say_so(monkeypatch):
    """The peers are other people's code: a decoder that fails to build (an old torch, out of memory)
    is a `not_run` row for each torch measurement at each context, not a run stopped before its table."""
    pytest.importorskip("torch")
    import kiec.baselines.torch_decode as torch_decode
    from kiec.bench import time_torch_peers
    from kiec.model import load_spec
    from kiec.synthetic import preset

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA out of memory\nmore detail")
    monkeypatch.setattr(torch_decode, "TorchDecoder", broken)
    spec = load_spec({"weights": ".", "config": preset("tiny-llama"), "max_seq_len": 64})
    rows = []
    time_torch_peers(spec, None, BenchOptions(contexts=(16, 32), steps=4, compile_at=(16,)), np.random.default_rng(0),
                     lambda message: None, lambda context, name, row: rows.append((context, name, row)))
    assert [(c, n) for c, n, _ in rows] == [(16, "torch graph"), (16, "torch.compile graph"), (32, "torch graph")]
    assert all(row == {"not_run": "failed: RuntimeError: CUDA out of memory"} for _, _, row in rows)


def test_a_torch_prefill_that_failed_is_said_under_the_table():
    from kiec.bench_prefill import format_prefill, summarize_prefill
    raw = {"matrix_rate": {"flops_per_s": 5e14, "size": 8192}, "layer_matrix_params": 1e9,
           "kiec": {512: {"ttft_ms": 10.0, "prefill_ms": 9.0}}, "torch": {"not_run": "failed: TypeError: enable_gqa"}}
    summary = summarize_prefill(raw)
    assert "torch_ttft_ms" not in summary["rows"][0] and summary["torch_not_run"] == "failed: TypeError: enable_gqa"
    assert format_prefill(summary)[-1] == "torch prefill not run: failed: TypeError: enable_gqa"


def test_the_probe_takes_one_or_more_reads_between_its_events():
    from kiec.errors import KiecError
    from kiec.probe import read_bandwidth
    with pytest.raises(KiecError, match="reads_per_event: got 0"):
        read_bandwidth(reads_per_event=0)          # refused before anything is built


def test_a_torch_cache_that_cannot_be_resized_is_a_row_at_that_context(monkeypatch):
    pytest.importorskip("torch")
    import kiec.baselines.torch_decode as torch_decode
    from kiec.bench import time_torch_peers
    from kiec.model import load_spec
    from kiec.synthetic import preset

    class Decoder:
        def __init__(self, *args, **kwargs):
            pass

        def resize_cache(self, max_seq):
            if max_seq > 100:
                raise RuntimeError("CUDA out of memory")
    timed = []
    monkeypatch.setattr(torch_decode, "TorchDecoder", Decoder)
    monkeypatch.setattr(torch_decode, "compile_step", lambda decoder: decoder)
    monkeypatch.setattr(torch_decode, "GraphedStep", lambda step, decoder: step)
    monkeypatch.setattr(torch_decode, "time_replays", lambda step, token, context, steps: timed.append(context) or
                        {"ms_per_token": 1.0})
    spec = load_spec({"weights": ".", "config": preset("tiny-llama"), "max_seq_len": 256})
    rows = []
    time_torch_peers(spec, None, BenchOptions(contexts=(16, 128), steps=4, compile_peer=False), np.random.default_rng(0),
                     lambda message: None, lambda context, name, row: rows.append((context, name, row)))
    assert rows == [(16, "torch graph", {"ms_per_token": 1.0}),
                    (128, "torch graph", {"not_run": "failed: RuntimeError: CUDA out of memory"})]
    assert timed == [16]


def test_the_probe_passes_its_reads_per_event_on(monkeypatch):
    import kiec.probe as probe
    asked = []

    class Probe:
        @staticmethod
        def read(nbytes, iterations, reads):
            asked.append((nbytes, iterations, reads))
            return [2.0] * iterations
    monkeypatch.setattr(probe, "build_probe", lambda **kw: Probe)
    out = probe.read_bandwidth(nbytes=1_000_000, iterations=3, reads_per_event=4)
    assert asked == [(1_000_000, 3, 4)] and out["reads_per_event"] == 4 and out["best_bps"] == 1_000_000 / 2e-3
