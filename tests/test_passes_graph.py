"""The graph passes on small IR: lower (each architecture), shard (shapes, the rule table,
divisibility), dtp (modes per layer), verify (catches broken graphs), Graph JSON round trip."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kiec.errors import KiecError
from kiec.ir.graph import OPS, Graph, Op, Tensor, verify
from kiec.model import load_spec
from kiec.passes.dtp import dtp, reduce_mode
from kiec.passes.lower import lower
from kiec.passes.shard import RULES, shard
from kiec.pipeline import build_graph
from kiec.synthetic import preset, write_random_model
from refcheck import prompt_then_decode, reference

LAYER_OPS = ["RMSNorm", "Linear", "Linear", "Linear", "RoPE", "RoPE", "KVAppend", "Attention", "Linear",
             "LaneReduce", "Add", "RMSNorm", "Linear", "Linear", "SwiGLU", "Linear", "LaneReduce", "Add"]
TINY_QWEN2 = dict(model_type="qwen2", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=96, vocab_size=128, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=True, sliding_window=8,
                  max_window_layers=2)
TINY_LANEFORMER = dict(model_type="laneformer_tp", hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=64, vocab_size=96, max_position_embeddings=64,
                       num_lanes=2, broadcast_delay=2, sliding_window=4, sliding_window_n_layers=-1)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": write_random_model(root / "llama", "tiny-llama", seed=0, dtype="fp32"),
        "qwen2": write_random_model(root / "qwen2", TINY_QWEN2, seed=1, dtype="fp32"),
        "mistral": write_random_model(root / "mistral", "tiny-mistral", seed=2, dtype="fp32"),
        "mistral-kv4": write_random_model(root / "mistral-kv4", preset("tiny-mistral", num_key_value_heads=4),
                                          seed=2, dtype="fp32"),
        "laneformer": write_random_model(root / "laneformer", TINY_LANEFORMER, seed=3, dtype="fp32"),
    }


def _spec(folders, arch, **overrides):
    return load_spec(str(folders[arch]), dict({"max_seq_len": 32}, **overrides))


# --- lower -------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "laneformer"])
def test_lower_structure(folders, arch):
    spec = _spec(folders, arch)
    cfg = spec.config
    g = lower(spec)
    assert g.arch == arch and g.lanes == (cfg.lanes if arch == "laneformer" else 1)
    kinds = [op.kind for op in g.ops]
    assert kinds[0] == "Embed" and kinds[-2:] == ["LMHead", "Select"]
    for i in range(cfg.layers):
        assert [op.kind for op in g.layer_ops(i)] == LAYER_OPS
    assert {op.attr("mode") for op in g.ops if op.kind == "LaneReduce"} == {"present"}
    assert {op.attr("pairs") for op in g.ops if op.kind == "RoPE"} == {"adjacent" if arch == "laneformer" else "half"}
    assert g.tensors["logits"].shape == (cfg.vocab,)
    assert verify(g) is g


def test_lower_llama_shapes(folders):
    spec = _spec(folders, "llama")
    cfg = spec.config
    g = lower(spec)
    d, q, kv, f = cfg.hidden, cfg.q_dim, cfg.kv_dim, cfg.ffn
    want = {"embed": (cfg.vocab, d), "layers.1.attn_norm": (d,), "layers.1.wq": (1, q, d), "layers.1.wk": (1, kv, d),
            "layers.1.wv": (1, kv, d), "layers.1.wo": (1, d, q), "layers.1.w_gate": (1, f, d),
            "layers.1.w_up": (1, f, d), "layers.1.w_down": (1, d, f), "final_norm": (d,), "lm_head": (cfg.vocab, d)}
    assert {n: g.tensors[n].shape for n in want} == want
    assert g.tensors["lm_head"].source == "lm_head"
    assert not any(t.role.startswith("b") for t in g.weights())
    assert {(op.attr("window")) for op in g.ops if op.kind == "Attention"} == {0}


def test_lower_qwen2_biases_tied_head_and_window_layers(folders):
    g = lower(_spec(folders, "qwen2"))
    for name in ("wq", "wk", "wv"):
        op = next(op for op in g.layer_ops(0) if op.kind == "Linear" and op.inputs[1] == f"layers.0.{name}")
        assert op.inputs[2] == f"layers.0.b{name[1:]}" and g.tensors[op.inputs[2]].role == f"b{name[1:]}"
    plain = [op for op in g.layer_ops(0) if op.kind == "Linear" and op.inputs[1].endswith(("wo", "w_gate", "w_down"))]
    assert len(plain) == 3 and all(len(op.inputs) == 2 for op in plain)
    assert g.tensors["lm_head"].source == "embed"
    # use_sliding_window with max_window_layers=2: layers >= 2 use the window
    assert [op.attr("window") for op in g.ops if op.kind == "Attention"] == [0, 0, 8]


def test_lower_mistral_window_and_head_dim(folders):
    spec = _spec(folders, "mistral")
    g = lower(spec)
    want = preset("tiny-mistral")
    assert [op.attr("window") for op in g.ops if op.kind == "Attention"] == [want["sliding_window"]] * 3
    assert g.tensors["layers.0.wq"].shape == (1, want["num_attention_heads"] * want["head_dim"], want["hidden_size"])
    att = next(op for op in g.ops if op.kind == "Attention")
    assert (att.attr("heads"), att.attr("kv_heads"), att.attr("head_dim")) == (4, 1, 32)


@pytest.mark.parametrize("changes, head, head_shape, norm_shape, final_shape, lane_sum", [
    ({}, "replicate", (96, 32), (32,), (32,), False),
    (dict(lm_head_type="lane"), "lane", (96, 64), (32,), (32,), False),
    (dict(lm_head_type="vocab_parallel", replicated_rmsn_scale=False), "vocab_parallel", (2, 48, 32), (2, 32),
     (2, 32), False),
    (dict(pre_norm_lane_agg=True, replicated_rmsn_scale=False), "replicate", (96, 32), (2, 32), (32,), True),
])
def test_lower_laneformer_variants(tmp_path, changes, head, head_shape, norm_shape, final_shape, lane_sum):
    spec = load_spec(str(write_random_model(tmp_path, dict(TINY_LANEFORMER, **changes), dtype="fp32")))
    g = lower(spec)
    assert g.lanes == 2
    assert g.tensors["layers.0.wq"].shape == (2, 16, 32) and g.tensors["layers.0.wq"].layout == "native"
    assert g.tensors["layers.0.wo"].shape == (2, 32, 16)
    assert g.tensors["layers.0.w_down"].shape == (2, 32, 32)
    assert g.tensors["layers.2.attn_norm"].shape == norm_shape
    assert g.tensors["final_norm"].shape == final_shape
    assert g.tensors["lm_head"].shape == head_shape
    lm = next(op for op in g.ops if op.kind == "LMHead")
    assert lm.attr("head") == head
    assert any(op.kind == "LaneSum" for op in g.ops) == lane_sum
    assert [op.attr("window") for op in g.ops if op.kind == "Attention"] == [0, 0, 0, 4]


# --- shard -------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch, lanes", [("llama", 2), ("qwen2", 2), ("mistral-kv4", 4)])
def test_shard_shapes_and_rules(folders, arch, lanes):
    spec = _spec(folders, arch)
    cfg = spec.config
    one = lower(spec)
    g = verify(shard(one, lanes))
    assert g.lanes == lanes
    for t in g.weights():
        before = one.tensors[t.name]
        rule = RULES[t.role]
        if rule == "replicate":
            assert t == before
            continue
        assert t.layout == rule and t.shape[0] == lanes and t.source == before.source
        if rule == "colwise":
            assert t.shape == (lanes, before.shape[1] // lanes) + before.shape[2:]
        else:
            assert t.shape == (lanes, before.shape[1], before.shape[2] // lanes)
    assert g.tensors["layers.0.wq"].shape == (lanes, cfg.q_dim // lanes, cfg.hidden)
    assert g.tensors["layers.0.wo"].shape == (lanes, cfg.hidden, cfg.q_dim // lanes)
    assert g.tensors["layers.0.w_down"].shape == (lanes, cfg.hidden, cfg.ffn // lanes)
    for op in g.ops:
        if op.kind in ("RoPE", "Attention"):
            assert op.attr("heads") in (cfg.heads // lanes, cfg.kv_heads // lanes)
        if op.kind in ("Attention", "KVAppend"):
            assert op.attr("kv_heads") == cfg.kv_heads // lanes
    assert next(op for op in g.ops if op.kind == "Embed").attr("lanes") == lanes
    assert g.tensors["layers.0.wo.out"].shape == (lanes, cfg.hidden)     # a full-width partial per lane


def test_rule_table_covers_every_role(folders):
    roles = set()
    for arch in ("llama", "qwen2", "mistral-kv4"):
        roles |= {t.role for t in lower(_spec(folders, arch)).weights()}
    assert roles <= set(RULES)
    assert {r for r in RULES if RULES[r] == "rowwise"} == {"wo", "w_down"}
    assert {r for r in RULES if RULES[r] == "colwise"} == {"wq", "wk", "wv", "bq", "bk", "bv", "w_gate", "w_up"}


def test_materialized_shards_are_the_canonical_slices(folders):
    from kiec.weights import load_checkpoint, materialize
    spec = _spec(folders, "qwen2", lanes=2)
    ckpt = load_checkpoint(spec)
    g = build_graph(spec)
    for name in ("layers.1.wq", "layers.1.bk", "layers.1.w_up", "layers.1.wo", "layers.1.w_down", "embed"):
        full = ckpt.get(g.tensors[name].source)
        got = materialize(ckpt, g.tensors[name])
        for lane in range(2):
            rule = RULES[g.tensors[name].role]
            if rule == "colwise":
                n = full.shape[0] // 2
                np.testing.assert_array_equal(got[lane], full[lane * n:(lane + 1) * n])
            elif rule == "rowwise":
                n = full.shape[1] // 2
                np.testing.assert_array_equal(got[lane], full[:, lane * n:(lane + 1) * n])
            else:
                np.testing.assert_array_equal(got, full)


@pytest.mark.parametrize("lanes, what", [(3, "heads"), (4, "kv_heads")])
def test_shard_divisibility(folders, lanes, what):
    with pytest.raises(KiecError) as info:
        shard(lower(_spec(folders, "llama")), lanes)
    assert info.value.field == "lanes" and info.value.value == lanes


def test_shard_ffn_divisibility():
    g = Graph("llama", 1)
    g.weight("w", (1, 6, 4), "w_gate")
    with pytest.raises(KiecError) as info:
        shard(g, 4)
    assert info.value.field == "lanes" and "w's 6 rows" in info.value.expected
    g = Graph("llama", 1)
    g.weight("w", (1, 8, 6), "w_down")
    with pytest.raises(KiecError) as info:
        shard(g, 4)
    assert "w's 6 columns" in info.value.expected


def test_shard_leaves_a_laneformer_as_stored(folders):
    g = lower(_spec(folders, "laneformer"))
    assert shard(g, 2) is g
    with pytest.raises(KiecError) as info:
        shard(g, 4)
    assert info.value.field == "lanes" and "(2)" in info.value.expected


# --- dtp ---------------------------------------------------------------------------------------

def _modes(g):
    return [(op.layer, op.attr("sublayer"), op.attr("mode"), op.attr("delay")) for op in g.ops if op.kind == "LaneReduce"]


def _per_layer(layers, mode_of):
    return [(i, s) + mode_of(i) for i in range(layers) for s in ("attn", "mlp")]


def test_dtp_standard_model(folders):
    spec = _spec(folders, "mistral-kv4", lanes=2)
    g = shard(lower(spec), 2)
    assert _modes(dtp(g, spec.config)) == _per_layer(3, lambda i: ("present", 0))
    assert _modes(dtp(g, spec.config, 1)) == _per_layer(3, lambda i: ("present", 0) if i < 1 else ("past", 1))
    assert _modes(dtp(g, spec.config, 2)) == _per_layer(3, lambda i: ("present", 0) if i < 2 else ("past", 2))
    assert _modes(build_graph(spec.replace(dtp_delay=2))) == _modes(dtp(g, spec.config, 2))
    assert spec.replace(dtp_delay=2).approximate and not spec.approximate


@pytest.mark.parametrize("delay, early, comm, want", [
    (2, True, True, ["present", "present", "past", "past", "past"]),
    (1, True, True, ["present", "past", "past", "past", "past"]),
    (2, False, True, ["none", "none", "past", "past", "past"]),
    (3, True, False, ["present", "present", "present", "none", "none"]),
    (1, False, False, ["none"] * 5),
])
def test_dtp_laneformer_modes(tmp_path, delay, early, comm, want):
    config = dict(TINY_LANEFORMER, num_hidden_layers=5, broadcast_delay=delay, use_early_comm=early, use_comm=comm)
    spec = load_spec(str(write_random_model(tmp_path, config, dtype="fp32")))
    assert not spec.approximate
    got = _modes(build_graph(spec))
    assert got == _per_layer(5, lambda i: (want[i], delay if want[i] == "past" else 0))
    assert [reduce_mode(spec.config, i, None)[0] for i in range(5)] == want


def test_dtp_delay_overrides_a_laneformers_own(folders):
    spec = _spec(folders, "laneformer")                 # broadcast_delay 2, 4 layers
    g = lower(spec)
    assert _modes(dtp(g, spec.config, 1)) == _per_layer(4, lambda i: ("present", 0) if i < 1 else ("past", 1))
    assert _modes(dtp(g, spec.config, 4)) == _per_layer(4, lambda i: ("present", 0))


# --- verify and the graph itself ---------------------------------------------------------------

@pytest.fixture()
def llama_graph(folders):
    return build_graph(_spec(folders, "llama", lanes=2, dtp_delay=1))


def _rebuilt(g: Graph, ops=None, tensors=None) -> Graph:
    out = Graph(g.arch, g.lanes)
    out.tensors = dict(g.tensors if tensors is None else tensors)
    out.ops = list(g.ops if ops is None else ops)
    return out


def test_verify_accepts_every_pipeline_graph(folders):
    for arch in folders:
        assert verify(build_graph(_spec(folders, arch))) is not None


def test_verify_catches_use_before_definition(llama_graph):
    ops = list(llama_graph.ops)
    i = next(k for k, op in enumerate(ops) if op.kind == "Attention")
    ops[i - 1], ops[i] = ops[i], ops[i - 1]                       # Attention before its KVAppend is fine,
    verify(_rebuilt(llama_graph, ops))                            # (the cache is state, not a tensor)
    j = next(k for k, op in enumerate(ops) if op.kind == "SwiGLU")
    ops = list(llama_graph.ops)
    ops[j - 1], ops[j] = ops[j], ops[j - 1]                       # SwiGLU before the up projection is not
    with pytest.raises(KiecError) as info:
        verify(_rebuilt(llama_graph, ops))
    assert info.value.field == "ir" and "SwiGLU" in info.value.value


def test_verify_catches_a_missing_tensor(llama_graph):
    ops = list(llama_graph.ops)
    ops.insert(3, Op("Add", ("h.embed", "nowhere"), "x.bad", (), 0))
    with pytest.raises(KiecError) as info:
        verify(_rebuilt(llama_graph, ops))
    assert info.value.value == "Add(nowhere)"


def test_verify_catches_a_stale_shape(llama_graph):
    tensors = dict(llama_graph.tensors)
    tensors["layers.0.q"] = dataclasses.replace(tensors["layers.0.q"], shape=(2, 48))
    with pytest.raises(KiecError) as info:
        verify(_rebuilt(llama_graph, tensors=tensors))
    assert info.value.value == "layers.0.q" and "stale" in info.value.hint


def test_verify_catches_a_weight_that_does_not_fit(llama_graph):
    tensors = dict(llama_graph.tensors)
    tensors["layers.1.w_up"] = dataclasses.replace(tensors["layers.1.w_up"], shape=(2, 64, 32))
    with pytest.raises(KiecError) as info:
        verify(_rebuilt(llama_graph, tensors=tensors))
    assert info.value.field == "ir" and info.value.value == "Linear" and "does not fit" in info.value.hint


@pytest.mark.parametrize("attrs", [dict(mode="later", delay=0, sublayer="attn"),
                                   dict(mode="past", delay=0, sublayer="attn")])
def test_verify_catches_a_bad_reduce(llama_graph, attrs):
    ops = [dataclasses.replace(op, attrs=tuple(sorted(attrs.items()))) if op.kind == "LaneReduce" else op
           for op in llama_graph.ops]
    with pytest.raises(KiecError) as info:
        verify(_rebuilt(llama_graph, ops))
    assert info.value.value == "LaneReduce"


def test_verify_catches_wrong_lane_counts(llama_graph):
    tensors = dict(llama_graph.tensors)
    g = _rebuilt(llama_graph, tensors=tensors)
    g.lanes = 4
    with pytest.raises(KiecError) as info:
        verify(g)
    assert "4 lanes" in info.value.expected


def test_unknown_op_is_refused():
    g = Graph("llama", 1)
    g.add_tensor(Tensor("x", (1, 4), "input"))
    with pytest.raises(ValueError, match="unknown op"):
        g.op("Conv", ["x"], "y")
    g.ops.append(Op("Conv", ("x",), None))
    with pytest.raises(KiecError):
        verify(g)


def test_shapes_are_checked_when_building():
    g = Graph("llama", 2)
    g.add_tensor(Tensor("x", (2, 8), "input"))
    g.weight("w", (2, 4, 8), "wq")
    g.weight("bad", (2, 4, 6), "wq")
    assert g.op("Linear", ["x", "w"], "y") == "y" and g.tensors["y"].shape == (2, 4)
    with pytest.raises(ValueError, match="does not fit"):
        g.op("Linear", ["x", "bad"], "z")
    with pytest.raises(ValueError, match="defined twice"):
        g.op("Linear", ["x", "w"], "y")
    with pytest.raises(ValueError, match="undefined inputs"):
        g.op("Add", ["x", "q"], "s")
    with pytest.raises(ValueError, match="heads"):
        g.op("RoPE", ["y"], "r", heads=3, head_dim=2, pairs="half")
    assert set(OPS) >= {"Embed", "RMSNorm", "Linear", "RoPE", "KVAppend", "Attention", "SwiGLU", "LaneReduce",
                        "Add", "LaneSum", "LMHead", "Select"}


@pytest.mark.parametrize("arch, overrides", [("llama", dict(lanes=2, dtp_delay=1)), ("qwen2", dict(lanes=2)),
                                             ("mistral", {}), ("laneformer", {})])
def test_json_round_trip(folders, arch, overrides):
    spec = _spec(folders, arch, **overrides)
    g = build_graph(spec)
    back = Graph.from_json(g.to_json())
    assert (back.arch, back.lanes) == (g.arch, g.lanes)
    assert back.tensors == g.tensors and back.ops == g.ops
    assert back.dump() == g.dump() and back.to_json() == g.to_json()
    tokens = np.random.default_rng(0).integers(0, spec.config.vocab, 8)
    a = prompt_then_decode(reference(spec, graph=g), tokens, 4)
    b = prompt_then_decode(reference(spec, graph=back), tokens, 4)
    np.testing.assert_array_equal(a, b)


def test_from_json_verifies(llama_graph):
    import json
    raw = json.loads(llama_graph.to_json())
    raw["ops"][5]["inputs"] = ["nowhere"]
    with pytest.raises(KiecError):
        Graph.from_json(json.dumps(raw))


def test_pipeline_dumps_each_step(folders, tmp_path):
    g = build_graph(_spec(folders, "llama", lanes=2), dump=tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["00-lower.ir", "01-shard.ir", "02-dtp.ir", "03-verify.ir"]
    assert (tmp_path / "03-verify.ir").read_text() == g.dump()
    assert "lanes=1" in (tmp_path / "00-lower.ir").read_text().splitlines()[0]


# --- the reference interpreter's own checks ----------------------------------------------------

def test_reference_refuses_bad_tokens_and_overflow(folders):
    spec = _spec(folders, "llama")
    ref = reference(spec)
    for bad in ([spec.config.vocab], [-1]):
        with pytest.raises(KiecError) as info:
            ref.forward(bad)
        assert info.value.field == "tokens"
    with pytest.raises(KiecError):
        ref.forward([])
    ref.forward(np.zeros(spec.max_seq_len - 1, np.int64))
    with pytest.raises(KiecError) as info:
        ref.forward([1, 2])
    assert info.value.field == "context"


def test_reference_prefix_reuse(folders):
    """reset(n) keeps the KV cache below n: recomputing from there gives the same logits."""
    ref = reference(_spec(folders, "mistral"))
    tokens = np.random.default_rng(3).integers(0, 300, 20)
    full = ref.forward(tokens)
    ref.reset(12)
    np.testing.assert_allclose(ref.forward(tokens[12:]), full[12:], rtol=1e-12, atol=1e-12)
    ref.reset(0)
    np.testing.assert_allclose(prompt_then_decode(ref, tokens, 5), full, rtol=1e-12, atol=1e-12)
