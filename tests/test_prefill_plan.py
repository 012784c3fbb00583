"""passes/prefill alone: when the prompt path exists, how it tiles, and that it reads memplan's matrices."""
from __future__ import annotations

import json

import pytest

from kiec.errors import KiecError
from kiec.model import load_spec
from kiec.options import CompileOptions
from kiec.passes.prefill import gemm_smem, key_tile, prefill
from kiec.pipeline import build_schedule
from kiec.synthetic import preset
from kiec.targets import get_target


def _sched(tmp_path, config, max_seq=512, **spec):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return build_schedule(load_spec({"weights": str(tmp_path), "max_seq_len": max_seq, **spec}))[1]


def test_a_llama_gets_a_plan_over_the_decode_blob(tmp_path):
    sched = _sched(tmp_path, preset("tiny-qwen2"), max_seq=300)
    plan = sched.prefill
    assert plan["chunk"] == 320                          # max_seq_len rounded up to 64, under the default 2048
    assert len(plan["layers"]) == sched.config["layers"]
    w = sched.memory["weights"]
    for layer in plan["layers"]:
        stages = {s.kind: s for s in sched.stages if s.layer == layer["layer"]}
        for kind, key in (("qkv", "qkv"), ("attn_out", "o"), ("gate_up", "gate_up"), ("down", "down")):
            g = stages[kind].gemv
            assert layer[key] == dict(offset=g.offset, rows=g.rows, cols=g.cols, stride=g.stride)
        assert layer["attn_norm"] == w["__lanes_base"][0] + w[f"lane.layers.{layer['layer']}.attn_norm"][0]
        assert layer["bias"] == w["__lanes_base"][0] + w[f"lane.layers.{layer['layer']}.qkv_bias"][0]   # qwen2
        assert layer["gate_up"]["rows"] == 2 * layer["down"]["cols"] == 2 * layer["ffn"] and layer["down_second"] is None
    assert "  prefill chunk=320 key_tile=64" in sched.dump()


def test_down_in_column_halves_is_two_gemms_over_the_activation_s_halves(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(preset("tiny-llama")))
    spec = load_spec({"weights": str(tmp_path), "max_seq_len": 256})
    sched = build_schedule(spec, options=CompileOptions.parse("down_halves=1"))[1]
    hidden = sched.config["hidden"]
    for layer in sched.prefill["layers"]:
        g = next(s.gemv for s in sched.stages if s.kind == "down" and s.layer == layer["layer"])
        assert g.rows == 2 * hidden and layer["ffn"] == 2 * g.cols == 128
        assert layer["down"] == dict(offset=g.offset, rows=hidden, cols=g.cols, stride=g.stride)
        assert layer["down_second"] == dict(offset=g.offset + hidden * g.stride * 2, rows=hidden, cols=g.cols, stride=g.stride)


def test_the_chunk_option_and_its_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(preset("tiny-llama")))
    spec = load_spec({"weights": str(tmp_path), "max_seq_len": 512})
    assert build_schedule(spec, options=CompileOptions(prefill_chunk=128))[1].prefill["chunk"] == 128
    for bad in (0, 100):
        with pytest.raises(KiecError, match=f"prefill_chunk: got {bad}; expected a multiple of 64"):
            CompileOptions(prefill_chunk=bad)


def test_several_lanes_and_odd_head_dims_keep_the_decode_kernel(tmp_path):
    (tmp_path / "a").mkdir()
    lanes = _sched(tmp_path / "a", preset("tiny-llama"), lanes=2)
    assert lanes.prefill is None and lanes.config["prefill_off"].startswith("2 lanes")
    (tmp_path / "b").mkdir()
    # a multiple of 8, as the decode kernel's attention needs, but not of the matrix units' 16
    odd = _sched(tmp_path / "b", preset("tiny-llama", hidden_size=96, num_attention_heads=4, num_key_value_heads=2))
    assert odd.prefill is None and "head_dim 24 is not a multiple of 16" in odd.config["prefill_off"]
    assert "prefill off: head_dim 24" in odd.dump()


def test_key_tiles_fit_each_target():
    nvidia, amd = get_target("cuda:sm_90"), get_target("hip:gfx942")
    assert key_tile(64, nvidia.smem_bytes) == 64 and key_tile(128, amd.smem_bytes) == 32
    assert key_tile(256, nvidia.smem_bytes) == 32 and key_tile(256, amd.smem_bytes) == 0     # no room on gfx942


def test_head_dim_256_on_amd_has_no_prefill_and_says_why(tmp_path):
    sched = _sched(tmp_path, preset("tiny-llama", hidden_size=512, num_attention_heads=2, num_key_value_heads=1,
                                    head_dim=256), target="hip:gfx942")
    assert sched.prefill is None and "no attention key tile fits 65536 bytes" in sched.config["prefill_off"]


def test_the_gemm_block_fits_every_target(tmp_path):
    sched = _sched(tmp_path, preset("tiny-llama"))
    for name in ("cuda:sm_90", "hip:gfx942"):
        plan = prefill(sched, get_target(name)).prefill
        assert gemm_smem(plan["gemm"]) <= get_target(name).smem_bytes
        assert plan["gemm"]["k"] == (64 if name == "cuda:sm_90" else 32)     # 110 KiB of slices only fit the H200
