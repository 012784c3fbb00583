"""Weight readers: safetensors (bf16/fp16/fp32, no torch), sharded Hugging Face folders, GGUF
(dequantized, llama.cpp's Q/K row permutation undone) and the checks of a checkpoint against its
config. Files are written by independent writers (safetensors' own, transformers, gguf's
GGUFWriter); a bad file is one KiecError when the checkpoint is opened."""
from __future__ import annotations

import copy
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kiec.errors import KiecError
from kiec.model import load_spec, rope_inv_freq
from kiec.weights import load_checkpoint, read_folder, read_safetensors
from refcheck import hf_logits, hf_random_model, prompt_then_decode, reference, relative_errors

HF_NAMES = {  # canonical -> Hugging Face name, for layer 0 and the rest
    "embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight",
    "layers.{i}.attn_norm": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.wq": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.wk": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.wv": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.wo": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.w_gate": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.w_up": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.w_down": "model.layers.{i}.mlp.down_proj.weight",
}
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
}


def _hf_names(layers: int) -> dict:
    out = {}
    for canon, name in HF_NAMES.items():
        for i in (range(layers) if "{i}" in canon else [None]):
            out[canon.format(i=i)] = name.format(i=i)
    return out


SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, vocab_size=128, max_position_embeddings=128, tie_word_embeddings=False)


def _small_model(family: str, seed: int, **changes):
    from transformers import LlamaConfig, Qwen2Config
    return hf_random_model({"llama": LlamaConfig, "qwen2": Qwen2Config}[family](**dict(SMALL, **changes)), seed=seed)


@pytest.fixture(scope="module")
def hf_llama():
    return _small_model("llama", 5, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def hf_llama_folder(hf_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf-llama")
    hf_llama.save_pretrained(folder, safe_serialization=True)
    return folder


def _state(model) -> dict:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


# --- safetensors --------------------------------------------------------------------------------

def test_safetensors_dtypes_read_without_torch(tmp_path):
    """fp32/fp16 written by safetensors.numpy, bf16 by safetensors.torch; read in a process where
    importing torch fails, and every value comes back exactly."""
    import torch
    from safetensors.numpy import save_file
    from safetensors.torch import save_file as save_torch
    rng = np.random.default_rng(0)
    want = {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float16),
            "c": rng.standard_normal((2, 2, 3)).astype(np.float32)}
    save_file({"a": want["a"], "b": want["b"]}, tmp_path / "np.safetensors")
    bf = torch.from_numpy(want["c"]).to(torch.bfloat16)
    want["c"] = bf.float().numpy()
    save_torch({"c": bf}, tmp_path / "bf.safetensors")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None              # any `import torch` now raises ImportError
        import numpy as np
        from kiec.weights import read_safetensors
        out = {{}}
        for f in ("np", "bf"):
            store = read_safetensors(r"{tmp_path}/" + f + ".safetensors")
            for n in store.names():
                out[n] = store.get(n)
                out[n + ".dtype"] = np.array(store.entries[n][1])
        np.savez(r"{tmp_path}/out.npz", **out)
        assert "torch" not in [m for m, v in sys.modules.items() if v is not None]
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    got = np.load(tmp_path / "out.npz")
    for name, array in want.items():
        assert got[name].dtype == np.float32 and got[name].shape == array.shape
        np.testing.assert_array_equal(got[name], array.astype(np.float32))
    assert [str(got[n + ".dtype"]) for n in "abc"] == ["float32", "float16", "bfloat16"]


def test_safetensors_native_dtype_and_metadata(tmp_path):
    """`get(name, None)` keeps the stored dtype; a __metadata__ entry is not a tensor."""
    from safetensors.numpy import save_file
    x = np.arange(12, dtype=np.float16).reshape(3, 4)
    save_file({"x": x}, tmp_path / "m.safetensors", metadata={"format": "np"})
    store = read_safetensors(str(tmp_path / "m.safetensors"))
    assert list(store.names()) == ["x"] and store.shape("x") == (3, 4)
    assert store.get("x", None).dtype == np.float16
    np.testing.assert_array_equal(store.get("x", None), x)


def test_folder_checkpoint_equals_transformers_state(hf_llama, hf_llama_folder):
    spec = load_spec(str(hf_llama_folder))
    ckpt = load_checkpoint(spec)
    state = _state(hf_llama)
    names = _hf_names(spec.config.layers)
    assert set(ckpt.expected) == set(names)
    for canon, hf_name in names.items():
        np.testing.assert_array_equal(ckpt.get(canon), state[hf_name], err_msg=canon)


def test_sharded_folder_with_index(hf_llama, hf_llama_folder, tmp_path):
    """transformers writes the shards and the index; kiec reads the same tensors and logits."""
    hf_llama.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) >= 3 and (tmp_path / "model.safetensors.index.json").exists()
    store = read_folder(str(tmp_path))
    whole = read_safetensors(str(hf_llama_folder / "model.safetensors"))
    assert set(store.names()) == set(whole.names())
    for name in whole.names():
        np.testing.assert_array_equal(store.get(name), whole.get(name), err_msg=name)
    tokens = np.random.default_rng(1).integers(0, 128, 12)
    a = prompt_then_decode(reference(load_spec(str(tmp_path), {"max_seq_len": 32})), tokens, 4)
    b = prompt_then_decode(reference(load_spec(str(hf_llama_folder), {"max_seq_len": 32})), tokens, 4)
    np.testing.assert_array_equal(a, b)
    assert (relative_errors(a, hf_logits(copy.deepcopy(hf_llama).double(), tokens)) < 1e-4).all()


