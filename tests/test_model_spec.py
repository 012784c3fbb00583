"""model.json -> ModelSpec: every bad input is ONE KiecError naming the field, the value and
what was expected; through the CLI it is one `kiec: error:` line, exit code 2, no traceback."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from kiec.errors import KiecError
from kiec.model import load_spec
from kiec.synthetic import preset


def _error(source, **overrides) -> KiecError:
    with pytest.raises(KiecError) as info:
        load_spec(source, overrides or None)
    return info.value


def _spec_dict(folder, **fields) -> dict:
    return dict({"weights": str(folder)}, **fields)


def test_a_good_folder_loads(tiny_llama):
    spec = load_spec(str(tiny_llama), {"max_seq_len": 128})
    cfg = spec.config
    want = preset("tiny-llama")
    assert (cfg.arch, cfg.hidden, cfg.layers, cfg.heads, cfg.kv_heads, cfg.ffn, cfg.vocab) == (
        "llama", want["hidden_size"], want["num_hidden_layers"], want["num_attention_heads"],
        want["num_key_value_heads"], want["intermediate_size"], want["vocab_size"])
    assert cfg.head_dim == want["hidden_size"] // want["num_attention_heads"]
    assert spec.max_seq_len == 128 and spec.lanes == 1 and spec.weights == str(tiny_llama.resolve())


def test_model_json_with_relative_paths(tiny_llama, tmp_path):
    shutil.copytree(tiny_llama, tmp_path / "m")
    (tmp_path / "model.json").write_text(json.dumps({"name": "t", "weights": "m/model.safetensors",
                                                     "config": "m/config.json", "lanes": 2}))
    spec = load_spec(str(tmp_path / "model.json"))
    assert spec.name == "t" and spec.lanes == 2
    assert spec.weights == str((tmp_path / "m" / "model.safetensors").resolve())


def _write_gguf_config(path, config: dict) -> None:
    """A GGUF holding only a llama config's metadata (no tensors): all load_spec reads of it."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_vocab_size(config["vocab_size"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("relative", ["sub/m", "sub/m.gguf"])
def test_relative_folder_or_gguf_is_not_joined_twice(tiny_llama, tmp_path, monkeypatch, relative):
    """`cd /tmp/x && kiec inspect sub/m` once looked for /tmp/x/sub/m/sub/m."""
    (tmp_path / "sub").mkdir()
    if relative.endswith(".gguf"):
        _write_gguf_config(tmp_path / relative, preset("tiny-llama"))
    else:
        shutil.copytree(tiny_llama, tmp_path / relative)
    monkeypatch.chdir(tmp_path)
    spec = load_spec(relative)
    assert spec.weights == str((tmp_path / relative).resolve())
    assert spec.config.vocab == preset("tiny-llama")["vocab_size"]


@pytest.mark.parametrize("arch, hint", [("gpt2", ""), ("lama", "did you mean 'llama'?"),
                                        ("qwen", "did you mean 'qwen2'?")])
def test_unknown_architecture(tiny_llama, arch, hint):
    err = _error(_spec_dict(tiny_llama, architecture=arch))
    assert err.field == "architecture" and err.value == arch
    assert "llama" in err.expected and "laneformer" in err.expected
    assert err.hint == hint


def test_unknown_model_type_in_config(tiny_llama):
    err = _error(_spec_dict(tiny_llama, config=dict(preset("tiny-llama"), model_type="gpt_neox")))
    assert err.field == "architecture" and err.value == "gpt_neox"


@pytest.mark.parametrize("key, nearest", [("max_seq_length", "max_seq_len"), ("lane", "lanes"),
                                          ("weight", "weights"), ("tokeniser", "tokenizer")])
def test_unknown_key_names_it_and_the_nearest(tiny_llama, key, nearest):
    err = _error(_spec_dict(tiny_llama, **{key: 1}))
    assert err.field == key and err.value == 1
    assert err.hint == f"did you mean {nearest!r}?"
    assert f"{key}: got 1" in str(err) and repr(nearest) in str(err)


def test_unknown_key_with_nothing_near(tiny_llama):
    err = _error(_spec_dict(tiny_llama, zzzzzz=True))
    assert err.field == "zzzzzz" and err.hint == "" and "max_seq_len" in err.expected


