"""`kiec inspect`: the graph, the parameter count, bytes per token and the per-lane split, checked
against counts made here from the checkpoint itself (transformers' `num_parameters()`, tensor sizes)."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from kiec.inspect import bytes_per_token
from kiec.model import load_spec
from refcheck import hf_random_model

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, vocab_size=160, max_position_embeddings=256)


def _hf_folder(tmp_path, family, **changes):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[family]
    model = hf_random_model(cls(**dict(SMALL, **changes)))
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model, tmp_path


def _inspect(*args) -> str:
    run = subprocess.run([sys.executable, "-m", "kiec.cli", "inspect", *args], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    return run.stdout


def _line(text: str, key: str) -> str:
    return next(l for l in text.splitlines() if l.startswith(key))


def _numel(model, *parts) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if not parts or any(s in n for s in parts))


@pytest.mark.parametrize("family, changes", [("llama", {}), ("llama", dict(tie_word_embeddings=True)),
                                             ("qwen2", dict(tie_word_embeddings=False)),
                                             ("qwen2", dict(tie_word_embeddings=True))])
def test_parameter_count_is_transformers(tmp_path, family, changes):
    model, folder = _hf_folder(tmp_path, family, **changes)
    out = _inspect(str(folder))
    count = int(re.search(r"\((\d+)\)", _line(out, "params")).group(1))
    assert count == model.num_parameters()
    assert _line(out, "params").startswith(f"params     {count / 1e6:.1f} M")


def _weight_bytes(model, tied: bool) -> int:
    """bf16 bytes one decode step reads: every weight, but one row of the embedding (the LM head
    reads the whole table when it is tied)."""
    cfg = model.config
    table = cfg.vocab_size * cfg.hidden_size
    read = model.num_parameters() - table + cfg.hidden_size + (table if tied else 0)
    return 2 * read


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("lanes", [1, 2])
def test_bytes_per_token_and_lane_split(tmp_path, tied, lanes):
    model, folder = _hf_folder(tmp_path, "qwen2", tie_word_embeddings=tied)
    cfg = model.config
    spec = load_spec(str(folder), {"lanes": lanes})
    context = 100
    b = bytes_per_token(spec, context)
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2
    assert b["weights"] == _weight_bytes(model, tied)
    assert b["kv_cache"] == kv * context
    assert b["total"] == b["weights"] + b["kv_cache"]
    # split over lanes: the projections (and QKV biases); norms, one embedding row and the head are replicated
    split = _numel(model, "_proj")
    shared = _numel(model, "norm") + cfg.hidden_size + cfg.vocab_size * cfg.hidden_size
    assert b["per_lane_weights"] == 2 * split // lanes
    assert b["shared"] == 2 * shared
    assert b["weights"] == b["per_lane_weights"] * lanes + b["shared"]
    out = _inspect(str(folder), "--lanes", str(lanes), "--context", str(context))
    assert _line(out, "bytes/token") == (
        f"bytes/token {b['total'] / 1e6:.2f} MB at context {context}: weights {b['weights'] / 1e6:.2f} MB "
        f"+ KV cache {b['kv_cache'] / 1e6:.2f} MB")
    assert _line(out, "per lane") == (
        f"per lane   {b['per_lane_weights'] / 1e6:.2f} MB of lane weights + {b['shared'] / 1e6:.2f} MB replicated")
    assert _line(out, "lanes").startswith(f"lanes      {lanes} on 1 GPU(s); lane reduce: present x4")


def test_kv_bytes_with_a_sliding_window(tmp_path):
    model, folder = _hf_folder(tmp_path, "mistral", sliding_window=16)
    cfg = model.config
    per_position = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2
    spec = load_spec(str(folder))
    assert bytes_per_token(spec, 10)["kv_cache"] == cfg.num_hidden_layers * per_position * 10
    assert bytes_per_token(spec, 100)["kv_cache"] == cfg.num_hidden_layers * per_position * 16


def test_graph_and_dtp_warning(tmp_path):
    model, folder = _hf_folder(tmp_path, "llama")
    out = _inspect(str(folder), "--lanes", "2", "--dtp-delay", "1")
    assert _line(out, "lanes") == "lanes      2 on 1 GPU(s); lane reduce: past(1) x2, present x2"
    assert _line(out, "WARNING").startswith("WARNING    past(1) on a llama model")
    graph = out[out.index("graph llama lanes=2"):]
    assert "layers.0.wq [2, 32, 64] role=wq layout=colwise" in graph
    assert "layers.0.wo [2, 64, 32] role=wo layout=rowwise" in graph
    assert "Attention(layers.0.q) head_dim=16 heads=2 kv_heads=1 window=0" in graph
    assert "layers.1." not in graph.replace("RMSNorm(layers.1.h.mlp", "")   # layer 0 only (and the output)
    assert "logits[160] = LMHead(final.x, lm_head) head=replicate vocab=160" in graph
    ops = _line(out, "ops")
    assert "Linear x14" in ops and "Attention x2" in ops and "LaneReduce x4" in ops


def test_laneformer_parameter_count(tmp_path):
    """Against the tensors a checkpoint written from LANEFORMER.md's names and shapes holds."""
    from laneformer_doc import random_laneformer, save_checkpoint
    for i, changes in enumerate([{}, dict(replicated_rmsn_scale=False), dict(lm_head_type="lane"),
                                 dict(lm_head_type="vocab_parallel"), dict(pre_norm_lane_agg=True),
                                 dict(tie_word_embeddings=True)]):
        config = dict(model_type="laneformer_tp", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, vocab_size=96, max_position_embeddings=64,
                      num_lanes=2, **changes)
        tensors = random_laneformer(config, seed=i)
        folder = save_checkpoint(tmp_path / str(i), config, tensors)
        stored = sum(a.size for a in tensors.values())
        assert load_spec(str(folder)).config.parameter_count() == stored, changes
        assert f"({stored})" in _line(_inspect(str(folder)), "params")