def test_sharded_folder_errors(hf_llama, tmp_path):
    hf_llama.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    index = tmp_path / "model.safetensors.index.json"
    shard = sorted(tmp_path.glob("*-of-*.safetensors"))[1]
    spec = load_spec(str(tmp_path))
    shard.rename(tmp_path / "elsewhere.bin")
    with pytest.raises(KiecError) as info:
        load_checkpoint(spec)
    assert info.value.field == "weights" and info.value.value == str(shard) and "index" in info.value.expected
    text = index.read_text()
    index.write_text(text[: len(text) // 2])
    with pytest.raises(KiecError) as info:
        load_checkpoint(spec)
    assert info.value.field == "weights" and info.value.value == str(index)


def test_folder_without_safetensors(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(KiecError) as info:
        read_folder(str(tmp_path))
    assert "pytorch_model.bin" in info.value.hint


def _copy_model(src, dst):
    dst.mkdir(exist_ok=True)
    shutil.copy(src / "config.json", dst)
    return dst


@pytest.mark.parametrize("keep", [0, 5, 8, 60, 0.5, -1])
def test_truncated_safetensors(tiny_llama, tmp_path, keep):
    data = (tiny_llama / "model.safetensors").read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else (len(data) + keep if keep < 0 else keep)
    folder = _copy_model(tiny_llama, tmp_path / "m")
    (folder / "model.safetensors").write_bytes(data[:cut])
    spec = load_spec(str(folder))
    with pytest.raises(KiecError) as info:
        load_checkpoint(spec)
    assert info.value.field == "weights" and info.value.value == str(folder / "model.safetensors")


@pytest.mark.parametrize("header", [b"{not json", b"[1, 2]", b'{"w": {"dtype": "F32"}}',
                                    b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}}',
                                    b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}',
                                    b"\xff\xfe\xfd"])
def test_corrupt_safetensors_header(tmp_path, header):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(KiecError) as info:
        read_safetensors(str(path))
    assert info.value.field.startswith("weights")


@pytest.mark.parametrize("entry, field", [
    ('{"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}', "weights[w].dtype"),
    ('{"dtype": "F32", "shape": ["x"], "data_offsets": [0, 8]}', "weights[w].shape"),
    ('{"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}', "weights[w].shape"),
    ('{"dtype": "F32", "shape": [true, 2], "data_offsets": [0, 8]}', "weights[w].shape"),
    ('{"dtype": "F32", "shape": [-2], "data_offsets": [8, 0]}', "weights[w].shape"),
    ('{"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}', "weights[w].data_offsets"),
    ('{"dtype": "F32", "shape": [2], "data_offsets": [0]}', "weights[w].data_offsets"),
    ('{"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 16]}', "weights[w].data_offsets"),
    ('{"dtype": "F32", "shape": [2], "data_offsets": {"begin": 0, "end": 8}}', "weights[w].data_offsets"),
    ('{"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}', "weights[w].data_offsets"),
])
def test_mistyped_safetensors_header_entry(tmp_path, entry, field):
    """Well-formed JSON with a field of the wrong type or range: one KiecError naming the tensor's
    field, its value and the file, not a TypeError/ValueError from numpy."""
    import json
    path = tmp_path / "bad.safetensors"
    header = ('{"w": ' + entry + "}").encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(KiecError) as info:
        read_safetensors(str(path))
    assert info.value.field == field and str(path) in info.value.hint
    assert info.value.value == json.loads(entry)[field.split(".")[-1]]