def test_missing_weights(tmp_path):
    err = _error({"weights": str(tmp_path / "nope.safetensors")})
    assert err.field == "weights" and err.value.endswith("nope.safetensors") and err.hint == "no such file"
    err = _error({"name": "x"})
    assert err.field == "weights" and "missing" in err.hint


def test_missing_model_json(tmp_path):
    err = _error(str(tmp_path / "absent.json"))
    assert err.field == "model" and err.value.endswith("absent.json") and err.hint == "no such file"


def test_unreadable_model_json(tmp_path):
    bad = tmp_path / "model.json"
    bad.write_bytes(b"\xff\xfe\x00 not utf-8")
    assert _error(str(bad)).field == "model"
    bad.write_text('{"weights": "x",}')
    err = _error(str(bad))
    assert err.field == "model" and err.expected == "valid JSON" and "line 1" in err.hint
    bad.write_text("[1, 2]")
    assert "JSON object" in _error(str(bad)).expected


def test_unreadable_config(tiny_llama, tmp_path):
    (tmp_path / "config.json").mkdir()                 # a folder where a file must be: open() fails
    err = _error(_spec_dict(tiny_llama / "model.safetensors", config=str(tmp_path / "config.json")))
    assert err.field == "config" and err.expected == "a readable file"
    (tmp_path / "c.json").write_text("{oops")
    err = _error(_spec_dict(tiny_llama, config=str(tmp_path / "c.json")))
    assert err.field == "config" and err.expected == "valid JSON"


@pytest.mark.parametrize("content, expected", [(b"[1, 2]", "a JSON object at the top of the file"),
                                               (b'"text"', "a JSON object at the top of the file"),
                                               (b"\xff\xfe{}", "a UTF-8 JSON file")])
