"""The torch peers: one batch-1 decode step of a standard model in plain PyTorch, on kiec's own weights.

`TorchDecoder` reads every weight of kiec's graph (`build_graph` + `materialize`) and the
per-layer facts (norm eps, sliding window) from the graph's ops, and computes what kiec's
reference interpreter computes, op for op (kiec/reference/interpreter.py). Its KV cache is
static, [layers, kv_heads, max_seq, head_dim], and the position is a device tensor, so one
step (embedding, every layer, final norm, LM head, argmax) has fixed shapes and no host
reads: `GraphedStep` captures it in ONE CUDA graph whose replay also feeds the selected
token back and advances the position on the device — token after token, no host in the loop.

The peers the benchmark times are (a) the plain step captured, and (b) the same step through
`compile_step` (torch.compile, max-autotune without cudagraphs of its own) captured the same
way. QKV and gate/up are concatenated into one matrix each at load, as a tuned torch decoder
(gpt-fast) does: a peer should be as strong as plain torch gets, not a strawman.
Runs on CPU in float32 too (the tests check it against the reference there).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import KiecError, is_int
from ..model import ModelSpec, rope_inv_freq
from ..pipeline import build_graph

STANDARD = ("llama", "qwen2", "mistral")
COMPILE_MODE = "max-autotune-no-cudagraphs"    # the one CUDA graph is ours, around the whole step


class _Loader:
    """Graph weights as torch tensors on the device; a weight tied to another (lm_head -> embed) is shared."""

    def __init__(self, graph, checkpoint, device, dtype):
        from ..weights import materialize
        self.graph, self.checkpoint, self.device, self.dtype = graph, checkpoint, device, dtype
        self.materialize = materialize
        self.seen: dict = {}

    def __call__(self, name: str) -> torch.Tensor:
        tensor = self.graph.tensors[name]
        key = (tensor.source, tensor.layout)
        if key not in self.seen:
            array = self.materialize(self.checkpoint, tensor, None)     # None: the stored dtype, no fp32 copy
            if tensor.layout == "lane1":                                 # [1, rows, ...]: the one lane
                array = array[0]
            self.seen[key] = _to_torch(array, self.device, self.dtype)
        return self.seen[key]


def _to_torch(array: np.ndarray, device, dtype) -> torch.Tensor:
    if array.dtype.name == "bfloat16":               # ml_dtypes bf16: the same bits as torch's
        host = torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    else:
        host = torch.from_numpy(np.array(array))     # a copy: memory-mapped arrays are read-only
    return host.to(device=device, dtype=dtype)


def _check_standard(graph, spec: ModelSpec) -> None:
    if graph.arch not in STANDARD or graph.lanes != 1:
        raise KiecError("architecture", f"{graph.arch} with {graph.lanes} lane(s)",
                        f"one of {', '.join(STANDARD)} on one lane (the torch peers run standard models)")
    for op in graph.ops:
        if op.kind == "RoPE" and op.attr("pairs") != "half":
            raise KiecError("config.rope_pairs", op.attr("pairs"), "'half' (Hugging Face rotate_half)")
        if op.kind == "LMHead" and op.attr("head") != "replicate":
            raise KiecError("lm_head_type", op.attr("head"), "'replicate' for a standard model")


class DecoderLayer(torch.nn.Module):
    """One layer's weights and facts, read from the graph's ops of that layer."""

    def __init__(self, graph, layer: int, load: _Loader):
        super().__init__()
        ops = graph.layer_ops(layer)
        norms = [op for op in ops if op.kind == "RMSNorm"]          # attention's pre-norm, then the MLP's
        linear = {graph.tensors[op.inputs[1]].role: op.inputs for op in ops if op.kind == "Linear"}
        attention = next(op for op in ops if op.kind == "Attention")
        self.eps = (norms[0].attr("eps"), norms[1].attr("eps"))
        self.window = attention.attr("window")                     # 0: causal over the whole cache
        self.heads, self.kv_heads = attention.attr("heads"), attention.attr("kv_heads")
        self.head_dim = attention.attr("head_dim")
        self.q_dim, self.kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
        buf = lambda name, t: self.register_buffer(name, t, persistent=False)   # noqa: E731
        buf("attn_norm", load(norms[0].inputs[1]))
        buf("ffn_norm", load(norms[1].inputs[1]))
        buf("wqkv", torch.cat([load(linear[r][1]) for r in ("wq", "wk", "wv")]))          # [q + 2 kv, D]
        biased = len(linear["wq"]) == 3                                                  # qwen2
        buf("bqkv", torch.cat([load(linear[r][2]) for r in ("wq", "wk", "wv")]) if biased else None)
        buf("wo", load(linear["wo"][1]))                                                 # [D, q]
        buf("w_gate_up", torch.cat([load(linear["w_gate"][1]), load(linear["w_up"][1])]))  # [2F, D]
        buf("w_down", load(linear["w_down"][1]))                                         # [D, F]


class TorchDecoder(torch.nn.Module):
    """One decode step of a llama / qwen2 / mistral graph: forward(token, pos) -> (logits [V] fp32, next [1])."""

    def __init__(self, spec: ModelSpec, checkpoint, max_seq: int, device="cpu", dtype=torch.float32):
        super().__init__()
        graph = build_graph(spec)
        _check_standard(graph, spec)
        cfg = spec.config
        load = _Loader(graph, checkpoint, device, dtype)
        out = {op.kind: op for op in graph.ops if op.layer is None}    # Embed, final RMSNorm, LMHead, Select
        self.register_buffer("embed", load(out["Embed"].inputs[0]), persistent=False)      # [V, D]
        self.layers = torch.nn.ModuleList(DecoderLayer(graph, i, load) for i in range(cfg.layers))
        self.final_eps = out["RMSNorm"].attr("eps")
        self.register_buffer("final_norm", load(out["RMSNorm"].inputs[1]), persistent=False)
        self.register_buffer("lm_head", load(out["LMHead"].inputs[1]), persistent=False)   # [V, D]
        self.vocab = cfg.vocab
        inv_freq = torch.from_numpy(rope_inv_freq(cfg))     # float64, as the reference: angles stay exact at 8k+
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.cache_shape = (cfg.layers, cfg.kv_heads, 0, cfg.head_dim)
        self.device, self.dtype = torch.device(device), dtype
        self.group = None          # a torch.distributed group once kiec.baselines.torch_tp shards this decoder
        self.resize_cache(max_seq)

    def resize_cache(self, max_seq: int) -> None:
        """A fresh zeroed cache of `max_seq` positions. Attention reads all of them (masked) every step,
        so the benchmark sizes the cache to the context it measures. Graphs captured before are stale."""
        if not is_int(max_seq) or max_seq <= 0:
            raise KiecError("max_seq", max_seq, "a positive integer (cache positions)")
        layers, kv_heads, _, head_dim = self.cache_shape
        shape = (layers, kv_heads, max_seq, head_dim)
        self.max_seq = max_seq
        for name in ("k_cache", "v_cache"):
            self.register_buffer(name, None, persistent=False)         # free the old cache before the new one
            self.register_buffer(name, torch.zeros(shape, dtype=self.dtype, device=self.device), persistent=False)
        self.register_buffer("key_positions", torch.arange(max_seq, device=self.device), persistent=False)

    def forward(self, token: torch.Tensor, pos: torch.Tensor):
        """token, pos: [1] int64 on the device. Writes this position's K/V; returns fp32 logits [V] and argmax [1]."""
        h = F.embedding(token, self.embed)                                  # [1, D]
        angle = pos.to(torch.float64)[:, None] * self.inv_freq[None, :]     # [1, hd/2]
        cos, sin = angle.cos().float(), angle.sin().float()
        for i, layer in enumerate(self.layers):
            h = h + self._reduce(self._attention(i, layer, _rms_norm(h, layer.attn_norm, layer.eps[0]), cos, sin, pos))
            x = _rms_norm(h, layer.ffn_norm, layer.eps[1])
            gate, up = F.linear(x, layer.w_gate_up).chunk(2, dim=-1)
            h = h + self._reduce(F.linear(F.silu(gate) * up, layer.w_down))
        x = _rms_norm(h, self.final_norm, self.final_eps)
        logits = self._gather(F.linear(x, self.lm_head).float()[0])       # [V]
        return logits, logits.argmax(dim=-1, keepdim=True)

    # Sharded (torch_tp): each rank holds a slice of every projection, so the partial outputs of o and
    # down are summed across ranks and the vocabulary slices of the logits gathered. Unsharded: nothing.
    def _reduce(self, partial):
        if self.group is not None:
            torch.distributed.all_reduce(partial, group=self.group)
        return partial

    def _gather(self, logits):
        if self.group is None:
            return logits
        parts = [torch.empty_like(logits) for _ in range(torch.distributed.get_world_size(self.group))]
        torch.distributed.all_gather(parts, logits, group=self.group)
        return torch.cat(parts)[: self.vocab]

    def _attention(self, i: int, layer: DecoderLayer, x, cos, sin, pos):
        qkv = F.linear(x, layer.wqkv, layer.bqkv)[0]                       # [q + 2 kv]
        q, k, v = qkv.split([layer.q_dim, layer.kv_dim, layer.kv_dim])
        q = _rope(q.view(layer.heads, layer.head_dim), cos, sin)
        k = _rope(k.view(layer.kv_heads, layer.head_dim), cos, sin)
        self.k_cache[i].index_copy_(1, pos, k[:, None, :])                 # cache [kv, S, hd] at pos
        self.v_cache[i].index_copy_(1, pos, v.view(layer.kv_heads, 1, layer.head_dim))
        visible = self.key_positions <= pos                                # [S]: causal
        if layer.window:
            visible = visible & (self.key_positions > pos - layer.window)
        group = layer.heads // layer.kv_heads                              # query head h reads kv head h // group
        q = q.view(layer.kv_heads, group, layer.head_dim)
        scores = torch.matmul(q, self.k_cache[i].transpose(1, 2)).float() / math.sqrt(layer.head_dim)  # [kv, g, S]
        p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).to(q.dtype)
        out = torch.matmul(p, self.v_cache[i])                             # [kv, g, hd]
        return F.linear(out.reshape(1, layer.q_dim), layer.wo)