@pytest.mark.parametrize("index, field, value", [
    ("[1, 2]", "weights", None),
    ('"model.safetensors"', "weights", None),
    ('{"weight_map": ["model.safetensors"]}', "weight_map", ["model.safetensors"]),
    ('{"weight_map": 5}', "weight_map", 5),
    ('{"weight_map": {"w": 3}}', "weight_map[w]", 3),
    ('{"weight_map": {"w": null}}', "weight_map[w]", None),
])
def test_mistyped_safetensors_index(tmp_path, index, field, value):
    """An index of the wrong shape: one KiecError naming the index file (as the value, or in the
    hint beside the weight_map entry that is wrong)."""
    path = tmp_path / "model.safetensors.index.json"
    path.write_text(index)
    with pytest.raises(KiecError) as info:
        read_folder(str(tmp_path))
    assert info.value.field == field and str(path) in str(info.value)
    assert info.value.value == (str(path) if field == "weights" else value)


def test_garbage_safetensors(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(KiecError):
        read_safetensors(str(path))


def _tensors(folder) -> dict:
    from safetensors.numpy import load_file
    return load_file(str(folder / "model.safetensors"))


def _write_variant(tiny_llama, tmp_path, change):
    from safetensors.numpy import save_file
    folder = _copy_model(tiny_llama, tmp_path / "variant")
    tensors = _tensors(tiny_llama)
    change(tensors)
    save_file(tensors, folder / "model.safetensors")
    return load_spec(str(folder))


WQ0 = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("dtype, code", [(np.int32, "I32"), (np.float64, "F64"), (np.int64, "I64"),
                                         (np.uint8, "U8"), (np.bool_, "BOOL")])
def test_wrong_dtype_in_safetensors(tiny_llama, tmp_path, dtype, code):
    spec = _write_variant(tiny_llama, tmp_path, lambda t: t.update({WQ0: t[WQ0].astype(dtype)}))
    with pytest.raises(KiecError) as info:
        load_checkpoint(spec)
    assert info.value.field == f"weights[{WQ0}].dtype" and info.value.value == code
    assert "BF16" in info.value.expected and "F32" in info.value.expected


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_weight_that_is_not_finite_is_refused_by_name(tiny_llama, tmp_path, bad):
    def spoil(tensors):
        tensors[WQ0] = tensors[WQ0].copy()
        tensors[WQ0][3, :2] = bad
    ckpt = load_checkpoint(_write_variant(tiny_llama, tmp_path, spoil))
    with pytest.raises(KiecError) as info:
        ckpt.get("layers.0.wq")
    assert info.value.field == f"weights[{WQ0}]" and info.value.value == "2 NaN or infinite values"


def test_missing_tensor(tiny_llama, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    spec = _write_variant(tiny_llama, tmp_path, lambda t: t.pop(name))
    with pytest.raises(KiecError) as info:
        load_checkpoint(spec)
    err = info.value
    assert err.field == f"weights[{name}]" and err.value == "missing"
    assert "[128, 64]" in err.expected and "layers.1.w_up" in err.expected


def test_extra_tensor(tiny_llama, tmp_path):
    spec = _write_variant(tiny_llama, tmp_path, lambda t: t.update({"model.layers.2.mlp.up_proj.weight":
                                                                    t["model.layers.1.mlp.up_proj.weight"]}))
    with pytest.raises(KiecError) as info:
        load_checkpoint(spec)
    assert info.value.field == "weights[model.layers.2.mlp.up_proj.weight]" and info.value.value == "an extra tensor"


def test_wrong_shape(tiny_llama, tmp_path):
    spec = _write_variant(tiny_llama, tmp_path, lambda t: t.update({WQ0: t[WQ0][:32]}))
    with pytest.raises(KiecError) as info:
        load_checkpoint(spec)
    assert info.value.field == f"weights[{WQ0}].shape" and info.value.value == [32, 64]
    assert info.value.expected.startswith("[64, 64]")


def test_config_and_checkpoint_disagree(tiny_llama, tmp_path):
    """A config with 3 layers over a 2-layer checkpoint: the first layer-2 tensor is missing."""
    from kiec.synthetic import preset
    spec = load_spec({"weights": str(tiny_llama), "config": preset("tiny-llama", num_hidden_layers=3)})
    with pytest.raises(KiecError) as info:
        load_checkpoint(spec)
    assert info.value.field == "weights[model.layers.2.input_layernorm.weight]"


def test_tied_checkpoint_may_carry_its_lm_head(tiny_llama, tmp_path):
    from kiec.synthetic import preset
    spec = load_spec({"weights": str(tiny_llama), "config": preset("tiny-llama", tie_word_embeddings=True)})
    ckpt = load_checkpoint(spec)
    assert "lm_head" not in ckpt.expected
    np.testing.assert_array_equal(ckpt.get("embed"), _tensors(tiny_llama)["model.embed_tokens.weight"])


# --- GGUF ---------------------------------------------------------------------------------------

def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj/k_proj (rotate-half -> interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama_cpp_rope_freqs(cfg) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for llama3 RoPE scaling: per pair, the
    factor its inverse frequency is divided by (1, smoothed, or `factor`), in float32 as there."""
    rope = cfg.rope_parameters
    dim = cfg.hidden_size // cfg.num_attention_heads
    freqs = 1 / (np.float32(rope["rope_theta"]) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    wavelen = np.float32(2 * np.pi) / freqs
    smooth = (old / wavelen - low) / (high - low)
    return np.where(wavelen < old / high, 1, np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth))
                    ).astype(np.float32)


def write_gguf(path, model, quantize=(), change=None, meta=None, arch=None) -> None:
    """A GGUF of architecture `arch` (the model's own by default) from a transformers model, as
    llama.cpp's converter lays it out: Q/K rows (weights and biases) reordered for "llama" only,
    linear RoPE scaling as metadata keys, llama3's as a rope_freqs tensor.
    `quantize`: GGUF names stored as Q8_0; `change(name, array) -> array | None` edits (None
    drops); `meta`: metadata keys to overwrite, with a value of another type, or to drop (None)."""
    import gguf
    cfg = model.config
    arch = arch or cfg.model_type
    w = gguf.GGUFWriter(str(path), arch)
    keys = {f"{arch}.{key}": value for key, value in {  # what GGUFWriter's add_block_count() etc. write
        "block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "rope.freq_base": float(cfg.rope_parameters["rope_theta"]), "vocab_size": cfg.vocab_size,
    }.items()}
    if cfg.rope_parameters.get("rope_type") == "linear":       # as LlamaModel.set_gguf_parameters
        keys[f"{arch}.rope.scaling.type"] = "linear"
        keys[f"{arch}.rope.scaling.factor"] = float(cfg.rope_parameters["factor"])
    adders = {int: w.add_uint32, float: w.add_float32, str: w.add_string, list: w.add_array, bool: w.add_bool}
    for key, value in {**keys, **(meta or {})}.items():
        if value is not None:
            adders[type(value)](key, value)
    tensors = {}
    for hf_name, array in _state(model).items():
        layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
        short = hf_name.split(f"layers.{layer}.", 1)[1] if layer else hf_name
        name = f"blk.{layer}.{GGUF_NAMES[short]}" if layer else GGUF_NAMES[short]
        if arch == "llama" and short.startswith("self_attn.q_proj."):
            array = _llama_cpp_permute(array, cfg.num_attention_heads)
        elif arch == "llama" and short.startswith("self_attn.k_proj."):
            array = _llama_cpp_permute(array, cfg.num_key_value_heads)
        tensors[name] = array
    if cfg.rope_parameters.get("rope_type") == "llama3":       # as LlamaModel.generate_extra_tensors
        tensors["rope_freqs.weight"] = _llama_cpp_rope_freqs(cfg)
    for name, array in tensors.items():
        if change is not None:
            array = change(name, array)
            if array is None:
                continue
        if name in quantize:
            w.add_tensor(name, gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(hf_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, hf_llama, quantize={"blk.1.ffn_up.weight", "blk.0.attn_k.weight"})
    return path


def test_gguf_config(tiny_gguf, hf_llama):
    cfg = load_spec(str(tiny_gguf)).config
    hf = hf_llama.config
    assert (cfg.arch, cfg.hidden, cfg.layers, cfg.heads, cfg.kv_heads, cfg.ffn, cfg.vocab, cfg.max_positions) == (
        "llama", hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads,
        hf.intermediate_size, hf.vocab_size, hf.max_position_embeddings)
    assert not cfg.tie_embeddings and cfg.norm_eps == pytest.approx(hf.rms_norm_eps)


def test_gguf_weights_equal_transformers_gguf_load(tiny_gguf):
    """Dequantized (F32 and Q8_0 tensors) and un-permuted exactly as transformers does it."""
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    state = _state(hf)
    spec = load_spec(str(tiny_gguf))
    ckpt = load_checkpoint(spec)
    for canon, hf_name in _hf_names(spec.config.layers).items():
        np.testing.assert_array_equal(ckpt.get(canon), state[hf_name], err_msg=canon)


def test_gguf_unpermutes_to_the_original_rows(tiny_gguf, hf_llama):
    ckpt = load_checkpoint(load_spec(str(tiny_gguf)))
    state = _state(hf_llama)
    np.testing.assert_array_equal(ckpt.get("layers.1.wq"), state["model.layers.1.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(ckpt.get("layers.1.wk"), state["model.layers.1.self_attn.k_proj.weight"])
    q8 = ckpt.get("layers.0.wk")                # Q8_0: close, not equal
    want = state["model.layers.0.self_attn.k_proj.weight"]
    assert 0 < np.abs(q8 - want).max() < 0.01 * np.abs(want).max()


def test_gguf_logits_match_transformers(tiny_gguf):
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float64)
    tokens = np.random.default_rng(2).integers(0, 128, 20)
    got = prompt_then_decode(reference(load_spec(str(tiny_gguf), {"max_seq_len": 32})), tokens, 6)
    assert (relative_errors(got, hf_logits(hf.eval(), tokens)) < 1e-4).all()


def _gguf_and_twin(model, folder):
    """`model`, its GGUF as llama.cpp writes it, and its safetensors folder (with config.json)."""
    write_gguf(folder / "model.gguf", model)
    model.save_pretrained(folder / "twin", safe_serialization=True)
    return model, folder / "model.gguf", folder / "twin"


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A transformers qwen2 (llama.cpp writes its Q/K rows as they are), as GGUF and as safetensors."""
    return _gguf_and_twin(_small_model("qwen2", 6, rms_norm_eps=1e-6), tmp_path_factory.mktemp("qwen2"))


def test_qwen2_gguf_tensors_are_its_safetensors_twins(qwen2):
    """Every tensor, Q/K rows and their biases included, as the safetensors twin has it and as
    transformers' own GGUF loader reads the file: once, every qwen2 GGUF's Q/K rows were
    "un-permuted" like a llama's, scrambling them while their biases stayed in order."""
    import torch
    from transformers import AutoModelForCausalLM
    _, path, twin = qwen2
    ckpt, want = load_checkpoint(load_spec(str(path))), load_checkpoint(load_spec(str(twin)))
    assert ckpt.expected.keys() == want.expected.keys() and "layers.1.bk" in ckpt.expected
    state = _state(AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32))
    for canon, (hf_name, _) in want.expected.items():
        np.testing.assert_array_equal(ckpt.get(canon), want.get(canon), err_msg=canon)
        np.testing.assert_array_equal(ckpt.get(canon), state[hf_name], err_msg=canon)


def test_qwen2_gguf_logits_are_its_safetensors_twins(qwen2):
    """On the reference backend: the GGUF's logits are the safetensors twin's, and transformers'."""
    model, path, twin = qwen2
    tokens = np.random.default_rng(3).integers(0, 128, 20)
    got, want = (prompt_then_decode(reference(load_spec(str(p), {"max_seq_len": 32})), tokens, 6)
                 for p in (path, twin))
    assert (relative_errors(got, want) < 1e-12).all()       # 2e-15 measured, not 0: a GGUF's eps is float32
    assert (relative_errors(got, hf_logits(copy.deepcopy(model).double(), tokens)) < 2e-6).all()


def test_llama_gguf_biases_are_unpermuted_with_their_rows(qwen2, tmp_path):
    """llama.cpp's converter reorders a llama's q/k biases with their rows: a qwen2 model written
    as a llama GGUF and read with its own config gets rows and biases back in order."""
    model, path = qwen2[0], tmp_path / "biased-llama.gguf"
    write_gguf(path, model, arch="llama")
    ckpt = load_checkpoint(load_spec({"weights": str(path), "config": model.config.to_dict()}))
    state = _state(model)
    for canon, hf_name in (("wq", "q_proj.weight"), ("wk", "k_proj.weight"), ("bq", "q_proj.bias"),
                           ("bk", "k_proj.bias"), ("bv", "v_proj.bias")):
        np.testing.assert_array_equal(ckpt.get(f"layers.1.{canon}"), state[f"model.layers.1.self_attn.{hf_name}"],
                                      err_msg=canon)


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_gguf_of_another_architecture_is_refused_beside_a_config(hf_llama, tmp_path, arch):
    """Whether Q/K rows were reordered is the file's architecture's to say, not the config's: a
    GGUF of an architecture kiec does not know is refused, not read in a guessed order. "mistral"
    was read once; llama.cpp writes Mistral as "llama", and no writer or reader of "mistral" says
    which order its rows are in."""
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, hf_llama, arch=arch)
    for load in (lambda: load_spec(str(path)),          # its own metadata as the config
                 lambda: load_checkpoint(load_spec({"weights": str(path), "config": hf_llama.config.to_dict()}))):
        with pytest.raises(KiecError) as info:
            load()
        assert info.value.field == "weights" and f"general.architecture='{arch}'" in info.value.value
        assert info.value.expected == "a llama or qwen2 GGUF"
        assert ("safetensors checkpoint" in info.value.hint) == (arch == "mistral")


@pytest.mark.parametrize("keep", [3, 16, 100, 0.1, 0.5, -1])
def test_truncated_gguf(tiny_gguf, tmp_path, keep):
    data = tiny_gguf.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else (len(data) + keep if keep < 0 else keep)
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut])
    with pytest.raises(KiecError) as info:           # the spec reads the config from the GGUF
        load_spec(str(bad))
    assert info.value.field == "weights" and str(bad) in str(info.value.value)
    spec = load_spec(str(tiny_gguf)).replace(weights=str(bad))
    with pytest.raises(KiecError) as info:           # and the checkpoint opens it again
        load_checkpoint(spec)
    assert info.value.field == "weights"