@pytest.mark.parametrize("given", [True, False])       # named in model.json, or found beside the weights
def test_config_json_not_an_object_or_not_utf8(tiny_llama, tmp_path, content, expected, given):
    shutil.copy(tiny_llama / "model.safetensors", tmp_path)
    (tmp_path / "config.json").write_bytes(content)
    fields = {"config": str(tmp_path / "config.json")} if given else {}
    err = _error({"weights": str(tmp_path / "model.safetensors"), **fields})
    assert err.field == "config" and err.value == str((tmp_path / "config.json").resolve())
    assert err.expected == expected


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_weights(tiny_llama, tmp_path):
    shutil.copytree(tiny_llama, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").chmod(0)
    err = _error({"weights": str(tmp_path / "m" / "model.safetensors")})
    assert err.field == "weights" and err.hint == "permission denied"


def test_no_config_beside_the_weights(tiny_llama, tmp_path):
    shutil.copy(tiny_llama / "model.safetensors", tmp_path)
    err = _error({"weights": str(tmp_path / "model.safetensors")})
    assert err.field == "config" and "no config.json" in err.hint


@pytest.mark.parametrize("lanes, what", [(3, "num_attention_heads (4)"), (4, "num_key_value_heads (2)")])
def test_heads_not_divisible_by_lanes(tiny_llama, lanes, what):
    err = _error(_spec_dict(tiny_llama, lanes=lanes))
    assert err.field == "lanes" and err.value == lanes and err.expected == f"a divisor of {what}"


def test_ffn_not_divisible_by_lanes(tiny_llama):
    config = preset("tiny-llama", num_key_value_heads=4, intermediate_size=130)
    err = _error(_spec_dict(tiny_llama, config=config, lanes=4))
    assert err.field == "lanes" and err.value == 4 and err.expected == "a divisor of intermediate_size (130)"
    assert load_spec(_spec_dict(tiny_llama, config=config, lanes=2)).lanes == 2


def test_vocab_parallel_head_needs_lanes_to_divide_vocab(tmp_path):
    config = dict(_tiny_laneformer(), num_lanes=2, vocab_size=255, lm_head_type="vocab_parallel")
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")
    err = _error(str(tmp_path))
    assert err.field == "config.num_lanes" and "vocab_size (255)" in err.expected     # the checkpoint's count


@pytest.mark.parametrize("value", [0, -1, "128", 1.5, True, None])
def test_max_seq_len_must_be_a_positive_integer(tiny_llama, value):
    err = _error(_spec_dict(tiny_llama, max_seq_len=value))
    assert err.field == "max_seq_len" and err.value == value and err.expected == "a positive integer"


def test_max_seq_len_beyond_the_model(tiny_llama):
    limit = preset("tiny-llama")["max_position_embeddings"]
    assert load_spec(_spec_dict(tiny_llama, max_seq_len=limit)).max_seq_len == limit
    err = _error(_spec_dict(tiny_llama, max_seq_len=limit + 1))
    assert err.field == "max_seq_len" and err.value == limit + 1 and f"({limit})" in err.expected
    err = _error(str(tiny_llama), max_seq_len=10 ** 6)       # an override (the CLI's --max-seq-len)
    assert err.field == "max_seq_len"


@pytest.mark.parametrize("field, value, expected_part", [
    ("gpus", 3, "1 or the lane count"), ("gpus", 0, "a positive integer"),
    ("lanes", 0, "a positive integer"), ("lanes", "2", "a positive integer"),
    ("dtype", "fp32", "bf16"), ("target", "cuda:sm_80", "cuda:sm_90"),
    ("dtp_delay", 0, "a delay d >= 1"), ("dtp_delay", 2, "smaller than the layer count (2)"),
])
def test_other_fields(tiny_llama, field, value, expected_part):
    err = _error(_spec_dict(tiny_llama, **{field: value}))
    assert err.field == field and err.value == value and expected_part in err.expected


@pytest.mark.parametrize("key, value, field, shown", [
    ("num_attention_heads", 0, "config.num_attention_heads", 0),
    ("hidden_size", "64", "config.hidden_size", "64"),
    ("num_key_value_heads", 3, "config.num_key_value_heads", 3),
    ("hidden_act", "gelu", "config.hidden_act", "gelu"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "config.rope_scaling", "yarn"),
])
def test_bad_config_values(tiny_llama, key, value, field, shown):
    err = _error(_spec_dict(tiny_llama, config=preset("tiny-llama", **{key: value})))
    assert err.field == field and err.value == shown


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def _without(params: dict, key: str) -> dict:
    return {k: v for k, v in params.items() if k != key}


@pytest.mark.parametrize("key, value, field, shown", [
    ("rms_norm_eps", "1e-5", "config.rms_norm_eps", "1e-5"),
    ("rms_norm_eps", -1, "config.rms_norm_eps", -1),
    ("rms_norm_eps", 0, "config.rms_norm_eps", 0),
    ("rms_norm_eps", None, "config.rms_norm_eps", None),
    ("rope_theta", "1e4", "config.rope_theta", "1e4"),
    ("rope_theta", 0, "config.rope_theta", 0),
    ("rope_theta", float("inf"), "config.rope_theta", float("inf")),
    ("rope_theta", True, "config.rope_theta", True),
    ("rope_scaling", "abc", "config.rope_scaling", "abc"),
    ("rope_scaling", [1], "config.rope_scaling", [1]),
    ("rope_parameters", "x", "config.rope_parameters", "x"),
    ("rope_parameters", {"rope_theta": -5.0}, "config.rope_parameters.rope_theta", -5.0),
    ("rope_parameters", {"rope_type": "yarn"}, "config.rope_parameters", "yarn"),
    ("rope_scaling", {"rope_type": "llama3"}, "config.rope_scaling.factor", None),
    ("rope_scaling", {"type": "linear"}, "config.rope_scaling.factor", None),
    ("rope_scaling", {"rope_type": "linear", "factor": "2"}, "config.rope_scaling.factor", "2"),
    ("rope_parameters", {"rope_type": "linear", "factor": 0}, "config.rope_parameters.factor", 0),
    ("rope_scaling", _without(LLAMA3, "low_freq_factor"), "config.rope_scaling.low_freq_factor", None),
    ("rope_scaling", _without(LLAMA3, "original_max_position_embeddings"),
     "config.rope_scaling.original_max_position_embeddings", None),
    ("rope_scaling", dict(LLAMA3, high_freq_factor=-4.0), "config.rope_scaling.high_freq_factor", -4.0),
    ("rope_scaling", dict(LLAMA3, high_freq_factor=1.0), "config.rope_scaling.high_freq_factor", 1.0),
    ("rope_scaling", {"rope_type": "freq_factors"}, "config.rope_scaling.factors", None),
    ("rope_scaling", {"rope_type": "freq_factors", "factors": [1.0] * 7}, "config.rope_scaling.factors", [1.0] * 7),
    ("rope_scaling", {"rope_type": "freq_factors", "factors": 2.0}, "config.rope_scaling.factors", 2.0),
    ("rope_scaling", {"rope_type": "freq_factors", "factors": [1.0] * 7 + [0]}, "config.rope_scaling.factors[7]", 0),
])
def test_bad_float_and_rope_config_values(tiny_llama, key, value, field, shown):
    """Once a ValueError, a KeyError at run time, or NaN logits with exit code 0."""
    err = _error(_spec_dict(tiny_llama, config=preset("tiny-llama", **{key: value})))
    assert err.field == field and err.value == shown
    assert str(err).startswith(f"{field}: got ")


@pytest.mark.parametrize("name, key, value", [("tiny-mistral", "sliding_window", True),
                                              ("tiny-mistral", "sliding_window", 16.0)])
def test_a_window_given_as_true_or_a_float_is_refused(tiny_llama, name, key, value):
    """JSON's true is an int to Python: a window of true was read as a window of one position."""
    err = _error(_spec_dict(tiny_llama, config=preset(name, **{key: value})))
    assert err.field == f"config.{key}" and err.value is value


@pytest.mark.parametrize("key, value", [("rope_scaling", LLAMA3), ("rope_scaling", {"type": "linear", "factor": 2}),
                                        ("rope_parameters", dict(LLAMA3, rope_theta=500000.0)),
                                        ("rope_scaling", {"rope_type": "freq_factors", "factors": [1, 2.5] * 4}),
                                        ("rope_scaling", None), ("rms_norm_eps", 1e-6), ("rope_theta", 10000)])
def test_good_rope_and_float_config_values(tiny_llama, key, value):
    import numpy as np
    from kiec.model import rope_inv_freq
    cfg = load_spec(_spec_dict(tiny_llama, config=preset("tiny-llama", **{key: value}))).config
    assert np.isfinite(rope_inv_freq(cfg)).all() and cfg.norm_eps > 0


def test_missing_config_key(tiny_llama):
    config = preset("tiny-llama")
    del config["num_hidden_layers"]
    err = _error(_spec_dict(tiny_llama, config=config))
    assert err.field == "config.num_hidden_layers" and err.value is None and "missing" in err.hint


def _tiny_laneformer(**changes) -> dict:
    return preset("laneformer-2b", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, intermediate_size=64, vocab_size=64, max_position_embeddings=64,
                  num_lanes=2, broadcast_delay=1, **changes)


def test_laneformer_lanes_are_fixed_by_the_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_tiny_laneformer()))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert load_spec(str(tmp_path)).lanes == 2
    err = _error(str(tmp_path), lanes=1)
    assert err.field == "lanes" and err.value == 1 and "num_lanes (2)" in err.expected
    (tmp_path / "config.json").write_text(json.dumps(_tiny_laneformer(lm_head_type="columns")))
    err = _error(str(tmp_path))
    assert err.field == "config.lm_head_type" and err.value == "columns"


