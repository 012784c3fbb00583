"""Laneformer (../shared/LANEFORMER.md) and lanes on standard models.

kiec runs each checkpoint through load_spec -> lower -> shard -> dtp -> its Reference, a prompt and
then one decode step per token, and is compared with `laneformer_forward` (tests/laneformer_doc.py,
the document transcribed into numpy, independent of kiec). Both in float64.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from kiec.ir.graph import Graph, verify
from kiec.model import load_spec
from laneformer_doc import laneformer_forward, random_laneformer, save_checkpoint
from refcheck import hf_logits, hf_random_model, prompt_then_decode, reference, relative_errors

PROMPT, TOTAL = 6, 14
EXACT = 1e-10          # float64 against float64, the same arithmetic up to rounding
BASE = dict(model_type="laneformer_tp", hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, vocab_size=96, max_position_embeddings=64,
            rope_theta=10000.0, norm_eps=1e-5, num_lanes=2, broadcast_delay=1)


def _load(folder) -> dict:
    from safetensors.numpy import load_file
    return {k: v.astype(np.float64) for k, v in load_file(str(folder / "model.safetensors")).items()}


def with_modes(graph: Graph, mode_of) -> Graph:
    """A copy of the graph with every LaneReduce's (mode, delay) set to mode_of(layer)."""
    def changed(op):
        mode, delay = mode_of(op.layer)
        return dataclasses.replace(op, attrs=tuple(sorted(dict(op.attrs, mode=mode, delay=delay).items())))
    out = Graph.from_json(graph.to_json())
    out.ops = [changed(op) if op.kind == "LaneReduce" else op for op in out.ops]
    return verify(out)


def _tokens(vocab: int, seed: int = 0):
    return np.random.default_rng(seed).integers(0, vocab, TOTAL)


# --- laneformer checkpoints against the document ---------------------------------------------

