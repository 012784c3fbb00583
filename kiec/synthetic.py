"""Random-weight models at real shapes (benchmarks, GPU golden tests) and tiny ones (CPU tests).

`write_random_model(folder, preset_or_config)` writes a Hugging Face-style folder
(config.json + model.safetensors, or the laneformer checkpoint format) that every
reader of kiec — and transformers, for the standard families — loads like a real one.
Weights are drawn N(0, std) per tensor from a seed, norms near 1, so activations stay
in range through the layers.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from .model import arch_config
from .weights import expected_tensors

PRESETS = {
    # the shapes the issues' targets name
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, use_sliding_window=False, sliding_window=32768,
                         max_window_layers=21),
    "laneformer-2b": dict(model_type="laneformer_tp", hidden_size=3072, num_hidden_layers=15, num_attention_heads=32,
                          num_key_value_heads=16, intermediate_size=12288, vocab_size=65536,
                          max_position_embeddings=8192, rope_theta=10000.0, norm_eps=1e-5, num_lanes=8,
                          broadcast_delay=2, sliding_window=512, sliding_window_n_layers=10,
                          lm_head_type="replicate"),
    # small models for tests
    "tiny-llama": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=128, vocab_size=256, max_position_embeddings=512,
                       rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "tiny-qwen2": dict(model_type="qwen2", hidden_size=96, num_hidden_layers=2, num_attention_heads=6,
                       num_key_value_heads=2, intermediate_size=160, vocab_size=333, max_position_embeddings=1024,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False),
    "tiny-mistral": dict(model_type="mistral", hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=32, intermediate_size=256, vocab_size=300,
                         max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5,
                         sliding_window=16, tie_word_embeddings=False),
}


def preset(name: str, **changes) -> dict:
    from .errors import KiecError, nearest
    if name not in PRESETS:
        raise KiecError("preset", name, " / ".join(PRESETS), nearest(name, PRESETS))
    return dict(PRESETS[name], **changes)


def write_safetensors(path: Path, tensors: dict) -> None:
    """tensors: name -> np.ndarray (float32, float16 or ml_dtypes.bfloat16)."""
    codes = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
    header, offset = {}, 0
    for name, array in tensors.items():
        n = array.nbytes
        header[name] = {"dtype": codes[array.dtype.name], "shape": list(array.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for array in tensors.values():
            fh.write(np.ascontiguousarray(array).tobytes())


def random_tensors(config: dict, seed: int = 0, dtype: str = "bf16", std: float = 0.02) -> dict:
    """checkpoint name -> random array for every tensor the config needs.

    Uniform draws with the given standard deviation (fast at billions of weights); norms near 1.
    """
    from concurrent.futures import ThreadPoolExecutor
    arch = {"laneformer_tp": "laneformer"}.get(config["model_type"], config["model_type"])
    cfg = arch_config(arch, config)
    wanted = list(expected_tensors(cfg).items())
    seeds = np.random.SeedSequence(seed).spawn(len(wanted))   # one stream per tensor: order-free, parallel
    with ThreadPoolExecutor() as pool:
        arrays = pool.map(lambda item: _random_tensor(*item[0][1], item[0][0], item[1], dtype, std), zip(wanted, seeds))
        return {name: array for (canon, (name, shape)), array in zip(wanted, arrays)}


def _random_tensor(name: str, shape: tuple, canon: str, seed, dtype: str, std: float) -> np.ndarray:
    import ml_dtypes
    rng = np.random.default_rng(seed)
    leaf = canon.split(".")[-1]
    if leaf.endswith("norm"):
        array = 1.0 + _uniform(rng, shape, 0.1)
    elif leaf in ("bq", "bk", "bv"):
        array = _uniform(rng, shape, 0.1)
    else:
        array = _uniform(rng, shape, 1.0 if canon in ("embed", "lm_head") else std)
    if dtype == "bf16":        # truncating to bf16 is a valid draw of a slightly different distribution
        return (array.view(np.uint32) >> 16).astype(np.uint16).view(ml_dtypes.bfloat16)
    return array.astype({"fp16": np.float16, "fp32": np.float32}[dtype])


def _uniform(rng, shape, std: float) -> np.ndarray:
    half_width = np.float32(std * np.sqrt(3.0))
    out = rng.random(shape, dtype=np.float32)
    out *= 2 * half_width
    out -= half_width
    return out


def write_random_model(folder, config, seed: int = 0, dtype: str = "bf16") -> Path:
    """A model folder (config.json + model.safetensors); `config` is a preset name or a config dict."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = preset(config) if isinstance(config, str) else dict(config)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    write_safetensors(folder / "model.safetensors", random_tensors(config, seed, dtype))
    return folder


def random_checkpoint(config: dict, seed: int = 0, dtype: str = "bf16"):
    """The same random weights as write_random_model, in memory: a kiec.weights.Checkpoint."""
    from .weights import Checkpoint, WeightStore
    arch = {"laneformer_tp": "laneformer"}.get(config["model_type"], config["model_type"])
    tensors = random_tensors(config, seed, dtype)
    entries = {name: (a.shape, a.dtype.name) for name, a in tensors.items()}
    loaders = {name: (lambda a=a: a) for name, a in tensors.items()}
    return Checkpoint(WeightStore(entries, loaders, f"<random seed {seed}>"), arch_config(arch, config))