def test_gguf_with_bad_magic(tiny_gguf, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"FUGG" + tiny_gguf.read_bytes()[4:])
    with pytest.raises(KiecError) as info:
        load_spec(str(bad))
    assert info.value.expected == "a GGUF file"


@pytest.mark.parametrize("dtype, code", [(np.int32, "I32"), (np.float64, "F64"), (np.int8, "I8")])
def test_wrong_dtype_in_gguf(hf_llama, tiny_gguf, tmp_path, dtype, code):
    bad = tmp_path / "dtype.gguf"
    write_gguf(bad, hf_llama, change=lambda n, a: a.astype(dtype) if n == "blk.0.attn_v.weight" else a)
    with pytest.raises(KiecError) as info:
        load_checkpoint(load_spec(str(bad)))
    assert info.value.field == "weights[blk.0.attn_v.weight].dtype" and info.value.value == code


def test_fp16_gguf_tensor_is_fine(hf_llama, tmp_path):
    path = tmp_path / "f16.gguf"
    write_gguf(path, hf_llama, change=lambda n, a: a.astype(np.float16) if n == "blk.0.attn_v.weight" else a)
    ckpt = load_checkpoint(load_spec(str(path)))
    want = _state(hf_llama)["model.layers.0.self_attn.v_proj.weight"].astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(ckpt.get("layers.0.wv"), want)