CASES = {
    "L2-delay1": dict(),
    "L4-delay2-gqa-window-last": dict(num_lanes=4, num_attention_heads=8, num_key_value_heads=4, broadcast_delay=2,
                                      sliding_window=4, sliding_window_n_layers=-2),
    "L2-delay2-no-early-comm": dict(broadcast_delay=2, use_early_comm=False),
    "L4-no-comm": dict(num_lanes=4, num_key_value_heads=4, use_comm=False, broadcast_delay=2),
    "L2-lane-head-per-lane-scales": dict(lm_head_type="lane", replicated_rmsn_scale=False),
    "L4-vocab-parallel-window-first-unclamped": dict(num_lanes=4, num_key_value_heads=4, lm_head_type="vocab_parallel",
                                                     sliding_window=3, sliding_window_n_layers=3,
                                                     unclamped_layers=[1]),
    "L2-pre-norm-lane-agg-per-lane-scales": dict(pre_norm_lane_agg=True, replicated_rmsn_scale=False, broadcast_delay=3),
    "L2-tied-delay3": dict(tie_word_embeddings=True, broadcast_delay=3, num_hidden_layers=5),
    "L1": dict(num_lanes=1, broadcast_delay=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kiec_computes_the_documented_forward(case, tmp_path):
    cfg = dict(BASE, **CASES[case])
    folder = save_checkpoint(tmp_path / case, cfg, random_laneformer(cfg, seed=len(case)))
    spec = load_spec(str(folder), {"max_seq_len": 32})
    assert spec.config.arch == "laneformer" and spec.lanes == cfg["num_lanes"]
    tokens = _tokens(cfg["vocab_size"])
    want = laneformer_forward(cfg, _load(folder), tokens)
    got = prompt_then_decode(reference(spec, np.float64), tokens, PROMPT)
    err = relative_errors(got, want)
    assert (err <= EXACT).all(), f"{case}: worst position {err.argmax()}: {err.max():.3g}"


@pytest.mark.parametrize("case, plain", [
    ("L2-delay1", dict(use_comm=False)),                                    # past vs none
    ("L2-delay2-no-early-comm", dict(use_early_comm=True)),                 # none vs present
    ("L4-delay2-gqa-window-last", dict(sliding_window=None)),
    ("L4-vocab-parallel-window-first-unclamped", dict(unclamped_layers=[])),
    ("L2-lane-head-per-lane-scales", dict(lm_head_type="replicate")),
])
def test_each_setting_changes_the_documented_forward(case, plain):
    """So that the comparisons above are not blind to the setting they are about."""
    cfg = dict(BASE, **CASES[case])
    w = random_laneformer(cfg, seed=len(case))
    if "lm_head_type" in plain:
        w["lm_head.weight"] = w["lm_head.linear.weight"][:, :cfg["hidden_size"]]
    tokens = _tokens(cfg["vocab_size"])
    err = relative_errors(laneformer_forward(dict(cfg, **plain), w, tokens), laneformer_forward(cfg, w, tokens))
    assert err[PROMPT:].max() > 1e-3


def test_reduce_modes_kiec_gives_each_layer(tmp_path):
    from kiec.pipeline import build_graph
    cfg = dict(BASE, **CASES["L2-delay2-no-early-comm"], num_hidden_layers=5)
    spec = load_spec(str(save_checkpoint(tmp_path, cfg, random_laneformer(cfg, 0))))
    modes = [(op.layer, op.attr("sublayer"), op.attr("mode"), op.attr("delay"))
             for op in build_graph(spec).ops if op.kind == "LaneReduce"]
    want = [(i, s, "none" if i < 2 else "past", 0 if i < 2 else 2) for i in range(5) for s in ("attn", "mlp")]
    assert modes == want


# --- a standard llama over lanes ---------------------------------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A random llama written by transformers: 8 query heads, 4 KV heads (divides 2 and 4 lanes)."""
    from transformers import LlamaConfig
    config = LlamaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4,
                         intermediate_size=128, vocab_size=96, max_position_embeddings=64, rms_norm_eps=1e-5,
                         rope_theta=10000.0, tie_word_embeddings=False)
    model = hf_random_model(config, seed=7)
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


@pytest.fixture(scope="module")
def llama_lanes1(llama):
    _, folder = llama
    tokens = _tokens(96, seed=1)
    spec = load_spec(str(folder), {"max_seq_len": 32})
    return tokens, prompt_then_decode(reference(spec, np.float64), tokens, PROMPT)


@pytest.mark.parametrize("lanes", [2, 4])
def test_shard_pass_is_exact_with_present(llama, llama_lanes1, lanes):
    _, folder = llama
    tokens, want = llama_lanes1
    spec = load_spec(str(folder), {"max_seq_len": 32, "lanes": lanes})
    ref = reference(spec, np.float64)
    assert ref.graph.lanes == lanes
    assert {op.attr("mode") for op in ref.graph.ops if op.kind == "LaneReduce"} == {"present"}
    err = relative_errors(prompt_then_decode(ref, tokens, PROMPT), want)
    assert (err <= EXACT).all(), err.max()


@pytest.mark.parametrize("family, changes", [
    ("qwen2", dict(tie_word_embeddings=False)),                                  # QKV biases are cut too
    ("mistral", dict(sliding_window=4)),
])
def test_shard_pass_is_exact_for_other_families(tmp_path, family, changes):
    from transformers import MistralConfig, Qwen2Config
    cls = {"qwen2": Qwen2Config, "mistral": MistralConfig}[family]
    model = hf_random_model(cls(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=96, vocab_size=96, max_position_embeddings=64, **changes), seed=2)
    model.save_pretrained(tmp_path, safe_serialization=True)
    tokens = _tokens(96, seed=2)
    one = prompt_then_decode(reference(load_spec(str(tmp_path), {"max_seq_len": 32})), tokens, PROMPT)
    two = prompt_then_decode(reference(load_spec(str(tmp_path), {"max_seq_len": 32, "lanes": 2})), tokens, PROMPT)
    assert (relative_errors(two, one) <= EXACT).all()
    assert (relative_errors(one, hf_logits(model.double(), tokens)) <= 1e-4).all()


def half_to_adjacent(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a Q/K projection from Hugging Face's rotate-half order (pair j = rows j, j+hd/2)
    to the adjacent-pair order (pair j = rows 2j, 2j+1), per head."""
    hd = w.shape[0] // heads
    order = np.stack([np.arange(hd // 2), np.arange(hd // 2) + hd // 2], axis=1).reshape(-1)
    return w.reshape(heads, hd, -1)[:, order].reshape(w.shape)


def laneformer_from_llama(hf_folder, out, lanes: int, **changes) -> dict:
    """A laneformer_tp checkpoint holding the llama's weights, lane l owning heads l*H/L ... and
    FFN columns l*F/L ..."""
    hf_cfg = json.loads((hf_folder / "config.json").read_text())
    t = _load(hf_folder)
    H, KV, L = hf_cfg["num_attention_heads"], hf_cfg["num_key_value_heads"], lanes
    cfg = dict(dict(model_type="laneformer_tp", hidden_size=hf_cfg["hidden_size"],
                    num_hidden_layers=hf_cfg["num_hidden_layers"], num_attention_heads=H, num_key_value_heads=KV,
                    intermediate_size=hf_cfg["intermediate_size"], vocab_size=hf_cfg["vocab_size"],
                    max_position_embeddings=hf_cfg["max_position_embeddings"],
                    rope_theta=hf_cfg["rope_parameters"]["rope_theta"], norm_eps=hf_cfg["rms_norm_eps"],
                    num_lanes=L, broadcast_delay=1, lm_head_type="replicate"), **changes)

    def rows(x):                        # [n, D] -> [L, n/L, D]: output rows split over lanes
        return x.reshape(L, x.shape[0] // L, x.shape[1])

    def cols(x):                        # [D, n] -> [L, D, n/L]: input columns split over lanes
        return x.reshape(x.shape[0], L, x.shape[1] // L).transpose(1, 0, 2)
    w = {"model.tok_embeddings.weight": t["model.embed_tokens.weight"], "model.norm.weight": t["model.norm.weight"],
         "lm_head.weight": t["lm_head.weight"]}
    for i in range(cfg["num_hidden_layers"]):
        s, p = f"model.layers.{i}.", f"model.layers.{i}."
        w[p + "attention_norm.weight"] = t[s + "input_layernorm.weight"]
        w[p + "ffn_norm.weight"] = t[s + "post_attention_layernorm.weight"]
        w[p + "attention.wq.weight"] = rows(half_to_adjacent(t[s + "self_attn.q_proj.weight"], H))
        w[p + "attention.wk.weight"] = rows(half_to_adjacent(t[s + "self_attn.k_proj.weight"], KV))
        w[p + "attention.wv.weight"] = rows(t[s + "self_attn.v_proj.weight"])
        w[p + "attention.wo.weight"] = cols(t[s + "self_attn.o_proj.weight"])
        w[p + "feed_forward.w1.weight"] = rows(t[s + "mlp.gate_proj.weight"])
        w[p + "feed_forward.w3.weight"] = rows(t[s + "mlp.up_proj.weight"])
        w[p + "feed_forward.w2.weight"] = cols(t[s + "mlp.down_proj.weight"])
    save_checkpoint(out, cfg, w)
    return cfg


@pytest.mark.parametrize("lanes", [2, 4])
def test_laneformer_with_every_reduce_present_is_the_llama(llama, llama_lanes1, tmp_path, lanes):
    from kiec.passes.dtp import dtp
    from kiec.passes.lower import lower
    model, hf_folder = llama
    tokens, want = llama_lanes1
    cfg = laneformer_from_llama(hf_folder, tmp_path, lanes)
    spec = load_spec(str(tmp_path), {"max_seq_len": 32})
    graph = with_modes(dtp(lower(spec), spec.config), lambda layer: ("present", 0))
    assert {op.attr("mode") for op in graph.ops if op.kind == "LaneReduce"} == {"present"}
    got = prompt_then_decode(reference(spec, np.float64, graph=graph), tokens, PROMPT)
    assert (relative_errors(got, want) <= EXACT).all()
    assert (relative_errors(got, hf_logits(model.double(), tokens)) <= 1e-4).all()
    # the document's forward, on the same converted checkpoint, agrees
    doc = laneformer_forward(cfg, _load(tmp_path), tokens, modes=["present"] * cfg["num_hidden_layers"])
    assert (relative_errors(doc, want) <= EXACT).all()
    # and the checkpoint as configured (past(1) from layer 1) is a different model
    trained = prompt_then_decode(reference(spec, np.float64), tokens, PROMPT)
    assert relative_errors(trained, want)[PROMPT:].max() > 1e-3


@pytest.mark.parametrize("lanes, delay", [(2, 1), (4, 2)])
def test_requested_delay_on_llama_is_laneformer_past(llama, llama_lanes1, tmp_path, lanes, delay):
    """`dtp_delay` on a standard llama (an approximation) computes exactly what the same weights
    in laneformer form compute with broadcast_delay = dtp_delay."""
    _, hf_folder = llama
    tokens, exact = llama_lanes1
    spec = load_spec(str(hf_folder), {"max_seq_len": 32, "lanes": lanes, "dtp_delay": delay})
    assert spec.approximate
    got = prompt_then_decode(reference(spec, np.float64), tokens, PROMPT)
    cfg = laneformer_from_llama(hf_folder, tmp_path, lanes, broadcast_delay=delay)
    doc = laneformer_forward(cfg, _load(tmp_path), tokens)
    assert (relative_errors(got, doc) <= EXACT).all()
    lf = prompt_then_decode(reference(load_spec(str(tmp_path), {"max_seq_len": 32}), np.float64), tokens, PROMPT)
    assert (relative_errors(lf, doc) <= EXACT).all()
    assert relative_errors(got, exact)[PROMPT:].max() > 1e-3


def test_laneformer_fp16_and_bf16_checkpoints_load(tmp_path):
    import ml_dtypes
    cfg = dict(BASE)
    w = random_laneformer(cfg, seed=3)
    tokens = _tokens(cfg["vocab_size"])
    for dtype in (np.float16, ml_dtypes.bfloat16):
        folder = save_checkpoint(tmp_path / np.dtype(dtype).name, cfg, w, dtype)
        want = laneformer_forward(cfg, _load(folder), tokens)
        got = prompt_then_decode(reference(load_spec(str(folder), {"max_seq_len": 32})), tokens, PROMPT)
        assert (relative_errors(got, want) <= EXACT).all()


def test_laneformer_checkpoint_errors(tmp_path):
    from kiec.errors import KiecError
    from kiec.weights import load_checkpoint
    cfg = dict(BASE, replicated_rmsn_scale=False)
    w = random_laneformer(cfg, seed=0)
    w["model.layers.1.ffn_norm.weight"] = w.pop("model.layers.1.ffn_norm.scale")[0]
    spec = load_spec(str(save_checkpoint(tmp_path / "a", cfg, w)))
    with pytest.raises(KiecError) as info:
        load_checkpoint(spec)
    assert info.value.field == "weights[model.layers.1.ffn_norm.scale]" and info.value.value == "missing"
    w = random_laneformer(BASE, seed=0)
    w["model.layers.0.attention.wq.weight"] = w["model.layers.0.attention.wq.weight"].reshape(1, 32, 32)
    spec = load_spec(str(save_checkpoint(tmp_path / "b", BASE, w)))
    with pytest.raises(KiecError) as info:
        load_checkpoint(spec)
    assert info.value.field == "weights[model.layers.0.attention.wq.weight].shape" and info.value.value == [1, 32, 32]


def test_laneformer_settings_the_spec_does_not_allow_are_refused(tmp_path):
    """A delay other than the checkpoint's, and a tied head that is not read whole, have no meaning for a
    laneformer: each is one error naming the field, not another model run or a crash at load time."""
    from kiec.errors import KiecError
    folder = save_checkpoint(tmp_path / "a", BASE, random_laneformer(BASE, seed=0))
    delay = BASE.get("broadcast_delay", 1)
    assert load_spec(str(folder), {"dtp_delay": delay}).dtp_delay == delay       # its own: allowed
    with pytest.raises(KiecError, match=f"dtp_delay: got {delay + 1}; expected unset for a laneformer"):
        load_spec(str(folder), {"dtp_delay": delay + 1})
    for head in ("lane", "vocab_parallel"):
        cfg = dict(BASE, lm_head_type=head, tie_word_embeddings=True)
        (tmp_path / head).mkdir()
        (tmp_path / head / "config.json").write_text(json.dumps(cfg))
        want = f"config.tie_word_embeddings: got True; expected false with lm_head_type '{head}'"
        with pytest.raises(KiecError, match=want):
            load_spec(str(tmp_path / head))


def test_laneformer_null_flags_take_the_spec_defaults(tmp_path):
    from kiec.errors import KiecError
    for key in ("use_comm", "use_early_comm", "replicated_rmsn_scale"):
        (tmp_path / key).mkdir()
        (tmp_path / key / "config.json").write_text(json.dumps(dict(BASE, **{key: None})))
        cfg = load_spec(str(tmp_path / key)).config
        assert {"use_comm": cfg.use_comm, "use_early_comm": cfg.use_early_comm,
                "replicated_rmsn_scale": cfg.replicated_norm}[key] is True
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps(dict(BASE, use_comm="yes")))
    with pytest.raises(KiecError, match="config.use_comm: got 'yes'; expected true, false or null"):
        load_spec(str(tmp_path / "bad"))
