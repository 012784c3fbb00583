"""codegen + toolchain without a GPU: the generated HIP builds for both targets at many shapes.

nvcc -cubin (sm_90a) and Debian's clang-19 (gfx942, device only, no ROCm) must both accept it.
Where a compiler is missing the test skips, unless KIEC_REQUIRE_TOOLCHAINS=1 (CI sets it): then a
missing compiler fails, so a green CI run always means both targets compiled.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from kiec.errors import KiecError
from kiec.ir.schedule import STAGE_KINDS
from kiec.model import load_spec
from kiec.options import CompileOptions
from kiec.pipeline import render_sources
from kiec.synthetic import preset
from kiec.targets import TARGETS, get_target
from kiec.toolchain import check

SHAPES = {
    "tiny-llama": preset("tiny-llama"),
    "tiny-qwen2-bias-tied": preset("tiny-qwen2"),
    "tiny-mistral-window-kv1-hd32": preset("tiny-mistral"),
    "smollm2-shape-vocab49152": preset("tiny-llama", hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                                       intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True),
    "hd128-vocab1001": preset("tiny-llama", hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                              intermediate_size=704, vocab_size=1001),
    "hd256": preset("tiny-llama", hidden_size=512, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                    intermediate_size=512, vocab_size=512),
    "hd96-group8": preset("tiny-llama", hidden_size=768, num_attention_heads=8, num_key_value_heads=1,
                          intermediate_size=2048, vocab_size=777),
    "wide-ffn-8960": preset("qwen2.5-1.5b", num_hidden_layers=1, vocab_size=4096),
    # more splits than the combine's weights had room for: a long context on few KV heads of few dims
    "kv1-hd32-seq32768": preset("tiny-mistral", max_position_embeddings=32768),
    "qwen0.5b-shape-seq4096": preset("tiny-qwen2", hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                                     intermediate_size=4864, max_position_embeddings=4096),
    "tiny-llama-lanes2": preset("tiny-llama"),
    "laneformer-lanes4-past2": preset("laneformer-2b", hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=4, intermediate_size=512, vocab_size=512, num_lanes=4,
                                      sliding_window=16, sliding_window_n_layers=2),
}
SHAPES["tiny-llama-gpus2"] = SHAPES["tiny-llama-lanes2"]
SHAPES["laneformer-gpus4-past2"] = SHAPES["laneformer-lanes4-past2"]
# the lane exchange in the kernel, on one GPU and one lane per GPU
SPEC_CHANGES = {"tiny-llama-lanes2": {"lanes": 2}, "tiny-llama-gpus2": {"lanes": 2, "gpus": 2},
                "kv1-hd32-seq32768": {"max_seq_len": 32768}, "qwen0.5b-shape-seq4096": {"max_seq_len": 4096},
                "laneformer-gpus4-past2": {"gpus": 4}}
COMPILERS = {"cuda:sm_90": "nvcc", "hip:gfx942": "clang++-19"}


def _spec(tmp_path, name):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SHAPES[name]))
    return load_spec({"weights": str(folder), "max_seq_len": 512, **SPEC_CHANGES.get(name, {})})


def _need(tool: str):
    if shutil.which(tool) is None:
        if os.environ.get("KIEC_REQUIRE_TOOLCHAINS") == "1":
            pytest.fail(f"{tool} is required (KIEC_REQUIRE_TOOLCHAINS=1) but not on PATH")
        pytest.skip(f"{tool} not on PATH")


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("name", list(SHAPES))
def test_generated_kernel_compiles(tmp_path, name, target):
    _need(COMPILERS[target])
    spec = _spec(tmp_path, name).replace(target=target)
    _, sched, files, _ = render_sources(spec)
    report = check(files, get_target(target), tmp_path / "build")
    if target == "cuda:sm_90":
        assert "0 bytes spill stores" in report, report         # a spill is a slowdown worth failing on


OPTION_TEXTS = ["gemv_tiles=0", "gemv_tiles=0,reduce_batch=1", "gemv_tiles=0,reduce_batch=16,warp_release=1",
                "timing_only=1", "timing_only=2", "timing_only=3", "timing_only=4", "timing_only=5", "timing_only=6", "gemv_tiles=0,timing_only=2", "slot_groups=2",
                "tile_accumulators=1", "tile_accumulators=4", "kv_in_flight=4", "heads_per_pass=2",
                "combine_in_attn_out=1", "combine_in_attn_out=1,gemv_tiles=0", "copies_in_flight=3",
                "ring_evict_first=0", "producer_registers=56", "marks_only=0", "marks_only=1",
                "marks_only=2", "marks_only=2,combine_in_attn_out=1", "kv_in_flight=8", "marks_only=2,kv_store_late=1", "slot_pairs=0",
                "copies_in_flight=2,stream_copies_in_flight=3", "kv_in_flight=8,by_head_rows=1", "by_head_rows=8",
                "contiguous_units=0", "contiguous_units=1,slot_pairs=0", "producer_polls=1", "steady_pairs=0"]


def _option_fits(text: str, target) -> bool:
    """Options a target refuses: tiled-only knobs where the matrices are rows, and register moves
    where warps keep their registers."""
    if "producer_registers" in text and not target.producer_registers:
        return False
    return target.gemv_tiles or not any(knob in text for knob in ("slot_groups", "tile_accumulators", "contiguous_units=1",
                                                                  "steady_pairs"))


@pytest.mark.parametrize("text,target", [(text, target) for text in OPTION_TEXTS for target in TARGETS
                                         if _option_fits(text, TARGETS[target])])
def test_consumer_options_compile(tmp_path, text, target):
    _need(COMPILERS[target])
    spec = _spec(tmp_path, "tiny-qwen2-bias-tied").replace(target=target)
    _, sched, files, _ = render_sources(spec, options=CompileOptions.parse(text))
    report = check(files, get_target(target), tmp_path / "build")
    if target == "cuda:sm_90":
        assert "0 bytes spill stores" in report, report


def test_down_in_column_halves_compiles(tmp_path):
    # NVIDIA only (halves need tiled matrices); the Qwen-1.5B shape takes them by default on 132 blocks
    # (test_generated_kernel_compiles), here they are asked for
    _need("nvcc")
    spec = _spec(tmp_path, "tiny-llama").replace(target="cuda:sm_90")
    _, sched, files, _ = render_sources(spec, options=CompileOptions.parse("down_halves=1"))
    assert "constexpr uint32_t DOWN_HALF_TILES = 8;" in files["kernel.hip"]
    assert "    { 0ull, 0, 0, 0 }," not in files["kernel.hip"]           # every layer's prefill has a second half
    assert "0 bytes spill stores" in check(files, get_target("cuda:sm_90"), tmp_path / "build")


@pytest.mark.parametrize("target", list(TARGETS))
def test_attention_with_and_without_by_head_tiles_compiles(tmp_path, target):
    _need(COMPILERS[target])
    spec = _spec(tmp_path, "tiny-llama").replace(target=target)             # a group of 2, 2 splits
    for text, keys in (("", 512), ("attention_by_head=0", 0)):
        _, sched, files, _ = render_sources(spec, options=CompileOptions.parse(text))
        assert f"constexpr uint32_t BY_HEAD_KEYS = {keys};" in files["kernel.hip"]
        report = check(files, get_target(target), tmp_path / f"build{keys}")
        if target == "cuda:sm_90":
            assert "0 bytes spill stores" in report, report


def test_attn_out_waits_for_every_split_tile_where_it_combines_them(tmp_path):
    from kiec.codegen import _stage_entry, trace_layout
    spec = _spec(tmp_path, "tiny-mistral-window-kv1-hd32")          # one KV head, several splits
    # attn_out waits for a signal each split tile (attn_out combines), each KV group (its last split
    # combines) or each query head (every KV group's heads signal, whether by head or combined)
    for text in ("combine_in_attn_out=1", "attention_by_head=0", ""):
        _, sched, files, _ = render_sources(spec, options=CompileOptions.parse(text))
        trace, _ = trace_layout(sched)
        outs = [s for s in sched.stages if s.kind == "attn_out"]
        assert outs
        for s in outs:
            att = sched.stages[s.index - 1]
            assert att.tiles > att.attr("kv_heads")
            want = {"combine_in_attn_out=1": att.tiles, "attention_by_head=0": att.attr("kv_heads"),
                    "": att.attr("heads") * att.attr("by_head_splits")}[text]
            assert _stage_entry(sched, s, trace, False)["wait_count"] == want, text
        assert ("constexpr bool COMBINE_IN_ATTN_OUT = true;" in files["kernel.hip"]) == text.startswith("combine")


@pytest.mark.parametrize("target", list(TARGETS))
def test_by_head_splits_publish_partials_that_attn_out_combines(tmp_path, target):
    """by_head_splits=2: attn_out waits for every query head's splits, its prologue combines the marked
    partials (their buffer planned), and it reads them primed only where the layers are even (tiny-llama's
    2; tiny-mistral's 3 leave the write before a step's first of the same mark after a step that went
    split). Both targets compile it (gfx942 reads no marks alone by default: asked to here), CUDA without
    spills; a lane without marked outputs refuses it."""
    from kiec.codegen import _stage_entry, trace_layout
    _need(COMPILERS[target])
    text = "by_head_splits=2" + (",marks_only=1" if target == "hip:gfx942" else "")
    specs = {name: _spec(tmp_path, name).replace(target=target) for name in ("tiny-llama", "tiny-mistral-window-kv1-hd32")}
    for name, primed in (("tiny-llama", True), ("tiny-mistral-window-kv1-hd32", False)):
        spec = specs[name]
        _, sched, files, _ = render_sources(spec, options=CompileOptions.parse(text))
        trace, _ = trace_layout(sched)
        att = next(s for s in sched.stages if s.kind == "attention")
        out = _stage_entry(sched, sched.stages[att.index + 1], trace, False)
        assert out["wait_count"] == 2 * att.attr("heads")
        assert (out["primed"] != "NONE") == primed, name
        assert sched.memory["sync"]["lane.attn_part"][1] == 4 * 2 * att.attr("heads") * (att.attr("head_dim") + 4)
        assert "constexpr uint32_t BY_HEAD_SPLITS = 2;" in files["kernel.hip"] and "combine_by_head(c, s" in files["kernel.hip"]
        report = check(files, get_target(target), tmp_path / f"build-{name}")
        if target == "cuda:sm_90":
            assert "0 bytes spill stores" in report, report
    with pytest.raises(KiecError, match="by_head_splits.*marks_only 0"):
        render_sources(specs["tiny-llama"], options=CompileOptions.parse("by_head_splits=2,marks_only=0"))


def test_the_attention_probe_takes_attention_off_the_path(tmp_path):
    """timing_only=4: attn_out is never primed (it reads no marks) and no other stage moves (the kernel
    then has it wait for every KV group's qkv counter, as attention does)."""
    from kiec.codegen import _stage_entry, trace_layout
    spec = _spec(tmp_path, "tiny-llama")
    entries, kernels = {}, {}
    for text in ("marks_only=1", "marks_only=1,timing_only=4"):
        _, sched, files, _ = render_sources(spec, options=CompileOptions.parse(text))
        trace, _ = trace_layout(sched)
        entries[text] = {s.index: _stage_entry(sched, s, trace, False) for s in sched.stages}
        kernels[text] = files["kernel.hip"]
    base, probe = entries["marks_only=1"], entries["marks_only=1,timing_only=4"]
    moved = {i for i in probe if probe[i] != base[i]}
    assert moved == {i for i in probe if probe[i]["kind"] == "attn_out"}
    assert all(probe[i]["primed"] == "NONE" != base[i]["primed"] for i in moved)
    assert "constexpr uint32_t TIMING_ONLY = 4;" in kernels["marks_only=1,timing_only=4"]


def test_generated_source_is_readable_and_in_sync_with_the_stage_table(tmp_path):
    spec = _spec(tmp_path, "tiny-llama")
    _, sched, files, _ = render_sources(spec)
    kernel = files["kernel.hip"]
    for code, kind in enumerate(STAGE_KINDS):
        assert f"constexpr uint32_t STAGE_{kind.upper()} = {code};" in kernel
    for s in sched.stages:                                     # every stage's entry names its stage and layer
        layer = f", layer {s.layer}" if s.layer is not None else ""
        assert f"// stage {s.index}: {s.kind}{layer} -- " in kernel
    assert "record_error(c, ERR_BAD_STAGE" in kernel           # an unknown stage kind stops the kernel
    assert "hipLaunchCooperativeKernel" in kernel and "hipOccupancyMaxActiveBlocksPerMultiprocessor" in kernel


def test_each_target_gets_its_own_portability_section(tmp_path):
    spec = _spec(tmp_path, "tiny-llama")
    nvidia = render_sources(spec)[2]["kiec_port.h"]
    amd = render_sources(spec.replace(target="hip:gfx942"))[2]["kiec_port.h"]
    assert "cp.async.bulk" in nvidia and "#define KIEC_WARP 32" in nvidia and "hipMalloc cudaMalloc" in nvidia
    assert "__builtin_amdgcn" in amd and "#define KIEC_WARP 64" in amd and "cp.async" not in amd


def test_one_lane_per_gpu_plans_one_device_per_lane(tmp_path):
    """Across GPUs each device holds the shared weights and one lane's, all of its own SMs; the last
    residual is mirrored to every device (the LM head there takes a slice of the vocabulary)."""
    spec = _spec(tmp_path, "laneformer-gpus4-past2")
    _, sched, files, _ = render_sources(spec, multiprocessors=33)
    _, one_gpu, _, _ = render_sources(spec.replace(gpus=1), multiprocessors=132)
    grid = sched.grid
    assert (grid.devices, grid.lanes, grid.blocks_per_lane, grid.launch_blocks, grid.blocks) == (4, 4, 33, 33, 132)
    w, a, kv, sy = (sched.memory[k] for k in ("weights", "acts", "kv", "sync"))
    assert w["__total"] == one_gpu.memory["weights"]["__total"]                 # one blob, packed whole
    assert w["__device_total"][0] == w["__lanes_base"][0] + w["__lane_stride"][0]
    assert kv["__total"][0] == kv["__lane_stride"][0]                           # one lane's cache a device
    assert a["logits"][0] == a["__lane_stride"][0]                              # shared acts after one lane's
    assert a["h_mirror"][1] == 4 * 4 * spec.config.hidden and sy["h_mirror"][1] == 4 * 128
    assert one_gpu.memory["kv"]["__total"][0] == 4 * kv["__total"][0] and "h_mirror" not in one_gpu.memory["acts"]
    kernel = files["kernel.hip"]
    assert "constexpr uint32_t DEVICES = 4;" in kernel and "constexpr uint32_t LANES_HERE = LANES / DEVICES;" in kernel
    last_down = [s for s in sched.stages if s.kind == "down"][-1]
    from kiec.codegen import _stage_entry, senders, trace_layout
    trace, _ = trace_layout(sched)
    flags = {s.index: _stage_entry(sched, s, trace, s.index in senders(sched))["flags"] for s in sched.stages}
    assert [i for i, f in flags.items() if f & 64] == [last_down.index]


def test_gpus_must_be_one_or_the_lane_count(tmp_path):
    from kiec.errors import KiecError
    with pytest.raises(KiecError, match="gpus: got 3; expected 1 or the lane count"):
        _spec(tmp_path, "tiny-llama").replace(lanes=2, gpus=3)


@pytest.mark.parametrize("text,changes,attention_marked,qkv_marked", [
    ("", {}, True, True), ("marks_only=1", {}, True, False), ("marks_only=0", {}, False, False),
    ("combine_in_attn_out=1", {}, False, True), ("", {"lanes": 2}, False, False)])
def test_marked_attention_constants_follow_the_level(tmp_path, text, changes, attention_marked, qkv_marked):
    spec = _spec(tmp_path, "tiny-llama").replace(**changes)
    _, sched, files, _ = render_sources(spec, options=CompileOptions.parse(text))
    kernel = files["kernel.hip"]
    assert f"constexpr bool ATTENTION_MARKED = {str(attention_marked).lower()};" in kernel
    assert f"constexpr bool QKV_MARKED = {str(qkv_marked).lower()};" in kernel


def test_a_lane_past_4_gib_before_its_last_norms_is_refused_by_name(tmp_path):
    # Llama-1B's shape at 40 layers: 4.9 GB a lane, layer 36's norm weights past 2**32 bytes, where
    # StageDesc's 32-bit offsets would wrap; two lanes halve it
    (tmp_path / "config.json").write_text(json.dumps(preset("llama-3.2-1b", num_hidden_layers=40)))
    spec = load_spec({"weights": str(tmp_path), "max_seq_len": 256}).replace(target="cuda:sm_90")
    with pytest.raises(KiecError, match="GiB of weights a lane.*32-bit offsets"):
        render_sources(spec, 132)
    render_sources(spec.replace(lanes=2), 132)