@pytest.mark.parametrize("key, value, expected_part", [
    ("sliding_window", -16, "a positive integer or null"), ("sliding_window", "16", "a positive integer or null"),
    ("sliding_window", 1.5, "a positive integer or null"),
    ("sliding_window_n_layers", "1", "an integer"), ("sliding_window_n_layers", 1.0, "an integer"),
    ("unclamped_layers", 1, "a list of layer indices (0 to 1)"),
    ("unclamped_layers", "01", "a list of layer indices"), ("unclamped_layers", [[1]], "a list of layer indices"),
    ("unclamped_layers", [2], "a list of layer indices (0 to 1)"),
    ("norm_eps", "1e-5", "a positive finite number"), ("norm_eps", -1e-5, "a positive finite number"),
    ("rope_theta", 0, "a positive finite number"), ("rope_theta", float("nan"), "a positive finite number"),
])
def test_bad_laneformer_config_values(tmp_path, key, value, expected_part):
    (tmp_path / "config.json").write_text(json.dumps(_tiny_laneformer(**dict(dict(sliding_window=8), **{key: value}))))
    (tmp_path / "model.safetensors").write_bytes(b"")
    err = _error(str(tmp_path))
    assert err.field == f"config.{key}" and expected_part in err.expected
    assert err.value == value or value != value           # NaN is not equal to itself


