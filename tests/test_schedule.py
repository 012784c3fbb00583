"""fuse, schedule and memplan alone, on small IR; then the Python twin of the schedule against the
graph interpreter (the twin reads the packed blob exactly as the kernel does)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kiec.errors import KiecError
from kiec.ir.graph import Graph
from kiec.model import load_spec
from kiec.options import CompileOptions
from kiec.ir.schedule import TILE_BYTES, TILE_COLS, TILE_ROWS
from kiec.pack import pack_weights, permute_pairs, tile_rows, unpermute_pairs, untile_rows
from kiec.passes.fuse import fuse
from kiec.passes.schedule import attention_splits, qkv_tiles_of_group
from kiec.pipeline import build_graph, build_schedule, render_sources
from kiec.reference.interpreter import Reference, reference_weights
from kiec.reference.twin import Twin
from kiec.synthetic import preset, write_random_model
from kiec.targets import TARGETS
from kiec.weights import load_checkpoint

KINDS_PER_LAYER = ["qkv", "attention", "attn_out", "gate_up", "down"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sched")
    out = {}
    for name in ("tiny-llama", "tiny-qwen2", "tiny-mistral"):
        out[name] = write_random_model(root / name, name, seed=3, dtype="bf16")
    # head_dim 32 and one KV head: 64-key attention batches, so a few hundred positions need several splits
    out["tiny-mistral-full"] = write_random_model(root / "full", preset("tiny-mistral", sliding_window=None), seed=3,
                                                  dtype="bf16")
    return out


# the twin (bf16 cache, the kernel's order of sums) against the float64 reference: measured 4e-5 to 1.2e-4;
# a split that drops its last key makes 7.9e-4
TWIN_TOLERANCE = 5e-4


def spec_of(folder, **changes):
    return load_spec(str(folder), dict({"max_seq_len": 512}, **changes))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])
def test_fuse_covers_every_op_once_in_order(models, name):
    spec = spec_of(models[name])
    graph = build_graph(spec)
    sched = fuse(graph, spec.config)
    ops = [i for s in sched.stages for i in s.ops]
    assert ops == list(range(len(graph.ops)))
    kinds = [s.kind for s in sched.stages]
    assert kinds == KINDS_PER_LAYER * spec.config.layers + ["lm_head"]
    assert all(s.layer == i // 5 for i, s in enumerate(sched.stages[:-1]))


def test_fuse_refuses_an_op_no_pattern_knows(models):
    spec = spec_of(models["tiny-llama"])
    graph = build_graph(spec)
    broken = Graph(graph.arch, graph.lanes, dict(graph.tensors), list(graph.ops))
    broken.ops.insert(3, broken.ops[5])           # a second RoPE where a Linear belongs
    with pytest.raises(KiecError, match="stage pattern"):
        fuse(broken, spec.config)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])
@pytest.mark.parametrize("target", list(TARGETS))
def test_schedule_tiles_cover_rows_and_fit_shared_memory(models, name, target):
    spec = spec_of(models[name], target=target)
    _, sched = build_schedule(spec)
    grid, t = sched.grid, TARGETS[target]
    assert grid.slots >= 2
    assert grid.slots * grid.slot_bytes + grid.scratch_bytes + 1024 <= t.smem_bytes
    for s in sched.stages:
        if s.gemv is None:
            assert s.tiles == s.attr("kv_heads") * s.attr("splits")
            assert s.tiles <= grid.blocks_per_lane or s.attr("splits") == 1
            continue
        g = s.gemv
        width = grid.blocks if s.kind == "lm_head" else grid.blocks_per_lane
        assert s.tiles <= width
        assert (s.tiles - 1) * g.rows_per_tile < g.rows <= s.tiles * g.rows_per_tile
        if s.kind in ("qkv", "gate_up"):
            assert g.rows_per_tile % 2 == 0          # RoPE pairs and gate/up pairs stay in one tile
        assert g.segments & (g.segments - 1) == 0 and g.stride >= g.cols and g.seg_width % 8 == 0
        assert g.unit_bytes <= grid.slot_bytes


def _config_only(tmp_path, name, **changes):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(preset(name, **changes)))
    return folder


def test_attention_splits_leave_the_combine_room_for_its_weights(tmp_path):
    """A split's weights go where the warps' output sums were: 2 splits + 1 a head, in warps x head_dim."""
    folder = _config_only(tmp_path, "tiny-mistral", max_position_embeddings=32768)      # one KV head of 32
    for target, warps in (("cuda:sm_90", 8), ("hip:gfx942", 4)):
        _, sched = build_schedule(load_spec({"weights": str(folder), "max_seq_len": 32768, "target": target}))
        att = next(s for s in sched.stages if s.kind == "attention")
        assert att.attr("splits") == (warps * 32 - 1) // 2, target      # the room, not the blocks, bounds them


def test_head_dim_must_be_a_multiple_of_8(tmp_path):
    folder = _config_only(tmp_path, "tiny-llama", hidden_size=1000, num_attention_heads=10, num_key_value_heads=2)
    with pytest.raises(KiecError, match="config.head_dim: got 100; expected a multiple of 8"):
        build_schedule(load_spec({"weights": str(folder), "max_seq_len": 64}))


def test_a_stage_too_wide_for_shared_memory_is_named(tmp_path):
    folder = _config_only(tmp_path, "tiny-llama", hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
                          intermediate_size=13824)
    with pytest.raises(KiecError, match=r"in down\[layer 0\]'.* on hip:gfx942 .*config\.intermediate_size"):
        build_schedule(load_spec({"weights": str(folder), "max_seq_len": 64, "target": "hip:gfx942"}))


def test_kv_in_flight_sets_the_attention_batch(models):
    spec = spec_of(models["tiny-qwen2"])
    lanes_per_key = 1 << (spec.config.head_dim // 8 - 1).bit_length()     # a lane loads 8 of a key's values
    warps, keys_per_pass = 8, 32 // lanes_per_key
    for text, rows, prefetch in (("kv_in_flight=1", 1, False), ("kv_in_flight=2", 1, True), ("kv_in_flight=4", 2, True),
                                  ("kv_in_flight=8", 4, True)):
        _, sched = build_schedule(spec, options=CompileOptions.parse(text))
        att = next(s for s in sched.stages if s.kind == "attention")
        assert (att.attr("rows"), att.attr("prefetch"), att.attr("batch")) == (rows, prefetch, warps * keys_per_pass * rows)
    with pytest.raises(KiecError, match="kv_in_flight"):
        CompileOptions.parse("kv_in_flight=3")


def test_rows_in_flight_follow_the_consumers_registers(models):
    # two rows a lane (4 in flight, prefetched) for any group where the consumers take the producer's
    # registers (NVIDIA); where they cannot (AMD), fewer rows for bigger groups
    for name, group, amd_rows, amd_prefetch in (("tiny-llama", 2, 2, True), ("tiny-qwen2", 3, 1, True),
                                                ("tiny-mistral", 4, 1, False)):
        for target, rows, prefetch in (("cuda:sm_90", 2, True), ("hip:gfx942", amd_rows, amd_prefetch)):
            _, sched = build_schedule(spec_of(models[name], target=target))
            att = next(s for s in sched.stages if s.kind == "attention")
            assert att.attr("heads") // att.attr("kv_heads") == group
            assert (att.attr("rows"), att.attr("prefetch")) == (rows, prefetch), (name, target)
            # a by-head tile (one query head's accumulators) takes 4 rows where the consumers are roomy
            assert att.attr("by_head_rows") == (4 if target == "cuda:sm_90" else amd_rows), (name, target)


def test_by_head_rows_sets_a_by_head_tiles_batch_alone(models):
    spec = spec_of(models["tiny-qwen2"])
    for text, rows, by_head_rows in (("by_head_rows=1", 2, 1), ("by_head_rows=8", 2, 8), ("kv_in_flight=2", 1, 1),
                                     ("kv_in_flight=8", 4, 4), ("kv_in_flight=2,by_head_rows=4", 1, 4),
                                     ("kv_in_flight=8,by_head_rows=2", 4, 2)):
        _, sched = build_schedule(spec, options=CompileOptions.parse(text))
        att = next(s for s in sched.stages if s.kind == "attention")
        assert (att.attr("rows"), att.attr("by_head_rows")) == (rows, by_head_rows), text
    with pytest.raises(KiecError, match="by_head_rows"):
        CompileOptions.parse("by_head_rows=3")


def test_heads_per_pass_spreads_a_group_evenly_over_the_passes(tmp_path):
    # a query group of 6: 4 heads a pass at most by default (2 passes of 3), or one pass of 6
    folder = write_random_model(tmp_path / "g6", preset("tiny-qwen2", num_attention_heads=12, num_key_value_heads=2),
                                seed=3, dtype="bf16")
    for text, pass_heads in (("", 3), ("heads_per_pass=8", 6), ("heads_per_pass=6", 6), ("heads_per_pass=5", 3),
                             ("heads_per_pass=1", 1)):
        _, sched = build_schedule(spec_of(folder), options=CompileOptions.parse(text))
        att = next(s for s in sched.stages if s.kind == "attention")
        assert att.attr("heads") // att.attr("kv_heads") == 6
        assert att.attr("pass_heads") == pass_heads, text
    with pytest.raises(KiecError, match="heads_per_pass"):
        CompileOptions.parse("heads_per_pass=9")


def test_a_short_context_takes_one_split_where_a_batch_is_one_pass(tmp_path, models):
    # Llama's group of 4 is one pass: up to 4 batches in one split; a group of 6 (two passes) one batch
    g6 = write_random_model(tmp_path / "g6", preset("tiny-qwen2", num_attention_heads=12, num_key_value_heads=2),
                            seed=3, dtype="bf16")
    for folder, text, batches in ((models["tiny-llama"], "", 4), (g6, "", 1), (g6, "split_batches=3", 3),
                                  (models["tiny-llama"], "split_batches=1", 1)):
        _, sched = build_schedule(spec_of(folder), options=CompileOptions.parse(text))
        att = next(s for s in sched.stages if s.kind == "attention")
        assert att.attr("min_split") == batches * att.attr("batch"), text
    with pytest.raises(KiecError, match="split_batches"):
        CompileOptions.parse("split_batches=0")


def test_copies_in_flight_follow_the_device_s_memory_unless_asked(models):
    """Unknown device: the target's count. Known: the slots that cover a block's share of the peak
    bandwidth over the target's latency, at least 2 (the H100 SXM 2, the H200 3; AMD keeps no cap).
    Asked for: that, whatever the device."""
    spec = spec_of(models["tiny-llama"])
    for target in TARGETS:
        _, sched = build_schedule(spec.replace(target=target))
        assert sched.grid.copies_in_flight == min(TARGETS[target].copies_in_flight, sched.grid.slots)
    cards = {"H100 SXM": (2619e6, 5120, 2), "H200": (3201e6, 6144, 3), "H100 PCIe": (1593e6, 5120, 2)}
    for card, (clock, bus, want) in cards.items():
        block = 2 * clock * bus / 8 / 132
        _, sched = build_schedule(spec, 132, block_bandwidth=block)
        assert sched.grid.copies_in_flight == want, card
        _, amd = build_schedule(spec.replace(target="hip:gfx942"), block_bandwidth=block)
        assert amd.grid.copies_in_flight == 0
    for text, want in (("copies_in_flight=0", 0), ("copies_in_flight=5", 5), ("copies_in_flight=64", None)):
        for block in (None, 2 * 2619e6 * 5120 / 8 / 132):
            _, sched = build_schedule(spec, options=CompileOptions.parse(text), block_bandwidth=block)
            assert sched.grid.copies_in_flight == (sched.grid.slots if want is None else want), text
    with pytest.raises(KiecError, match="copies_in_flight"):
        CompileOptions.parse("copies_in_flight=-1")


def test_the_h200_probe_counts_an_h100_s_copies_as_an_h200_s(models):
    """timing_only=6 (each copy two thirds of its chunk: an H100 reading at an H200's pace) plans the
    copies in flight for that pace: an H100 SXM then keeps the H200's 3 in the layers and while
    streaming, unless a count is asked for."""
    spec = spec_of(models["tiny-llama"])
    h100, h200 = 2 * 2619e6 * 5120 / 8 / 132, 2 * 3201e6 * 6144 / 8 / 132
    probe = CompileOptions.parse("timing_only=6")
    real = build_schedule(spec, 132, block_bandwidth=h200)[1].grid
    emulated = build_schedule(spec, 132, options=probe, block_bandwidth=h100)[1].grid
    assert (emulated.copies_in_flight, emulated.stream_copies_in_flight) == (real.copies_in_flight,
                                                                            real.stream_copies_in_flight) == (3, 3)
    asked = build_schedule(spec, 132, options=CompileOptions.parse("timing_only=6,copies_in_flight=2"),
                           block_bandwidth=h100)[1].grid
    assert (asked.copies_in_flight, asked.stream_copies_in_flight) == (2, 4)


def test_the_streams_copy_cap_is_twice_the_layers_where_they_keep_two_unless_asked(models):
    """While the consumers stream gate_up or down a block keeps twice the layers' count of copies in
    flight where that count is 2 (the H100's), the same elsewhere (the H200's 3, the target's 3 where the
    device is unknown), unless stream_copies_in_flight asks for its own (at most the ring's slots); the
    kernel gets it, and takes the consumers' streaming hint only where the two differ."""
    spec = spec_of(models["tiny-llama"])
    for card, (clock, bus, want, streams) in {"H100 SXM": (2619e6, 5120, 2, 4), "H200": (3201e6, 6144, 3, 3)}.items():
        _, sched = build_schedule(spec, 132, block_bandwidth=2 * clock * bus / 8 / 132)
        assert (sched.grid.copies_in_flight, sched.grid.stream_copies_in_flight) == (want, min(streams, sched.grid.slots)), card
        kernel = render_sources(spec, 132, block_bandwidth=2 * clock * bus / 8 / 132)[2]["kernel.hip"]
        assert f"constexpr uint32_t STREAM_COPIES_IN_FLIGHT = {min(streams, sched.grid.slots)};" in kernel, card
    default = build_schedule(spec)[1].grid
    assert TARGETS["cuda:sm_90"].copies_in_flight == 3
    assert default.stream_copies_in_flight == default.copies_in_flight == min(3, default.slots)
    block = 2 * 2619e6 * 5120 / 8 / 132
    for value, want in ((3, 3), (0, 0), (64, sched.grid.slots)):
        _, asked = build_schedule(spec, 132, options=CompileOptions.parse(f"stream_copies_in_flight={value}"),
                                  block_bandwidth=block)
        assert (asked.grid.copies_in_flight, asked.grid.stream_copies_in_flight) == (2, want), value
    kernel = render_sources(spec, 132, options=CompileOptions.parse("stream_copies_in_flight=3"),
                            block_bandwidth=block)[2]["kernel.hip"]
    assert "constexpr uint32_t STREAM_COPIES_IN_FLIGHT = 3;" in kernel and "COPIES_IN_FLIGHT = 2;" in kernel
    with pytest.raises(KiecError, match="stream_copies_in_flight"):
        CompileOptions.parse("stream_copies_in_flight=65")


@pytest.mark.parametrize("name,base,passes", (("llama-3.2-1b", "", 2), ("qwen2.5-1.5b", "", 2),
                                              ("qwen2.5-1.5b", "down_halves=0,", 1)))
def test_the_lm_head_goes_in_passes_only_where_the_ring_gains_a_slot(tmp_path, name, base, passes):
    """Llama-1B's LM head partials (976 rows x 8 warps) alone keep a twelfth slot out, and so do
    Qwen-1.5B's once its down takes its columns in halves; with down whole, Qwen-1.5B's down needs as
    much scratch as its LM head would in passes, so its tile stays whole."""
    (tmp_path / "config.json").write_text(json.dumps(preset(name)))
    spec = load_spec({"weights": str(tmp_path), "max_seq_len": 1024}).replace(target="cuda:sm_90")
    built = {}
    for text in ("", "lm_head_passes=1", "max_slots=11", "slot_groups=2", "slot_groups=2,lm_head_passes=1"):
        _, sched = build_schedule(spec, options=CompileOptions.parse(base + text))
        built[text] = sched.grid.slots, next(s.gemv for s in sched.stages if s.kind == "lm_head"), sched.grid.slot_bytes
    (slots, lm, slot_bytes), (whole_slots, whole, _) = built[""], built["lm_head_passes=1"]
    assert whole.pass_rows == whole.rows_per_tile and lm.pass_rows % TILE_ROWS == 0
    assert -(-lm.rows_per_tile // lm.pass_rows) == passes and slots == whole_slots + (passes > 1)
    assert lm.pass_rows // TILE_ROWS * lm.stride // TILE_COLS * TILE_BYTES % slot_bytes == 0   # a pass ends on a slot's end
    assert built["max_slots=11"][1].pass_rows == lm.rows_per_tile        # no slot to gain under the cap
    # with two slot groups the ring keeps an even count: passes only where they still gain a slot
    (grouped, grouped_lm, _), (grouped_whole, _, _) = built["slot_groups=2"], built["slot_groups=2,lm_head_passes=1"]
    assert grouped % 2 == 0 and (grouped > grouped_whole) == (grouped_lm.pass_rows < grouped_lm.rows_per_tile)
    with pytest.raises(KiecError, match="lm_head_passes"):
        CompileOptions.parse("lm_head_passes=2")


def test_warps_take_runs_of_units_where_rows_are_not_whole_slots(tmp_path):
    """A warp takes a run of a slot's units where some row of tiles is not whole slots (Qwen-1.5B's 48
    tiles against 32 a slot: every other slot would cross a row group in every warp's strided share);
    Llama-1B's rows (64 and 256 tiles) are whole slots and keep the strided share."""
    qwen, _ = _down(tmp_path, "qwen2.5-1.5b")
    llama, _ = _down(tmp_path, "llama-3.2-1b")
    assert qwen.grid.contiguous_units and not llama.grid.contiguous_units
    assert not _down(tmp_path, "qwen2.5-1.5b", "contiguous_units=0")[0].grid.contiguous_units
    assert _down(tmp_path, "llama-3.2-1b", "contiguous_units=1")[0].grid.contiguous_units
    assert not _down(tmp_path, "qwen2.5-1.5b", "slot_groups=2")[0].grid.contiguous_units
    for text, why in (("contiguous_units=1,slot_groups=2", "2 groups"), ("contiguous_units=1,gemv_tiles=0", "not tiled")):
        with pytest.raises(KiecError, match=f"contiguous_units: got 1; expected 0 where .*{why}"):
            _down(tmp_path, "tiny-llama", text)
    with pytest.raises(KiecError, match="contiguous_units"):
        CompileOptions.parse("contiguous_units=2")


def test_marks_alone_are_read_on_one_lane_by_default(models):
    spec = spec_of(models["tiny-llama"])
    for target in TARGETS:                        # 2 on the H200; 0 where it has not run (gfx942)
        _, sched = build_schedule(spec.replace(target=target))
        assert sched.grid.marks_only == TARGETS[target].marks_only
    assert TARGETS["cuda:sm_90"].marks_only == 2 and TARGETS["hip:gfx942"].marks_only == 0
    for level in (0, 1, 2):
        _, sched = build_schedule(spec, options=CompileOptions.parse(f"marks_only={level}"))
        assert sched.grid.marks_only == level
    _, sched = build_schedule(spec.replace(lanes=2))
    assert sched.grid.marks_only == 0             # a lane's residual waits for its peers' flags
    with pytest.raises(KiecError, match="marks_only.*lanes"):
        build_schedule(spec.replace(lanes=2), options=CompileOptions.parse("marks_only=1"))
    with pytest.raises(KiecError, match="marks_only"):
        CompileOptions.parse("marks_only=3")


def test_a_debug_build_stores_the_new_cache_rows_late_only_where_attention_reads_their_marked_copy(models):
    """kv_store_late keeps each step's K and V rows in acts (`kv_late`: layers x K, V x KV heads x
    head_dim, 16-bit) until the step's end. Only marks level 2 reads this step's rows from their
    marked copy; at 0 and 1, and so with lanes or on gfx942 by default, the option is refused."""
    spec = spec_of(models["tiny-llama"])
    _, sched = build_schedule(spec)
    assert not sched.grid.kv_store_late and "lane.kv_late" not in sched.memory["acts"]
    _, sched = build_schedule(spec, options=CompileOptions.parse("kv_store_late=1"))
    att = next(s for s in sched.stages if s.kind == "attention")
    assert sched.grid.kv_store_late and sched.grid.marks_only == 2
    assert sched.memory["acts"]["lane.kv_late"][1] == spec.config.layers * 2 * att.attr("kv_heads") * att.attr("head_dim") * 2
    for text, target in (("kv_store_late=1,marks_only=1", "cuda:sm_90"), ("kv_store_late=1,marks_only=0", "cuda:sm_90"),
                         ("kv_store_late=1", "hip:gfx942")):
        with pytest.raises(KiecError, match="kv_store_late.*marks_only is [01]"):
            build_schedule(spec.replace(target=target), options=CompileOptions.parse(text))
    with pytest.raises(KiecError, match="kv_store_late.*marks_only is 0"):
        build_schedule(spec.replace(lanes=2), options=CompileOptions.parse("kv_store_late=1"))
    with pytest.raises(KiecError, match="kv_store_late"):
        CompileOptions.parse("kv_store_late=2")


def test_a_stage_is_primed_by_the_tile_that_read_the_write_before_its_input(models):
    """codegen.primed_by: qkv(L) by gate_up(L - 1) (which read attn_out(L - 1)'s h whole), attention,
    attn_out, gate_up and down of layer L by qkv(L) (which read down(L - 1)'s h whole); level 1 leaves
    attention to its counter, combine_in_attn_out attn_out too, level 0 every stage."""
    from kiec.codegen import primed_by
    spec = spec_of(models["tiny-llama"])
    by_kind = {}
    for text in ("", "marks_only=1", "marks_only=0", "combine_in_attn_out=1"):
        _, sched = build_schedule(spec, options=CompileOptions.parse(text))
        index = {(s.kind, s.layer): s.index for s in sched.stages}
        by_kind[text] = {(s.kind, s.layer): primed_by(sched, s) for s in sched.stages}
    layers = spec.config.layers
    for layer in range(layers):
        qkv = index[("qkv", layer)]
        want = {"qkv": index[("gate_up", layer - 1)] if layer else "NONE",
                "attention": qkv, "attn_out": qkv, "gate_up": qkv, "down": qkv}
        for kind, stage in want.items():
            assert by_kind[""][(kind, layer)] == stage, (kind, layer)
            assert by_kind["marks_only=0"][(kind, layer)] == "NONE"
        assert by_kind["marks_only=1"][("attention", layer)] == "NONE"
        assert by_kind["marks_only=1"][("attn_out", layer)] == qkv
        assert by_kind["combine_in_attn_out=1"][("attn_out", layer)] == "NONE"
    assert by_kind[""][("lm_head", None)] == "NONE"


def test_ring_evict_first_comes_from_the_target_unless_asked(models):
    spec = spec_of(models["tiny-llama"])
    for target in TARGETS:
        _, sched = build_schedule(spec.replace(target=target))
        assert sched.grid.ring_evict_first == TARGETS[target].ring_evict_first
        _, sched = build_schedule(spec.replace(target=target), options=CompileOptions.parse("ring_evict_first=0"))
        assert not sched.grid.ring_evict_first
    with pytest.raises(KiecError, match="ring_evict_first"):
        build_schedule(spec.replace(target="hip:gfx942"), options=CompileOptions.parse("ring_evict_first=1"))


def test_the_producer_polls_its_barriers_only_when_asked(models):
    """producer_polls swaps the producer's try_wait (which may suspend) for test_wait in the kernel; the
    consumers' waits keep try_wait."""
    spec = spec_of(models["tiny-llama"])
    assert not build_schedule(spec)[1].grid.producer_polls
    kernels = {text: render_sources(spec, options=CompileOptions.parse(text))[2]["kernel.hip"]
               for text in ("", "producer_polls=1")}
    assert "constexpr bool PRODUCER_POLLS = false;" in kernels[""]
    assert "constexpr bool PRODUCER_POLLS = true;" in kernels["producer_polls=1"]
    assert kernels[""].count("wait_ring<PRODUCER_POLLS>(") == 2
    with pytest.raises(KiecError, match="producer_polls"):
        CompileOptions.parse("producer_polls=2")


@pytest.mark.parametrize("config", [
    preset("llama-3.2-1b", hidden_size=1024, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4,
           intermediate_size=4096),
    preset("qwen2.5-1.5b", num_hidden_layers=2, vocab_size=8192)], ids=["llama-lm-passes", "qwen-1.5b-rows"])
def test_the_steady_pairs_gpu_test_s_shapes_reach_the_steady_loop(tmp_path, config):
    """test_gpu.py's steady-pairs test compares logits bit for bit; it only means something where tiles go
    round the steady loop. On 132 multiprocessors every GEMV stage of its shapes but the LM head has rows
    of whole shares (the kernel's shares_in_groups: at least a slot wide, whole slots when a warp takes
    every eighth tile, whole runs when it takes a run), and gate_up's and down's tiles are two full slots
    or more."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    _, sched = build_schedule(load_spec({"weights": str(tmp_path), "max_seq_len": 256}), 132)
    assert sched.grid.steady_pairs
    grid, slot_units = sched.grid, sched.grid.slot_bytes // TILE_BYTES
    share = slot_units // grid.consumer_warps if grid.contiguous_units else slot_units
    for stage in sched.gemv_stages():
        if stage.kind == "lm_head":
            continue
        row_tiles = stage.gemv.stride // TILE_COLS
        assert row_tiles >= slot_units and row_tiles % share == 0, (stage.name, row_tiles)
        full_slots = -(-stage.gemv.rows_per_tile // TILE_ROWS) * row_tiles // slot_units
        assert stage.kind not in ("gate_up", "down") or full_slots >= 2, (stage.name, full_slots)


def test_consumers_take_at_most_what_the_launch_gave_the_block(models):
    """setmaxnreg moves registers within the launch's allocation (the register file over the threads,
    in steps of 8 a thread): consumers asking for more than the producer gave back wait forever (a
    producer keeping 48 hung the H200 with consumers at 232); a producer may only give registers and
    the consumers only take (16 consumer warps launch with 96 a thread: a producer keeping 104 failed
    in ptxas)."""
    spec = spec_of(models["tiny-llama"]).replace(target="cuda:sm_90")
    target = TARGETS["cuda:sm_90"]
    seen = {}
    for warps in (4, 8, 16):
        for kept in range(24, 129, 8):
            text = f"consumer_warps={warps},producer_registers={kept}"
            threads = (warps + target.producer_warps) * target.warp_size
            launched = min(240, 65536 // threads // 8 * 8)
            try:
                _, sched = build_schedule(spec, options=CompileOptions.parse(text))
            except KiecError as err:
                assert "producer_registers" in str(err)
                assert kept > launched or warps == 16, text      # refused only where it cannot work
                continue
            g = sched.grid
            assert g.threads == threads, text          # what the kernel launches, the producer's warpgroup too
            assert g.producer_registers == kept and kept <= launched, text
            assert g.consumer_registers % 8 == 0 and launched <= g.consumer_registers <= 240, text
            assert (g.consumer_registers * warps + kept * target.producer_warps) * target.warp_size <= launched * threads, text
            seen[warps, kept] = g.consumer_registers
    assert seen[8, 40] == 232 and seen[8, 48] == 224 and seen[8, 56] == 224
    assert (16, 104) not in seen and (16, 96) in seen
    with pytest.raises(KiecError, match="producer_registers"):
        CompileOptions.parse("producer_registers=44")
    with pytest.raises(KiecError, match="producer_registers"):
        build_schedule(spec.replace(target="hip:gfx942"), options=CompileOptions.parse("producer_registers=48"))


def test_attention_by_head_needs_a_tile_for_each_query_head(models):
    from kiec.codegen import _stage_entry, trace_layout
    spec = spec_of(models["tiny-llama"])
    _, sched = build_schedule(spec, options=CompileOptions.parse("attention_by_head=300,by_head_splits=1"))
    att = next(s for s in sched.stages if s.kind == "attention")
    group = att.attr("heads") // att.attr("kv_heads")
    assert att.attr("by_head_keys") == 300 and att.attr("splits") >= group > 1
    # attn_out waits for every query head's signal, not one a KV group
    trace, _ = trace_layout(sched)
    out = sched.stages[att.index + 1]
    assert _stage_entry(sched, out, trace, False)["wait_count"] == att.attr("kv_heads") * group
    # by default up to 512 keys go by head; with 0, none, and attn_out waits for a signal a KV group
    _, default = build_schedule(spec)
    assert next(s for s in default.stages if s.kind == "attention").attr("by_head_keys") == 512
    _, plain = build_schedule(spec, options=CompileOptions.parse("attention_by_head=0,by_head_splits=1"))
    assert _stage_entry(plain, plain.stages[att.index + 1], trace_layout(plain)[0], False)["wait_count"] == att.attr("kv_heads")
    # attn_out combining the splits has no by-head case: refused when asked, off by default
    with pytest.raises(KiecError, match="attention_by_head"):
        build_schedule(spec, options=CompileOptions.parse("attention_by_head=64,combine_in_attn_out=1"))
    _, combined = build_schedule(spec, options=CompileOptions.parse("combine_in_attn_out=1"))
    assert next(s for s in combined.stages if s.kind == "attention").attr("by_head_keys") == 0
    # with lanes it is off by default (a spill there) and on where asked
    _, lanes = build_schedule(spec_of(models["tiny-llama"], lanes=2))
    assert all(s.attr("by_head_keys") == 0 for s in lanes.stages if s.kind == "attention")
    _, asked = build_schedule(spec_of(models["tiny-llama"], lanes=2), options=CompileOptions.parse("attention_by_head=512"))
    assert all(s.attr("by_head_keys") == 512 for s in asked.stages if s.kind == "attention")


def test_attention_by_head_needs_room_for_a_tile_per_query_head(models):
    # tiny-qwen2 (a group of 3): its context needs 2 splits of 256 keys, but a KV head keeps a tile for
    # each query head, so the short context still goes by head (the bench's 160-position Qwen-1.5B lost
    # it and 7% a step)
    spec = spec_of(models["tiny-qwen2"])
    group = spec.config.heads // spec.config.kv_heads
    _, sched = build_schedule(spec, options=CompileOptions.parse("by_head_splits=1"))
    att = next(s for s in sched.stages if s.kind == "attention")
    assert -(-spec.max_seq_len // att.attr("batch")) < group
    assert att.attr("by_head_keys") == 512 and att.attr("splits") == group and att.tiles == spec.config.kv_heads * group
    # 4 blocks leave a KV head 2 tiles: off by default, refused when asked
    _, few = build_schedule(spec, multiprocessors=4)
    few_att = next(s for s in few.stages if s.kind == "attention")
    assert few_att.attr("splits") < group and few_att.attr("by_head_keys") == 0
    with pytest.raises(KiecError, match="attention_by_head.*query heads' tiles"):
        build_schedule(spec, multiprocessors=4, options=CompileOptions.parse("attention_by_head=256"))


def test_attention_waits_for_exactly_the_qkv_tiles_of_its_group(models):
    spec = spec_of(models["tiny-qwen2"])
    _, sched = build_schedule(spec)
    for s in sched.stages:
        if s.kind != "attention":
            continue
        qkv = sched.stages[s.index - 1]
        rpt = qkv.gemv.rows_per_tile
        for j, count in enumerate(s.attr("group_signals")):
            tiles = qkv_tiles_of_group(qkv, j)
            assert count == len(tiles)
            # brute force: a tile touches group j if any of its rows is one of the group's rows
            hd, q_rows, kv_rows = qkv.attr("head_dim"), qkv.attr("q_rows"), qkv.attr("kv_rows")
            group_q = q_rows // (kv_rows // hd)
            rows = set(range(j * group_q, (j + 1) * group_q)) | set(range(q_rows + j * hd, q_rows + (j + 1) * hd)) \
                | set(range(q_rows + kv_rows + j * hd, q_rows + kv_rows + (j + 1) * hd))
            want = sorted({r // rpt for r in rows})
            assert tiles == want


def test_compile_options_change_the_ring(models):
    spec = spec_of(models["tiny-llama"])
    _, base = build_schedule(spec)
    _, big = build_schedule(spec, options=CompileOptions(slot_bytes=32768, max_slots=3))
    assert base.grid.slot_bytes == TARGETS["cuda:sm_90"].slot_bytes
    assert (big.grid.slot_bytes, big.grid.slots) == (32768, 3)
    with pytest.raises(KiecError, match="slot_bytes"):
        CompileOptions(slot_bytes=1000)
    with pytest.raises(KiecError, match="nosuch"):
        CompileOptions.parse("nosuch=3")


def test_consumer_options_reach_the_grid_and_bad_values_are_named(models):
    spec = spec_of(models["tiny-llama"])
    _, base = build_schedule(spec)
    assert (base.grid.reduce_batch, base.grid.warp_release, base.grid.timing_only) == (8, False, 0)
    _, tuned = build_schedule(spec, options=CompileOptions.parse("reduce_batch=1,warp_release=1,timing_only=2"))
    assert (tuned.grid.reduce_batch, tuned.grid.warp_release, tuned.grid.timing_only) == (1, True, 2)
    for text, field in [("reduce_batch=3", "reduce_batch"), ("warp_release=2", "warp_release"),
                        ("timing_only=7", "timing_only")]:
        with pytest.raises(KiecError, match=field):
            CompileOptions.parse(text)
    with pytest.raises(KiecError, match=r"option: got 'slot_byte'; expected one of .*\(did you mean 'slot_bytes'\?\)"):
        CompileOptions.parse("slot_byte=16384")
    with pytest.raises(KiecError, match=r"option slot_pairs: got 'x'; expected an integer"):
        CompileOptions.parse("slot_pairs=x")
    with pytest.raises(KiecError, match=r"option slot_pairs: .*slot_pairs given once"):
        CompileOptions.parse("slot_pairs=0,slot_pairs=1")


@pytest.mark.parametrize("target,text,tiled", [("cuda:sm_90", "", True), ("cuda:sm_90", "gemv_tiles=0", False),
                                               ("hip:gfx942", "", False)])
def test_matrices_are_tiled_where_the_target_has_tiles(models, target, text, tiled):
    spec = spec_of(models["tiny-qwen2"], target=target)
    _, sched = build_schedule(spec, options=CompileOptions.parse(text))
    for s in sched.gemv_stages():
        g = s.gemv
        assert g.tiled == tiled, s.name
        if tiled:        # whole row groups per tile, rows of whole column tiles, each warp a tile in every row
            assert g.rows_per_tile % TILE_ROWS == 0 and g.stride % TILE_COLS == 0
            assert g.stride >= TILE_COLS * sched.grid.consumer_warps
            assert g.unit_bytes == TILE_ROWS * TILE_COLS * 2 and g.bytes == g.packed_rows * g.stride * 2
            assert g.packed_rows % TILE_ROWS == 0 and g.packed_rows - g.rows < TILE_ROWS
    # the embedding stays rows (one a step is read); a tied LM head then gets a tiled copy of its own
    assert ("lm_head" in sched.memory["weights"]) == (tiled or not spec.config.tie_embeddings)


def test_fp16_weights_keep_rows_unless_asked(tmp_path):
    # tiles carry x as two 16-bit halves; fp16's range would overflow where bf16's does not
    folder = write_random_model(tmp_path / "fp16", "tiny-llama", seed=3, dtype="fp16")
    for text, tiled in [("", False), ("gemv_tiles=1", True)]:
        _, sched = build_schedule(spec_of(folder, dtype="fp16"), options=CompileOptions.parse(text))
        assert all(s.gemv.tiled == tiled for s in sched.gemv_stages())


def test_tiles_need_a_target_that_has_them(models):
    spec = spec_of(models["tiny-llama"], target="hip:gfx942")
    with pytest.raises(KiecError, match="gemv_tiles"):
        build_schedule(spec, options=CompileOptions.parse("gemv_tiles=1"))
    with pytest.raises(KiecError, match="gemv_tiles"):
        CompileOptions.parse("gemv_tiles=2")
    with pytest.raises(KiecError, match="slot_groups"):       # warp groups taking turns need tiled matrices
        build_schedule(spec, options=CompileOptions.parse("slot_groups=2"))
    with pytest.raises(KiecError, match="slot_groups"):
        CompileOptions.parse("slot_groups=3")
    with pytest.raises(KiecError, match="tile_accumulators"):   # so do the accumulators products go round
        build_schedule(spec, options=CompileOptions.parse("tile_accumulators=2"))
    with pytest.raises(KiecError, match="tile_accumulators"):
        CompileOptions.parse("tile_accumulators=3")
    cuda = spec.replace(target="cuda:sm_90")
    assert build_schedule(cuda)[1].grid.tile_accumulators == 2
    _, tuned = build_schedule(cuda, options=CompileOptions.parse("tile_accumulators=4"))
    assert tuned.grid.tile_accumulators == 4
    _, sched = build_schedule(cuda, options=CompileOptions.parse("slot_groups=2"))
    assert sched.grid.slot_groups == 2 and sched.grid.slots % 2 == 0     # a slot stays with one group
    with pytest.raises(KiecError, match="slot_bytes"):    # 10 tiles a slot: not whole tiles for 8 warps
        build_schedule(cuda, options=CompileOptions.parse("slot_bytes=5120"))
    _, wide = build_schedule(cuda, options=CompileOptions.parse("consumer_warps=16"))
    assert all(s.gemv.stride >= 16 * TILE_COLS for s in wide.gemv_stages())  # a tile per warp in every row


def test_slot_pairs_are_on_where_one_group_reads_at_most_4_tiles_a_warp(models):
    """A pair holds two slots' loads in registers: on by default for tiled matrices read by one warp
    group, 4 tiles a warp a slot at most; asked for elsewhere it is refused by name."""
    cuda = spec_of(models["tiny-llama"], target="cuda:sm_90")
    pairs = {text: build_schedule(cuda, options=CompileOptions.parse(text))[1].grid.slot_pairs
             for text in ("", "slot_pairs=0", "slot_groups=2", "slot_bytes=32768", "gemv_tiles=0")}
    assert pairs == {"": True, "slot_pairs=0": False, "slot_groups=2": False, "slot_bytes=32768": False,
                     "gemv_tiles=0": False}
    _, amd = build_schedule(spec_of(models["tiny-llama"], target="hip:gfx942"))
    assert not amd.grid.slot_pairs
    for text, why in (("slot_pairs=1,slot_groups=2", "in 2 groups"), ("slot_pairs=1,slot_bytes=32768", "32768 bytes"),
                      ("slot_pairs=1,gemv_tiles=0", "not tiled")):
        with pytest.raises(KiecError, match=why):
            build_schedule(cuda, options=CompileOptions.parse(text))
    with pytest.raises(KiecError, match="slot_pairs"):
        CompileOptions.parse("slot_pairs=2")
    # full pairs in a loop of their own: wherever there are pairs, unless turned off
    assert build_schedule(cuda)[1].grid.steady_pairs
    assert not build_schedule(cuda, options=CompileOptions.parse("steady_pairs=0"))[1].grid.steady_pairs
    assert not build_schedule(cuda, options=CompileOptions.parse("slot_pairs=0"))[1].grid.steady_pairs
    assert not amd.grid.steady_pairs
    across = spec_of(models["tiny-llama"], target="cuda:sm_90", lanes=2, gpus=2)   # timed on one device only
    assert build_schedule(across)[1].grid.slot_pairs and not build_schedule(across)[1].grid.steady_pairs
    assert build_schedule(across, options=CompileOptions.parse("steady_pairs=1"))[1].grid.steady_pairs
    with pytest.raises(KiecError, match="steady_pairs: got 1.*slot pairs are off"):
        build_schedule(cuda, options=CompileOptions.parse("steady_pairs=1,slot_pairs=0"))
    with pytest.raises(KiecError, match="steady_pairs"):
        CompileOptions.parse("steady_pairs=2")


def test_tiled_order_is_the_kernel_s_and_round_trips():
    rows, stride = 13, 96                       # a last group of 5 rows, padded with zero rows
    m = np.arange(rows * stride, dtype=np.float32).reshape(rows, stride) + 1
    t = tile_rows(m)
    assert t.shape == (16, stride)
    flat = t.reshape(-1)
    for r in range(rows):                       # the kernel's weight_at, element by element
        for c in range(stride):
            at = (r // TILE_ROWS) * TILE_ROWS * stride + (c // TILE_COLS) * TILE_ROWS * TILE_COLS \
                + (r % TILE_ROWS) * TILE_COLS + c % TILE_COLS
            assert flat[at] == m[r, c]
    assert np.count_nonzero(flat) == rows * stride          # the padding rows are zeros
    assert np.array_equal(untile_rows(t, rows), m)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_scratch_holds_x_and_a_norm_stage_s_staged_weights(models, name):
    # a norm stage copies its norm weights past x before its wait; the LM head one lane's raw h
    spec = spec_of(models[name])
    _, sched = build_schedule(spec)
    for s in sched.stages:
        tiles = 4 * s.gemv.stride if s.gemv is not None and s.gemv.tiled else 0   # x rounded, and the rest
        if s.kind in ("qkv", "gate_up", "lm_head"):
            assert sched.grid.scratch_bytes >= 4 * (s.gemv.stride + s.gemv.cols) + tiles, s.name
        if s.gemv is not None and s.gemv.tiled:         # one partial per row and warp
            parts = s.gemv.rows_per_tile * sched.grid.consumer_warps
            assert sched.grid.scratch_bytes >= 4 * (s.gemv.stride + parts) + tiles, s.name


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral"])
def test_memplan_regions_do_not_overlap_and_are_aligned(models, name):
    spec = spec_of(models[name])
    _, sched = build_schedule(spec)
    for region, entries in sched.memory.items():
        # weights keep lane entries relative to the lane region; the other regions hold lane 0 absolute
        base = entries["__lanes_base"][0] if region == "weights" else 0
        spans = sorted((o + (base if k.startswith("lane.") else 0), o + n + (base if k.startswith("lane.") else 0), k)
                       for k, (o, n) in entries.items() if not k.startswith("__") and n)
        for (a0, a1, ka), (b0, b1, kb) in zip(spans, spans[1:]):
            assert a1 <= b0, f"{region}: {ka} overlaps {kb}"
        align = 128 if region == "sync" else 256
        assert all(o % align == 0 for o, _, _ in spans)
    sync = sched.memory["sync"]
    lines = [o // 128 for k, (o, n) in sync.items() if not k.startswith("__")]
    assert len(lines) == len(set(lines))             # every counter and flag on its own cache line
    for s in sched.gemv_stages():
        assert s.gemv.offset % 256 == 0


def test_pair_permutation_round_trips():
    rows = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    p = permute_pairs(rows, 8, "half")
    assert np.array_equal(p[0], rows[0]) and np.array_equal(p[1], rows[4])     # (x[j], x[j + hd/2]) adjacent
    assert np.array_equal(unpermute_pairs(p, 8, "half"), rows)
    assert permute_pairs(rows, 8, "adjacent") is rows


def _twin_vs_reference(spec, positions, blocks=None, options=None):
    graph, sched = build_schedule(spec, blocks, options=options)
    weights = reference_weights(graph, load_checkpoint(spec))
    blob = pack_weights(sched, weights, spec.config, spec.max_seq_len, spec.dtype)
    twin = Twin(sched, blob, spec.config, spec.max_seq_len, spec.dtype)
    ref = Reference(graph, weights, spec.config, spec.max_seq_len, np.float64)
    rng = np.random.default_rng(5)
    worst = 0.0
    for pos in range(positions):
        token = int(rng.integers(spec.config.vocab))
        want = ref.forward([token])[-1]
        got, trace = twin.step(token, pos)
        assert np.all(np.isfinite(got))
        worst = max(worst, float(np.linalg.norm(got - want) / np.linalg.norm(want)))
        assert np.argmax(got) == np.argmax(want) or np.sort(want)[-1] - np.sort(want)[-2] < 1e-2
    return worst


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_twin_follows_the_reference(models, name):
    # bf16 checkpoints: the blob holds the same weights, the twin differs by its bf16 KV cache only
    assert _twin_vs_reference(spec_of(models[name]), 40) < TWIN_TOLERANCE


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral"])
def test_twin_follows_the_reference_with_down_in_column_halves(models, name):
    spec = spec_of(models[name])
    options = CompileOptions.parse("down_halves=1")
    _, sched = build_schedule(spec, options=options)
    assert all(s.attr("half_tiles") for s in sched.stages if s.kind == "down")
    assert _twin_vs_reference(spec, 20, options=options) < TWIN_TOLERANCE


def _down(tmp_path, name, text="", blocks=132, **spec):
    folder = tmp_path / f"{name}-{text}-{blocks}-{len(spec)}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(preset(name)))
    _, sched = build_schedule(load_spec({"weights": str(folder), "max_seq_len": 512, **spec}), blocks,
                              options=CompileOptions.parse(text))
    return sched, [s for s in sched.stages if s.kind == "down"]


def test_down_takes_its_columns_in_halves_where_its_largest_tile_shrinks(tmp_path):
    # Qwen-1.5B: 192 row groups on 132 blocks make 96 tiles of 2 groups (280 KiB); halves, 128 of 3 (210 KiB)
    sched, downs = _down(tmp_path, "qwen2.5-1.5b")
    whole_sched, whole = _down(tmp_path, "qwen2.5-1.5b", "down_halves=0")
    hidden, ffn = sched.config["hidden"], 8960
    for d, w in zip(downs, whole):
        assert (d.gemv.rows, d.gemv.cols, d.tiles, d.attr("half_tiles"), d.gemv.rows_per_tile) == (2 * hidden, ffn // 2, 128, 64, 24)
        assert (w.tiles, w.attr("half_tiles"), w.gemv.rows_per_tile) == (96, None, 16)
        assert d.gemv.rows_per_tile * d.gemv.stride < w.gemv.rows_per_tile * w.gemv.stride
    assert "lane.h_part" in sched.memory["sync"] and "lane.h_part" not in whole_sched.memory["sync"]
    assert {e["kind"] for e in sched.packing if e["name"].endswith(".down")} == {"halves"}
    assert sched.grid.slots == whole_sched.grid.slots + 1          # down's x halved: a twelfth slot
    # Llama-1B's 256 groups make 128 tiles of 2 either way: its down stays whole unless asked
    sched, downs = _down(tmp_path, "llama-3.2-1b")
    assert not any(d.attr("half_tiles") for d in downs) and "lane.h_part" not in sched.memory["sync"]
    assert all((d.attr("half_tiles"), d.tiles) == (64, 128) for d in _down(tmp_path, "llama-3.2-1b", "down_halves=1")[1])


def test_down_halves_name_what_they_need(tmp_path):
    with pytest.raises(KiecError, match="down_halves: got 1; expected 0 here: halves need a hidden size in groups of 8"):
        _down(tmp_path, "tiny-qwen2", "down_halves=1")                  # 160 columns: not two halves of 32-column tiles
    with pytest.raises(KiecError, match="halves need one lane"):
        _down(tmp_path, "tiny-llama", "down_halves=1", lanes=2)
    with pytest.raises(KiecError, match="halves need tiled matrices"):
        _down(tmp_path, "tiny-llama", "down_halves=1,gemv_tiles=0")
    assert not any(d.attr("half_tiles") for d in _down(tmp_path, "tiny-llama", lanes=2)[1])
    # 77 blocks: Qwen-1.5B's halves would need 78 tiles; by default down then stays whole
    assert not any(d.attr("half_tiles") for d in _down(tmp_path, "qwen2.5-1.5b", blocks=77)[1])
    with pytest.raises(KiecError, match=r"halves need two halves' tiles \(78\) within the lane's 77 blocks"):
        _down(tmp_path, "qwen2.5-1.5b", "down_halves=1", blocks=77)
    with pytest.raises(KiecError, match="down_halves"):
        CompileOptions.parse("down_halves=2")


@pytest.mark.parametrize("splits,batch", [(1, 32), (3, 32), (16, 32), (16, 64), (5, 8)])
@pytest.mark.parametrize("min_batches", [1, 4])
def test_attention_splits_cover_the_context_in_whole_batches(splits, batch, min_batches):
    for lo in (0, 7):
        for pos in range(lo, lo + 700, 13):
            length, used = attention_splits(lo, pos, splits, batch, min_batches * batch)
            assert length % batch == 0 and length >= min_batches * batch and 1 <= used <= splits
            assert (used - 1) * length < pos + 1 - lo <= used * length       # every split has keys
            if pos + 1 - lo <= min_batches * batch:
                assert used == 1                                            # a short context: no combine


def test_attention_splits_give_a_context_up_to_by_head_keys_one_split():
    # 64 splits of one batch would cover 200 keys in 4 splits; scored by head they are one split
    assert attention_splits(0, 199, 64, 64, 64) == (64, 4)
    assert attention_splits(0, 199, 64, 64, 64, by_head_keys=512) == (256, 1)
    assert attention_splits(10, 521, 64, 64, 64, by_head_keys=512) == (512, 1)         # 512 keys from 10
    assert attention_splits(0, 512, 64, 64, 64, by_head_keys=512) == (64, 9)           # 513: split again


def test_by_head_splits_cut_a_query_heads_context_in_equal_parts():
    # 129 keys (context 128) in 2 splits of 65 and 64, in 3 of 43; one key in 4 splits is one split used
    # (the other three tiles run empty); past by_head_keys the splits are the split path's again
    assert attention_splits(0, 128, 64, 64, 64, by_head_keys=512, by_head_splits=2) == (65, 2)
    assert attention_splits(0, 128, 64, 64, 64, by_head_keys=512, by_head_splits=3) == (43, 3)
    assert attention_splits(0, 0, 64, 64, 64, by_head_keys=512, by_head_splits=4) == (1, 1)
    assert attention_splits(0, 512, 64, 64, 64, by_head_keys=512, by_head_splits=2) == (64, 9)
    for parts in (2, 3, 5):
        for lo in (0, 7):
            for pos in range(lo, lo + 512, 11):
                length, used = attention_splits(lo, pos, 64, 64, 64, by_head_keys=512, by_head_splits=parts)
                n = pos + 1 - lo
                assert 1 <= used <= parts and (used - 1) * length < n <= used * length, (parts, lo, pos)
                assert length == -(-n // parts)                     # the parts differ by a key at most


def test_by_head_splits_give_a_kv_head_a_tile_per_query_head_and_split(models):
    spec = spec_of(models["tiny-qwen2"])                  # a group of 3
    group = spec.config.heads // spec.config.kv_heads
    _, sched = build_schedule(spec, options=CompileOptions.parse("by_head_splits=3"))
    att = next(s for s in sched.stages if s.kind == "attention")
    assert att.attr("by_head_splits") == 3 and att.attr("splits") >= 3 * group
    assert att.tiles == spec.config.kv_heads * att.attr("splits")
    # more splits than a KV head has tiles for, or splits of a context that never goes by head: refused
    assert spec.config.kv_heads == 2                     # 12 blocks: 6 tiles a KV head, 2 splits of 3 heads
    _, two = build_schedule(spec, multiprocessors=12, options=CompileOptions.parse("by_head_splits=2"))
    assert next(s for s in two.stages if s.kind == "attention").attr("splits") == 6
    with pytest.raises(KiecError, match="by_head_splits.*at most 2"):
        build_schedule(spec, multiprocessors=12, options=CompileOptions.parse("by_head_splits=3"))
    with pytest.raises(KiecError, match="by_head_splits.*attention_by_head 0"):
        build_schedule(spec, options=CompileOptions.parse("by_head_splits=2,attention_by_head=0"))
    with pytest.raises(KiecError, match="by_head_splits"):
        CompileOptions.parse("by_head_splits=17")


def test_by_head_splits_by_default_keep_the_by_head_tiles_within_a_third_of_the_blocks():
    """Qwen-1.5B's 12 heads take 3 splits (36 tiles of 132 blocks), Llama-1B's 32 none (2 would be 64);
    fewer blocks and a KV head's room give fewer, a lane without marked outputs and a context that never
    goes by head none, and a count asked for holds."""
    def attention(name, multiprocessors=None, text="", target=None, **config):
        spec = load_spec({"weights": ".", "config": dict(preset(name), **config), "max_seq_len": 8224})
        _, sched = build_schedule(spec.replace(target=target) if target else spec, multiprocessors,
                                  options=CompileOptions.parse(text))
        return next(s for s in sched.stages if s.kind == "attention")
    qwen = attention("qwen2.5-1.5b")
    assert qwen.attr("heads") == 12 and qwen.attr("by_head_splits") == 3
    assert qwen.tiles == qwen.attr("kv_heads") * qwen.attr("splits") and qwen.attr("splits") >= 6 * 3
    assert attention("llama-3.2-1b").attr("by_head_splits") == 1
    assert attention("qwen2.5-1.5b", 100).attr("by_head_splits") == 2          # 12 x 3 > 100 // 3
    assert attention("qwen2.5-1.5b", 32).attr("by_head_splits") == 1           # 12 x 2 > 32 // 3
    assert attention("qwen2.5-1.5b", text="by_head_splits=2").attr("by_head_splits") == 2
    assert attention("qwen2.5-1.5b", text="marks_only=0").attr("by_head_splits") == 1
    assert attention("qwen2.5-1.5b", target="hip:gfx942").attr("by_head_splits") == 1   # no marks alone
    assert attention("qwen2.5-1.5b", text="attention_by_head=0").attr("by_head_splits") == 1
    # a KV head's room caps them: 8 warps of 8-wide heads keep (8 x 8 - 1) // 2 = 31 tiles' weights, 2
    # splits of a group of 12
    assert attention("qwen2.5-1.5b", hidden_size=96, num_attention_heads=12, num_key_value_heads=1).attr("by_head_splits") == 2


@pytest.mark.parametrize("name,blocks,text", [("tiny-mistral", None, "split_batches=1"),
                                              ("tiny-mistral-full", None, "split_batches=1"),
                                              ("tiny-mistral-full", None, "by_head_splits=3"),
                                              ("tiny-mistral-full", 2, "split_batches=1"), ("tiny-mistral-full", None, "")])
def test_twin_follows_the_reference_past_splits_and_window(models, name, blocks, text):
    # the window (16) moves the splits' start; without it 132 blocks give splits of one batch, 2 blocks
    # two splits of several batches; by default a split takes at least min_split keys
    spec = spec_of(models[name], max_seq_len=1024)
    options = CompileOptions.parse(text)
    _, sched = build_schedule(spec, blocks, options=options)
    att = next(s for s in sched.stages if s.kind == "attention")
    positions = att.attr("min_split") + att.attr("batch") * 2 + 10
    length, used = attention_splits(0, positions - 1, att.attr("splits"), att.attr("batch"), att.attr("min_split"))
    assert used >= 2 and (name == "tiny-mistral" or blocks is None or length > att.attr("batch"))
    assert length >= att.attr("min_split") and positions < spec.max_seq_len
    assert _twin_vs_reference(spec, positions, blocks, options) < TWIN_TOLERANCE


def test_twin_follows_the_reference_with_lanes(models):
    # the lane protocol of the schedule (present everywhere) and DTP past(1) as an explicit approximation
    for changes in ({"lanes": 2}, {"lanes": 2, "dtp_delay": 1}):
        assert _twin_vs_reference(spec_of(models["tiny-llama"], **changes), 12) < TWIN_TOLERANCE