def test_gguf_missing_and_misshapen_tensors(hf_llama, tmp_path):
    path = tmp_path / "missing.gguf"
    write_gguf(path, hf_llama, change=lambda n, a: None if n == "blk.1.ffn_down.weight" else a)
    with pytest.raises(KiecError) as info:
        load_checkpoint(load_spec(str(path)))
    assert info.value.field == "weights[blk.1.ffn_down.weight]" and info.value.value == "missing"
    path = tmp_path / "shape.gguf"
    write_gguf(path, hf_llama, change=lambda n, a: a[:, :32] if n == "blk.1.ffn_down.weight" else a)
    with pytest.raises(KiecError) as info:
        load_checkpoint(load_spec(str(path)))
    assert info.value.field == "weights[blk.1.ffn_down.weight].shape" and info.value.value == [64, 32]


@pytest.mark.parametrize("key, value", [
    ("llama.embedding_length", None), ("llama.block_count", None), ("llama.attention.head_count", None),
    ("llama.feed_forward_length", None),
    ("llama.embedding_length", "sixty-four"), ("llama.feed_forward_length", [96, 96]),
    ("llama.context_length", 1.5), ("llama.rope.freq_base", "x"), ("llama.attention.head_count_kv", True),
])
def test_gguf_missing_or_mistyped_metadata(hf_llama, tmp_path, key, value):
    """A required key dropped (None) or a key of another type: one KiecError naming the key, its
    value and the file, not a TypeError from int(None)."""
    path = tmp_path / "meta.gguf"
    write_gguf(path, hf_llama, meta={key: value})
    with pytest.raises(KiecError) as info:
        load_spec(str(path))
    assert info.value.field == key and info.value.value == value and str(path) in info.value.hint
    assert info.value.hint.startswith("the key is missing") == (value is None)


