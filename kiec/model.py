"""model.json -> ModelSpec: the validated description of one model and how to compile it.

Every architecture is normalised into one `ArchConfig` (the facts the IR needs), so
nothing below this file knows Hugging Face config spellings. Every field is checked
here, once, with an error naming the field, the value and what was expected.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import KiecError, is_int, is_number, nearest

ARCHITECTURES = ("llama", "qwen2", "mistral", "laneformer")
DTYPES = ("bf16", "fp16")
LM_HEAD_TYPES = ("replicate", "lane", "vocab_parallel")
MODEL_TYPE_TO_ARCH = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral",
                      "laneformer_tp": "laneformer", "laneformer": "laneformer"}


@dataclass(frozen=True)
class ArchConfig:
    """The architecture facts the IR is built from, the same names for every family."""
    arch: str
    hidden: int                 # D
    layers: int
    heads: int                  # H, query heads
    kv_heads: int               # KV heads (GQA when < heads)
    head_dim: int
    ffn: int                    # F, intermediate size
    vocab: int                  # V
    max_positions: int
    rope_theta: float
    rope_pairs: str             # "half" (Hugging Face rotate_half) or "adjacent" (complex pairs)
    rope_scaling: tuple = ()    # (("rope_type", "llama3"), ("factor", 32.0), ...) or (); factors: a tuple
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    sliding_window: int = 0     # 0: none
    window_layers: tuple = ()   # per layer: True where the sliding window applies
    # Laneformer (lanes = 1 and the defaults below for every other family)
    lanes: int = 1
    broadcast_delay: int = 1
    use_comm: bool = True
    use_early_comm: bool = True
    lm_head_type: str = "replicate"
    pre_norm_lane_agg: bool = False
    replicated_norm: bool = True

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def uses_window(self, layer: int) -> bool:
        return bool(self.window_layers) and self.window_layers[layer]

    def parameter_count(self) -> int:
        d, f, v = self.hidden, self.ffn, self.vocab
        norm = d if self.replicated_norm else d * self.lanes            # [D], or a per-lane scale [L, D]
        final_norm = d if self.replicated_norm or self.pre_norm_lane_agg else d * self.lanes
        per_layer = d * (self.q_dim + 2 * self.kv_dim) + self.q_dim * d + 3 * d * f + 2 * norm
        if self.qkv_bias:
            per_layer += self.q_dim + 2 * self.kv_dim
        lane_head = self.lm_head_type == "lane" and not self.pre_norm_lane_agg
        head = 0 if self.tie_embeddings else v * d * (self.lanes if lane_head else 1)
        return v * d + self.layers * per_layer + final_norm + head


@dataclass(frozen=True)
class ModelSpec:
    """One validated model.json. Paths are absolute."""
    name: str
    config: ArchConfig
    weights: str
    tokenizer: str
    target: str = "cuda:sm_90"
    lanes: int = 1
    gpus: int = 1
    dtp_delay: int | None = None     # None: the model's own reduce modes
    max_seq_len: int = 4096
    dtype: str = "bf16"
    source: str = ""                 # the model.json (or folder) it came from

    @property
    def approximate(self) -> bool:
        """True when DTP was asked for on a model not trained with it."""
        return self.dtp_delay is not None and self.config.arch != "laneformer"

    def replace(self, **changes) -> "ModelSpec":
        spec = dataclasses.replace(self, **changes)
        _check_spec(spec)
        return spec


SPEC_KEYS = {
    "name": "a short name for the model",
    "architecture": f"one of {', '.join(ARCHITECTURES)}",
    "config": "a Hugging Face-style config: an object, or the path of a config.json",
    "weights": "a safetensors file or folder, a GGUF file, or a Hugging Face model folder",
    "tokenizer": "a tokenizer.json, a folder holding one, or a GGUF file",
    "target": "'cuda:sm_90' or 'hip:gfx942'",
    "lanes": "tensor-parallel lanes (a positive integer)",
    "gpus": "GPUs the lanes run on: 1 or the lane count",
    "dtp_delay": "null (the model's own reduce modes) or a delay d >= 1",
    "max_seq_len": "a positive integer no larger than the model's max_position_embeddings",
    "dtype": f"one of {', '.join(DTYPES)}",
}


def load_spec(source, overrides: dict | None = None) -> ModelSpec:
    """A ModelSpec from a model.json path, a Hugging Face model folder, a GGUF file,
    the name of a built-in model ("smollm2"), or an already parsed dict."""
    if isinstance(source, dict):
        return spec_from_dict(dict(source, **(overrides or {})), base=Path.cwd(), origin="<dict>")
    text = str(source)
    if text in builtin_models():
        return spec_from_dict(dict(builtin_models()[text](), **(overrides or {})), base=Path.cwd(), origin=text)
    path = Path(text).expanduser()
    if not path.exists():
        raise KiecError("model", text, "a model.json, a model folder, a safetensors or GGUF file or one of "
                        + ", ".join(builtin_models()), "no such file")
    if path.is_dir() or is_gguf(path) or path.suffix == ".safetensors":
        # absolute: a relative one would be joined again to the base below (the folder, or the file's folder)
        raw = {"weights": str(path.resolve())}
    else:
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError) as err:
            raise KiecError("model", str(path), "a readable model.json", str(err)) from None
        except json.JSONDecodeError as err:
            raise KiecError("model", str(path), "valid JSON",
                            f"line {err.lineno} column {err.colno}: {err.msg}") from None
        if not isinstance(raw, dict):
            raise KiecError("model", type(raw).__name__, "a JSON object at the top of model.json")
    return spec_from_dict(dict(raw, **(overrides or {})), base=path.parent if path.is_file() else path,
                          origin=str(path))


def is_gguf(path) -> bool:
    """A GGUF file by its name: .gguf in any case (llama.cpp's tools write it lower, people rename)."""
    return Path(path).suffix.lower() == ".gguf"


def builtin_models() -> dict:
    from .fetch import smollm2_spec
    return {"smollm2": smollm2_spec}


def spec_from_dict(raw: dict, base: Path, origin: str) -> ModelSpec:
    for key in raw:
        if key not in SPEC_KEYS:
            raise KiecError(key, raw[key], "no such key in model.json; known keys: " + ", ".join(SPEC_KEYS),
                            nearest(key, SPEC_KEYS))
    if "weights" not in raw:
        raise KiecError("weights", None, SPEC_KEYS["weights"], "the key is missing")
    weights = _existing_path("weights", raw["weights"], base)
    hf_config, default_tokenizer = _find_config(raw, weights, base)
    model_type = hf_config.get("model_type", "")
    if not isinstance(model_type, str):
        raise KiecError("config.model_type", model_type, "a string: one of " + ", ".join(MODEL_TYPE_TO_ARCH))
    arch = raw.get("architecture") or MODEL_TYPE_TO_ARCH.get(model_type)
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise KiecError("architecture", arch if arch else hf_config.get("model_type"),
                        SPEC_KEYS["architecture"], nearest(str(arch), ARCHITECTURES))
    config = arch_config(arch, hf_config)
    tokenizer = _existing_path("tokenizer", raw["tokenizer"], base) if "tokenizer" in raw else default_tokenizer
    default_lanes = config.lanes
    spec = ModelSpec(
        name=_name(raw.get("name")) or (Path(weights).name if Path(weights).is_dir() else Path(weights).stem),
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        target=raw.get("target", "cuda:sm_90"),
        lanes=raw.get("lanes", default_lanes),
        gpus=raw.get("gpus", 1),
        dtp_delay=raw.get("dtp_delay"),
        max_seq_len=raw.get("max_seq_len", min(4096, config.max_positions)),
        dtype=raw.get("dtype", "bf16"),
        source=origin,
    )
    # a laneformer's lane count is its checkpoint's unless model.json sets it: errors name where it came from
    _check_spec(spec, "lanes" if "lanes" in raw or config.arch != "laneformer" else "config.num_lanes")
    return spec


def _name(name) -> str | None:
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise KiecError("name", name, SPEC_KEYS["name"] + " (a non-empty string)")
    return name


def _check_spec(spec: ModelSpec, lanes_field: str = "lanes") -> None:
    from .targets import TARGETS
    cfg = spec.config
    if not isinstance(spec.target, str) or spec.target not in TARGETS:
        raise KiecError("target", spec.target, SPEC_KEYS["target"], nearest(str(spec.target), TARGETS))
    if not isinstance(spec.dtype, str) or spec.dtype not in DTYPES:
        raise KiecError("dtype", spec.dtype, SPEC_KEYS["dtype"], nearest(str(spec.dtype), DTYPES))
    _positive_int("lanes", spec.lanes)
    _positive_int("gpus", spec.gpus)
    if spec.gpus not in (1, spec.lanes):
        raise KiecError("gpus", spec.gpus, f"1 or the lane count ({spec.lanes})")
    if cfg.arch == "laneformer" and spec.lanes != cfg.lanes:
        raise KiecError("lanes", spec.lanes, f"the checkpoint's num_lanes ({cfg.lanes}): a laneformer's lanes are fixed by training")
    if spec.lanes > 1:
        for what, count in (("num_attention_heads", cfg.heads), ("num_key_value_heads", cfg.kv_heads),
                            ("intermediate_size", cfg.ffn)):
            if count % spec.lanes:
                raise KiecError(lanes_field, spec.lanes, f"a divisor of {what} ({count})",
                                "each lane owns an equal share")
        if cfg.lm_head_type == "vocab_parallel" and cfg.vocab % spec.lanes:
            raise KiecError(lanes_field, spec.lanes, f"a divisor of vocab_size ({cfg.vocab}) for a vocab_parallel head")
    if spec.dtp_delay is not None:
        if not is_int(spec.dtp_delay) or spec.dtp_delay < 1:
            raise KiecError("dtp_delay", spec.dtp_delay, SPEC_KEYS["dtp_delay"])
        if cfg.arch == "laneformer" and spec.dtp_delay != cfg.broadcast_delay:
            raise KiecError("dtp_delay", spec.dtp_delay, f"unset for a laneformer (or its broadcast_delay, "
                            f"{cfg.broadcast_delay}): it runs the reduce modes it was trained with")
        if spec.dtp_delay >= cfg.layers:
            raise KiecError("dtp_delay", spec.dtp_delay, f"a delay smaller than the layer count ({cfg.layers})")
    _positive_int("max_seq_len", spec.max_seq_len)
    if spec.max_seq_len > cfg.max_positions:
        raise KiecError("max_seq_len", spec.max_seq_len,
                        f"at most the model's max_position_embeddings ({cfg.max_positions})")


def _positive_int(name: str, value) -> None:
    if not is_int(value) or value <= 0:
        raise KiecError(name, value, "a positive integer")


def _existing_path(name: str, value, base: Path) -> str:
    if not isinstance(value, str) or not value:
        raise KiecError(name, value, "a path (a non-empty string)")
    path = (base / Path(value).expanduser()).resolve()
    if not path.exists():
        raise KiecError(name, str(path), "an existing file or folder", "no such file")
    if path.is_file() and not os.access(path, os.R_OK):
        raise KiecError(name, str(path), "a readable file", "permission denied")
    return str(path)


def _find_config(raw: dict, weights: str, base: Path) -> tuple[dict, str]:
    """The Hugging Face-style config and the default tokenizer source."""
    wpath = Path(weights)
    default_tok = weights if wpath.is_dir() or is_gguf(wpath) else str(wpath.parent)
    if "config" in raw:
        cfg = raw["config"]
        if isinstance(cfg, str):
            cfg = read_json_object("config", _existing_path("config", cfg, base))
        if not isinstance(cfg, dict):
            raise KiecError("config", cfg, SPEC_KEYS["config"])
        return cfg, default_tok
    if is_gguf(wpath):
        from .gguf_meta import gguf_config
        return gguf_config(weights), default_tok
    folder = wpath if wpath.is_dir() else wpath.parent
    if (folder / "config.json").exists():
        return read_json_object("config", str(folder / "config.json")), default_tok
    ggufs = sorted(p for p in folder.iterdir() if is_gguf(p))
    raise KiecError("config", None, SPEC_KEYS["config"],
                    f"not given, and no config.json beside the weights in {folder}"
                    + (f"; for the GGUF there, name the file itself: {ggufs[0]}" if ggufs else ""))


def read_json_object(name: str, path: str) -> dict:
    """A JSON file whose top level is an object; a KiecError naming `name` and the file otherwise."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except json.JSONDecodeError as err:
        raise KiecError(name, path, "valid JSON", f"line {err.lineno}: {err.msg}") from None
    except UnicodeDecodeError as err:      # a ValueError, not a JSONDecodeError
        raise KiecError(name, path, "a UTF-8 JSON file", str(err)) from None
    except OSError as err:
        raise KiecError(name, path, "a readable file", str(err)) from None
    if not isinstance(data, dict):
        raise KiecError(name, path, "a JSON object at the top of the file", f"found a {type(data).__name__}")
    return data


# ---------------------------------------------------------------------------
# Hugging Face-style configs -> ArchConfig

# what rope_inv_freq reads for each RoPE type; all required, as Hugging Face requires them
ROPE_FIELDS = {"default": (), "linear": ("factor",),
               "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
               # not Hugging Face's: one factor per RoPE pair, dividing its inverse frequency, as llama.cpp
               # applies a GGUF's rope_freqs tensor (llama3 scaling, computed by its converter)
               "freq_factors": ("factors",)}


def arch_config(arch: str, hf: dict) -> ArchConfig:
    get = _Getter(hf)
    hidden = get.int("hidden_size")
    heads = get.int("num_attention_heads")
    kv_heads = get.int("num_key_value_heads", heads)
    layers = get.int("num_hidden_layers")
    explicit_head_dim = arch != "laneformer" and hf.get("head_dim") is not None
    if hidden % heads and not explicit_head_dim:     # with head_dim given, q need not be hidden wide (as transformers)
        raise KiecError("config.hidden_size", hidden, f"a multiple of num_attention_heads ({heads}), or a head_dim")
    head_dim = get.int("head_dim") if explicit_head_dim else hidden // heads
    if heads % kv_heads:
        raise KiecError("config.num_key_value_heads", kv_heads, f"a divisor of num_attention_heads ({heads})")
    if head_dim % 2:
        raise KiecError("config.head_dim", head_dim, "an even number (RoPE rotates pairs)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise KiecError("config.hidden_act", act, "'silu' (the SwiGLU MLP)")
    if hf.get("mlp_bias"):
        raise KiecError("config.mlp_bias", True, "false: MLP biases are not supported")
    if arch == "llama" and hf.get("attention_bias"):
        raise KiecError("config.attention_bias", True, "false for llama (qwen2 has QKV biases)")
    common = dict(
        arch=arch, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        ffn=get.int("intermediate_size"), vocab=get.int("vocab_size"),
        max_positions=get.int("max_position_embeddings", 4096),
    )
    if arch == "laneformer":
        return _laneformer(common, hf, get)
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise KiecError(f"config.{key}", hf[key], "an object or null")
    rope = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = (_positive_number("config.rope_parameters.rope_theta", rope["rope_theta"]) if "rope_theta" in rope
             else get.float("rope_theta", 10000.0))
    kind = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    params = rope if rope.get("rope_type") else scaling
    where = "config.rope_parameters" if rope.get("rope_type") else "config.rope_scaling"
    if kind not in ROPE_FIELDS:
        raise KiecError(where, kind, "'default', 'linear', 'llama3' or 'freq_factors'")
    for key in ROPE_FIELDS[kind]:
        if key not in params:
            raise KiecError(f"{where}.{key}", None, "a list of positive numbers" if key == "factors"
                            else "a positive finite number", f"the key is missing; {kind} RoPE needs it")
        if key == "factors":
            params = dict(params, factors=_freq_factors(f"{where}.factors", params[key], head_dim // 2))
        else:
            _positive_number(f"{where}.{key}", params[key])
    if kind == "llama3" and params["high_freq_factor"] <= params["low_freq_factor"]:
        raise KiecError(f"{where}.high_freq_factor", params["high_freq_factor"],
                        f"more than low_freq_factor ({params['low_freq_factor']})",
                        "the smoothing divides by the difference")
    rope_scaling = () if kind == "default" else tuple(sorted(
        [(k, params[k]) for k in ROPE_FIELDS[kind]] + [("rope_type", kind)]))
    window, window_layers = _sliding(arch, hf, layers)
    return ArchConfig(**common, rope_theta=theta, rope_pairs="half", rope_scaling=rope_scaling,
                      norm_eps=get.float("rms_norm_eps", 1e-6),
                      tie_embeddings=get.flag("tie_word_embeddings", False),
                      qkv_bias=arch == "qwen2", sliding_window=window, window_layers=window_layers)


def _sliding(arch: str, hf: dict, layers: int) -> tuple[int, tuple]:
    # a missing key is transformers' default (mistral's and qwen2's 4096, qwen2's max_window_layers 28);
    # null is no window
    window = hf.get("sliding_window", 4096) or 0
    types = hf.get("layer_types")
    if arch == "llama" or not window:
        return 0, ()
    if arch == "qwen2" and not hf.get("use_sliding_window", False):    # transformers: no window at all then
        return 0, ()
    if isinstance(types, list) and len(types) == layers:
        flags = tuple(t == "sliding_attention" for t in types)
    elif arch == "qwen2":
        start = hf.get("max_window_layers", 28)
        if not is_int(start) or start < 0:
            raise KiecError("config.max_window_layers", start, "a layer count (an integer, 0 or more)")
        flags = tuple(i >= start for i in range(layers))
    else:
        flags = (True,) * layers
    if not any(flags):
        return 0, ()
    if not is_int(window) or window <= 0:
        raise KiecError("config.sliding_window", window, "a positive integer or null")
    return window, flags


def _laneformer(common: dict, hf: dict, get: "_Getter") -> ArchConfig:
    layers = common["layers"]
    lanes = get.int("num_lanes", 1)
    delay = get.int("broadcast_delay", 1)
    lm_head_type = hf.get("lm_head_type", "replicate")
    if lm_head_type not in LM_HEAD_TYPES:
        raise KiecError("config.lm_head_type", lm_head_type, " or ".join(LM_HEAD_TYPES),
                        nearest(str(lm_head_type), LM_HEAD_TYPES))
    window = hf.get("sliding_window") or 0
    if not is_int(window) or window < 0:
        raise KiecError("config.sliding_window", window, "a positive integer or null")
    count = hf.get("sliding_window_n_layers") or 0
    if not is_int(count):     # negative: the last -n layers
        raise KiecError("config.sliding_window_n_layers", count,
                        "an integer (the first n layers; -n: the last n) or null")
    unclamped = hf.get("unclamped_layers") or []
    if not isinstance(unclamped, list) or not all(
            is_int(i) and 0 <= i < layers for i in unclamped):
        raise KiecError("config.unclamped_layers", unclamped, f"a list of layer indices (0 to {layers - 1}) or null")
    unclamped = set(unclamped)
    flags = tuple(bool(window) and (i < count or i >= layers + count) and i not in unclamped
                  for i in range(layers))
    if not any(flags):
        window, flags = 0, ()
    tied, pre_norm = get.flag("tie_word_embeddings", False), get.flag("pre_norm_lane_agg", False)
    if tied and lm_head_type != "replicate" and not pre_norm:
        raise KiecError("config.tie_word_embeddings", True, f"false with lm_head_type {lm_head_type!r}: a tied head "
                        "is the embedding read whole, as a replicate head (or under pre_norm_lane_agg)")
    return ArchConfig(**common, rope_theta=get.float("rope_theta", 10000.0), rope_pairs="adjacent",
                      norm_eps=get.float("norm_eps", 1e-5), tie_embeddings=tied,
                      sliding_window=int(window), window_layers=flags, lanes=lanes, broadcast_delay=delay,
                      use_comm=get.flag("use_comm", True), use_early_comm=get.flag("use_early_comm", True),
                      lm_head_type=lm_head_type, pre_norm_lane_agg=pre_norm,
                      replicated_norm=get.flag("replicated_rmsn_scale", True))


class _Getter:
    def __init__(self, hf: dict):
        self.hf = hf

    def int(self, key: str, default=None) -> int:
        value = self.hf.get(key)
        value = default if value is None else value        # null is the default, as transformers reads it
        if value is None:
            raise KiecError(f"config.{key}", None, "a positive integer", "the key is missing")
        if not is_int(value) or value <= 0:
            raise KiecError(f"config.{key}", value, "a positive integer")
        return value

    def flag(self, key: str, default: bool) -> bool:
        """true or false; null or absent is the default (LANEFORMER.md's), not false."""
        value = self.hf.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise KiecError(f"config.{key}", value, "true, false or null")
        return value

    def float(self, key: str, default: float) -> float:
        return _positive_number(f"config.{key}", self.hf.get(key, default))


def _freq_factors(name: str, value, pairs: int) -> tuple:
    """One positive finite factor per RoPE pair, as a tuple (ArchConfig is frozen and hashed)."""
    if not isinstance(value, (list, tuple)) or len(value) != pairs:
        raise KiecError(name, value, f"a list of {pairs} positive numbers, one per RoPE pair (head_dim / 2)")
    return tuple(_positive_number(f"{name}[{i}]", factor) for i, factor in enumerate(value))


def _positive_number(name: str, value) -> float:
    # a zero, negative, NaN or infinite eps/theta/factor gives NaN logits later, not an error
    if not is_number(value) or not math.isfinite(value) or value <= 0:
        raise KiecError(name, value, "a positive finite number")
    return float(value)


def rope_inv_freq(cfg: ArchConfig):
    """Per-pair inverse frequencies [head_dim/2], with llama3/linear/freq_factors scaling applied (float64)."""
    import numpy as np
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    scaling = dict(cfg.rope_scaling)
    kind = scaling.get("rope_type")
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old / low, old / high
        smooth = (old / wavelen - low) / (high - low)
        scaled = np.where(wavelen > low_wl, inv / factor, inv)
        mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        inv = np.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    elif kind == "freq_factors":
        inv = inv / np.asarray(scaling["factors"], np.float64)
    return inv