def _rms_norm(x, w, eps: float):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x, cos, sin):
    """rotate_half RoPE in fp32: x [..., heads, hd], cos/sin broadcasting against [..., heads, hd/2]."""
    x32 = x.float()
    half = x.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def compile_step(decoder: TorchDecoder):
    """The same step through torch.compile; fullgraph, so a graph break is an error, not a slower peer."""
    return torch.compile(decoder, mode=COMPILE_MODE, fullgraph=True, dynamic=False)


class GraphedStep:
    """`step` (a TorchDecoder or its compiled form) captured in one CUDA graph.

    Each `replay()` decodes one token at `self.pos` from `self.token`, leaves the logits in
    `self.logits`, writes the argmax into `self.token` and advances `self.pos`: the next replay
    continues the sequence with no host work. `feed(token, pos)` sets both from the host.
    """

    def __init__(self, step, decoder: TorchDecoder, warmup: int = 3):
        if decoder.device.type != "cuda":
            raise KiecError("device", str(decoder.device), "a CUDA device (CUDA graphs)")
        self.step, self.max_seq = step, decoder.max_seq
        self.token = torch.zeros(1, dtype=torch.long, device=decoder.device)
        self.pos = torch.zeros(1, dtype=torch.long, device=decoder.device)
        with torch.no_grad():
            self._body()                   # compiles (autotunes) a compiled step outside any capture
            torch.cuda.synchronize()
            side = torch.cuda.Stream()     # warm-up on a side stream, as torch.cuda.graph wants
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    self.feed(0, 0)
                    self._body()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._body()
        self.feed(0, 0)

    def _body(self) -> None:
        self.logits, chosen = self.step(self.token, self.pos)
        self.token.copy_(chosen)
        self.pos.add_(1)

    def feed(self, token: int, pos: int) -> None:
        if not 0 <= pos < self.max_seq:
            raise KiecError("position", pos, f"a position in [0, {self.max_seq}) (the static cache)")
        self.token.fill_(int(token))
        self.pos.fill_(int(pos))

    def replay(self) -> None:
        self.graph.replay()


def time_replays(graphed: GraphedStep, token: int, start: int, steps: int, warmup: int = 8) -> dict:
    """ms/token of `steps` consecutive replays from `start`: CUDA events between replays, median.

    The token is fed back on the device and the position advances, so every replay reads a
    different KV row and embedding row; the weights are read in full each step."""
    if start + steps > graphed.max_seq:
        raise KiecError("steps", steps, f"at most {graphed.max_seq - start} from position {start} (the cache)")
    graphed.feed(token, start)
    for _ in range(min(warmup, steps)):
        graphed.replay()
    graphed.feed(token, start)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    marks[0].record()
    for mark in marks[1:]:
        graphed.replay()
        mark.record()
    torch.cuda.synchronize()
    ms = np.array([a.elapsed_time(b) for a, b in zip(marks, marks[1:])])
    return {"ms_per_token": float(np.median(ms)), "ms_mean": float(ms.mean()), "replays": steps}