def test_gguf_optional_metadata_defaults(hf_llama, tmp_path):
    """Without head_count_kv, context_length and vocab_size: all heads, 4096 and the embedding's rows."""
    path = tmp_path / "optional.gguf"
    write_gguf(path, hf_llama, meta=dict.fromkeys(
        ["llama.attention.head_count_kv", "llama.context_length", "llama.vocab_size"]))
    cfg = load_spec(str(path)).config
    assert (cfg.heads, cfg.kv_heads, cfg.max_positions, cfg.vocab) == (4, 4, 4096, 128)


LINEAR = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}


@pytest.mark.parametrize("meta, want", [
    (LINEAR, {"rope_type": "linear", "factor": 4.0}),
    ({"llama.rope.scaling.factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),    # llama.cpp's default type
    ({"llama.rope.scale_linear": 2.0}, {"rope_type": "linear", "factor": 2.0}),      # the older key
    ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, {}),     # llama.cpp: never scale
    ({"llama.rope.scaling.original_context_length": 64}, {}),
])
def test_gguf_rope_scaling_keys_are_read(hf_llama, tmp_path, meta, want):
    """As llama.cpp reads them: they were ignored, and the model ran with unscaled positions."""
    path = tmp_path / "scaled.gguf"
    write_gguf(path, hf_llama, meta=meta)
    assert dict(load_spec(str(path)).config.rope_scaling) == want


@pytest.mark.parametrize("meta, key, value", [
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, "llama.rope.scaling.type", "yarn"),
    ({"llama.rope.scaling.type": "longrope"}, "llama.rope.scaling.type", "longrope"),
    ({"llama.rope.scaling.type": 1}, "llama.rope.scaling.type", 1),
    ({"llama.rope.scaling.type": "linear"}, "llama.rope.scaling.factor", None),
    (dict(LINEAR, **{"llama.rope.scaling.factor": 0.0}), "llama.rope.scaling.factor", 0.0),
    ({"llama.rope.scaling.factor": -2.0}, "llama.rope.scaling.factor", -2.0),
    ({"llama.rope.scaling.factor": "4"}, "llama.rope.scaling.factor", "4"),
    ({"llama.rope.scale_linear": float("inf")}, "llama.rope.scale_linear", float("inf")),
])
def test_gguf_rope_scaling_kiec_cannot_run_is_refused_by_key(hf_llama, tmp_path, meta, key, value):
    path = tmp_path / "scaled.gguf"
    write_gguf(path, hf_llama, meta=meta)
    with pytest.raises(KiecError) as info:
        load_spec(str(path))
    assert info.value.field == key and info.value.value == value and str(path) in info.value.hint