@pytest.mark.parametrize("changes, flags", [
    (dict(sliding_window_n_layers=1), (True, False)), (dict(sliding_window_n_layers=-1), (False, True)),
    (dict(sliding_window_n_layers=2, unclamped_layers=[0]), (False, True)),
    (dict(sliding_window=None, sliding_window_n_layers=None, unclamped_layers=None), ()),
])
def test_good_laneformer_window_fields(tmp_path, changes, flags):
    (tmp_path / "config.json").write_text(json.dumps(_tiny_laneformer(**dict(dict(sliding_window=8), **changes))))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert load_spec(str(tmp_path)).config.window_layers == flags


# --- through the command line ------------------------------------------------------------------

def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "kiec.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def _assert_one_error_line(run, *parts):
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kiec: error: "), run.stderr
    for part in parts:
        assert part in lines[0], lines[0]


@pytest.mark.parametrize("command", ["run", "inspect"])
def test_cli_unknown_key(tiny_llama, tmp_path, command):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"weights": str(tiny_llama), "max_seq_length": 64}))
    _assert_one_error_line(_cli(command, str(bad)), "max_seq_length: got 64", "did you mean 'max_seq_len'?")


@pytest.mark.parametrize("command", ["run", "inspect"])
def test_cli_bad_values(tiny_llama, tmp_path, command):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"weights": str(tiny_llama), "architecture": "gpt2"}))
    _assert_one_error_line(_cli(command, str(bad)), "architecture: got 'gpt2'")
    _assert_one_error_line(_cli(command, str(tiny_llama), "--max-seq-len", "0"), "max_seq_len: got 0")
    _assert_one_error_line(_cli(command, str(tiny_llama), "--lanes", "3"), "lanes: got 3")
    _assert_one_error_line(_cli(command, str(tmp_path / "missing.json")), "model: got", "no such file")
    bad.write_text("{")
    _assert_one_error_line(_cli(command, str(bad)), "valid JSON")


def test_cli_run_truncated_checkpoint(tmp_path, smollm2_gguf):
    # with a tokenizer: `run` loads it before the weights, so that a missing one fails first
    from serving import write_tiny_chat_model
    model = write_tiny_chat_model(tmp_path, smollm2_gguf)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    _assert_one_error_line(_cli("run", str(model), "--backend", "reference", "--max-tokens", "2", "--quiet"),
                           "weights", "truncated")