def test_linear_scaled_gguf_logits_match_transformers(tmp_path):
    """A linear-scaled llama written as llama.cpp writes it (rope.scaling.type and .factor) gives
    transformers' logits; without the keys the logits are far off, so the test sees them read."""
    model = _small_model("llama", 7, rope_scaling={"rope_type": "linear", "factor": 4.0})
    tokens = np.random.default_rng(4).integers(0, 128, 20)
    want, errors = hf_logits(copy.deepcopy(model).double(), tokens), {}
    for name, meta in (("scaled", None), ("unscaled", dict.fromkeys(LINEAR))):
        path = tmp_path / f"{name}.gguf"
        write_gguf(path, model, meta=meta)
        got = prompt_then_decode(reference(load_spec(str(path), {"max_seq_len": 32})), tokens, 6)
        errors[name] = relative_errors(got, want).max()
    assert errors["scaled"] < 2e-6 and errors["unscaled"] > 1e-3, errors


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}   # head_dim 16: unscaled, smoothed and scaled pairs all occur


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """A llama with llama3 RoPE scaling (Llama-3.1/3.2's), as GGUF (a rope_freqs tensor) and as safetensors."""
    return _gguf_and_twin(_small_model("llama", 8, rope_scaling=LLAMA3), tmp_path_factory.mktemp("llama3"))


def test_llama3_gguf_rope_freqs_give_the_logits_of_its_config(llama3, tmp_path):
    """A GGUF's rope_freqs factors divide each pair's inverse frequency, as llama.cpp applies them:
    the logits are those of the safetensors twin (rope_scaling llama3 in config.json) and
    transformers'. Without the tensor they are far off, so the test sees it read. It was refused:
    "weights[rope_freqs.weight]: got 'an extra tensor'"."""
    model, path, twin = llama3
    tokens = np.random.default_rng(5).integers(0, 128, 20)
    spec = load_spec(str(path), {"max_seq_len": 32})
    assert dict(spec.config.rope_scaling)["rope_type"] == "freq_factors"
    np.testing.assert_allclose(rope_inv_freq(spec.config), rope_inv_freq(load_spec(str(twin)).config), rtol=1e-6)
    got = prompt_then_decode(reference(spec), tokens, 6)
    want = prompt_then_decode(reference(load_spec(str(twin), {"max_seq_len": 32})), tokens, 6)
    assert (relative_errors(got, want) < 1e-7).all()        # 2e-9 measured: the tensor is float32
    assert (relative_errors(got, hf_logits(copy.deepcopy(model).double(), tokens)) < 2e-6).all()
    plain = tmp_path / "without.gguf"
    write_gguf(plain, model, change=lambda name, a: None if name == "rope_freqs.weight" else a)
    unscaled = prompt_then_decode(reference(load_spec(str(plain), {"max_seq_len": 32})), tokens, 6)
    assert relative_errors(unscaled, want).max() > 1e-3