def test_cli_run_without_a_tokenizer_says_so_before_reading_the_weights(tiny_llama, tmp_path):
    shutil.copy(tiny_llama / "config.json", tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a checkpoint")      # never read
    _assert_one_error_line(_cli("run", str(tmp_path), "--backend", "reference", "--max-tokens", "2"),
                           "tokenizer: got", "no tokenizer.json found")


def _folder_with_config(tmp_path, name: str, base: str = "tiny-llama", **changes):
    """A copy-free model folder: a config.json (preset with changes) and no weights read (load_spec only)."""
    folder = tmp_path / name
    folder.mkdir()
    cfg = preset(base, **{k: v for k, v in changes.items() if v is not ...})
    for key in [k for k, v in changes.items() if v is ...]:
        cfg.pop(key, None)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_a_folder_s_whole_name_is_the_model_s(tmp_path):
    # Path.stem would cut at the first dot: "Llama-3" would be served, and clients sending the real name 404
    assert load_spec(str(_folder_with_config(tmp_path, "Llama-3.2-1B-Instruct"))).name == "Llama-3.2-1B-Instruct"


@pytest.mark.parametrize("key", ["head_dim", "num_key_value_heads"])
def test_a_null_size_is_its_default(tmp_path, key):
    # as transformers reads them (Mistral-7B-Instruct-v0.3 ships "head_dim": null)
    plain = load_spec(str(_folder_with_config(tmp_path, "plain", **{key: ...}))).config
    null = load_spec(str(_folder_with_config(tmp_path, "null", **{key: None}))).config
    assert null == plain


def test_tie_word_embeddings_is_a_flag_not_a_truthy_string(tmp_path):
    err = _error(str(_folder_with_config(tmp_path, "t", tie_word_embeddings="false")))
    assert err.field == "config.tie_word_embeddings"


@pytest.mark.parametrize("where, field", [({"target": ["cuda:sm_90"]}, "target"), ({"dtype": ["bf16"]}, "dtype"),
                                          ({"architecture": ["llama"]}, "architecture")])
def test_a_list_where_a_name_goes_is_an_error_naming_the_field(tmp_path, where, field):
    assert _error(_spec_dict(_folder_with_config(tmp_path, "t"), **where)).field == field


def test_a_model_type_that_is_not_a_string_is_named(tmp_path):
    assert _error(str(_folder_with_config(tmp_path, "t", model_type=["llama"]))).field == "config.model_type"


def test_qwen2_without_use_sliding_window_has_no_window_whatever_its_layer_types(tmp_path):
    layers = preset("tiny-qwen2")["num_hidden_layers"]
    off = _folder_with_config(tmp_path, "off", "tiny-qwen2", use_sliding_window=False, sliding_window=8,
                              layer_types=["sliding_attention"] * layers)
    assert load_spec(str(off)).config.sliding_window == 0
    bad = _folder_with_config(tmp_path, "bad", "tiny-qwen2", use_sliding_window=True, sliding_window=8,
                              max_window_layers="1", layer_types=...)
    assert _error(str(bad)).field == "config.max_window_layers"


def test_a_safetensors_file_is_a_model_argument(tiny_llama):
    spec = load_spec(str(tiny_llama / "model.safetensors"))
    assert spec.weights == str((tiny_llama / "model.safetensors").resolve()) and spec.name == "model"


def test_a_folder_holding_only_a_gguf_points_at_it(tmp_path):
    folder = tmp_path / "g"
    folder.mkdir()
    (folder / "m.GGUF").write_bytes(b"")
    err = _error(str(folder))
    assert err.field == "config" and str(folder / "m.GGUF") in str(err)


def test_a_gguf_is_a_gguf_in_any_case(tmp_path):
    _write_gguf_config(tmp_path / "M.GGUF", preset("tiny-llama"))
    spec = load_spec(str(tmp_path / "M.GGUF"))
    assert spec.config.vocab == preset("tiny-llama")["vocab_size"] and spec.tokenizer == spec.weights


def test_a_laneformer_s_lane_count_is_named_where_it_came_from(tmp_path):
    # 32 heads over the checkpoint's 3 lanes: the user set no `lanes`, so the error names num_lanes
    folder = _folder_with_config(tmp_path, "lf", "laneformer-2b", num_lanes=3)
    assert _error(str(folder)).field == "config.num_lanes"
    assert _error(_spec_dict(folder, lanes=3)).field == "lanes"


def test_missing_window_keys_are_transformers_defaults(tmp_path):
    # qwen2's max_window_layers 28 (layers from 28 on slide), mistral's sliding_window 4096; null: no window
    qwen = _folder_with_config(tmp_path, "q", "tiny-qwen2", num_hidden_layers=30, use_sliding_window=True,
                               sliding_window=5, max_window_layers=..., layer_types=...)
    cfg = load_spec(str(qwen)).config
    assert cfg.sliding_window == 5 and cfg.window_layers == tuple(i >= 28 for i in range(30))
    mistral = load_spec(str(_folder_with_config(tmp_path, "m", "tiny-mistral", sliding_window=...))).config
    assert mistral.sliding_window == 4096 and all(mistral.window_layers)
    assert load_spec(str(_folder_with_config(tmp_path, "n", "tiny-mistral", sliding_window=None))).config.sliding_window == 0


def test_a_head_dim_given_need_not_divide_the_hidden_size(tmp_path):
    cfg = load_spec(str(_folder_with_config(tmp_path, "q", "tiny-qwen2", hidden_size=64, num_attention_heads=6,
                                            num_key_value_heads=2, head_dim=16))).config
    assert (cfg.hidden, cfg.head_dim, cfg.q_dim) == (64, 16, 96)
    err = _error(str(_folder_with_config(tmp_path, "n", "tiny-qwen2", hidden_size=64, num_attention_heads=6,
                                         num_key_value_heads=2, head_dim=...)))
    assert err.field == "config.hidden_size" and "or a head_dim" in err.expected


@pytest.mark.parametrize("name", [42, "", "  ", ["m"]])
def test_a_name_that_is_not_a_string_is_refused(tiny_llama, name):
    with pytest.raises(KiecError, match=r"name: got .*; expected a short name for the model \(a non-empty string\)"):
        load_spec({"weights": str(tiny_llama), "name": name})
    assert load_spec({"weights": str(tiny_llama), "name": "tiny"}).name == "tiny"