def test_gguf_rope_freqs_beside_a_config_must_agree_with_it(llama3):
    """model.json may give a config beside the GGUF; the RoPE table is the config's, so its scaling
    must imply the tensor's factors: llama3 does, none does not (pair 1 is smoothed)."""
    model, path, _ = llama3
    config = model.config.to_dict()
    ckpt = load_checkpoint(load_spec({"weights": str(path), "config": config}))
    assert dict(ckpt.cfg.rope_scaling)["rope_type"] == "llama3"
    spec = load_spec({"weights": str(path), "config": dict(config, rope_parameters={"rope_theta": 10000.0})})
    with pytest.raises(KiecError) as info:
        load_checkpoint(spec)
    assert info.value.field == "weights[rope_freqs.weight][1]" and "disagree" in info.value.hint


@pytest.mark.parametrize("change, meta, field, value", [
    (lambda a: a[:4], None, "weights[rope_freqs.weight].shape", [4]),
    (lambda a: a.astype(np.int32), None, "weights[rope_freqs.weight].dtype", "I32"),
    (lambda a: np.where(np.arange(8) == 2, -a, a), None, "weights[rope_freqs.weight][2]", None),
    (lambda a: np.where(np.arange(8) == 5, np.nan, a), None, "weights[rope_freqs.weight][5]", None),
    (lambda a: a, LINEAR, "weights[rope_freqs.weight]", "the tensor beside linear RoPE scaling keys"),
], ids=["short", "int32", "negative", "nan", "beside-linear-keys"])
def test_bad_gguf_rope_freqs_are_refused_by_name(llama3, tmp_path, change, meta, field, value):
    path = tmp_path / "bad.gguf"
    write_gguf(path, llama3[0], meta=meta, change=lambda name, a: change(a) if name == "rope_freqs.weight" else a)
    with pytest.raises(KiecError) as info:
        load_spec(str(path))
    assert info.value.field == field and str(path) in info.value.hint
    assert value is None or info.value.value == value


def test_unknown_weights_suffix(tiny_llama, tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 16)
    spec = load_spec({"weights": str(path), "config": str(tiny_llama / "config.json")})
    with pytest.raises(KiecError) as info:
        load_checkpoint(spec)
    assert info.value.field == "weights" and ".bin" in info.value.hint


# --- the real SmolLM2 GGUF -------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_gguf_weights_equal_transformers(smollm2_gguf, smollm2_hf, one_gguf_parse):
    """kiec's dequantized Q4_1 weights (Q/K un-permuted) against what transformers loads from the
    same file: q/k/v/o of a few layers, a whole layer, the embedding and the final norm."""
    spec = load_spec(str(smollm2_gguf), {"max_seq_len": 64})
    ckpt = load_checkpoint(spec)
    state = smollm2_hf.state_dict()
    assert spec.config.tie_embeddings and "lm_head" not in ckpt.expected
    names = {c: n for c, n in _hf_names(spec.config.layers).items()
             if not c.startswith("layers.") or c.split(".")[1] in ("0", "17")
             or c.endswith((".wq", ".wk"))}
    names.pop("lm_head")
    for canon, hf_name in names.items():
        want = state[hf_name].detach().numpy()
        np.testing.assert_allclose(ckpt.get(canon), want, rtol=0, atol=1e-6, err_msg=canon)


def test_a_gguf_in_upper_case_loads_its_weights_as_the_lower_case_one(tiny_gguf, tmp_path):
    # the loader, the weights and their names all read it as a GGUF, not only load_spec
    upper = tmp_path / "TINY.GGUF"
    upper.symlink_to(tiny_gguf)
    lower, other = load_checkpoint(load_spec(str(tiny_gguf))), load_checkpoint(load_spec(str(upper)))
    np.testing.assert_array_equal(other.get("layers.0.wq"), lower.get("layers.0.wq"))
