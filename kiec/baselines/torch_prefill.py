"""The torch peer of prefill: a whole prompt as one batched forward of plain PyTorch on kiec's weights.

`prefill(decoder, tokens)` takes a `TorchDecoder` (same weights, same cache) and runs tokens at
positions 0..T-1 through every layer at once: cuBLAS GEMMs for the projections and
`scaled_dot_product_attention` (flash attention where torch has it) for causal attention, as a
user of plain torch would write it. It fills the decoder's cache, so its decode steps continue the
prompt, and returns the last position's logits. Runs on CPU in float32 too (tested there).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .torch_decode import TorchDecoder, _rms_norm, _rope


def prefill(decoder: TorchDecoder, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [T] int64 on the decoder's device -> logits [V] fp32 of position T - 1."""
    n = tokens.shape[0]
    pos = torch.arange(n, device=tokens.device)
    angle = pos.to(torch.float64)[:, None] * decoder.inv_freq[None, :]
    cos, sin = angle.cos().float()[:, None, :], angle.sin().float()[:, None, :]     # [T, 1, hd/2]
    h = F.embedding(tokens, decoder.embed)                                          # [T, D]
    for i, layer in enumerate(decoder.layers):
        x = _rms_norm(h, layer.attn_norm, layer.eps[0])
        q, k, v = F.linear(x, layer.wqkv, layer.bqkv).split([layer.q_dim, layer.kv_dim, layer.kv_dim], dim=-1)
        q = _rope(q.view(n, layer.heads, layer.head_dim), cos, sin).transpose(0, 1)      # [heads, T, hd]
        k = _rope(k.view(n, layer.kv_heads, layer.head_dim), cos, sin).transpose(0, 1)   # [kv, T, hd]
        v = v.view(n, layer.kv_heads, layer.head_dim).transpose(0, 1)
        decoder.k_cache[i, :, :n] = k
        decoder.v_cache[i, :, :n] = v
        mask = None
        if layer.window:
            rows, cols = pos[:, None], pos[None, :]
            mask = (cols <= rows) & (cols > rows - layer.window)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=True)[0]                      # [heads, T, hd]
        h = h + F.linear(out.transpose(0, 1).reshape(n, layer.q_dim), layer.wo)
        x = _rms_norm(h, layer.ffn_norm, layer.eps[1])
        gate, up = F.linear(x, layer.w_gate_up).chunk(2, dim=-1)
        h = h + F.linear(F.silu(gate) * up, layer.w_down)
    x = _rms_norm(h[-1:], decoder.final_norm, decoder.final_eps)
    return F.linear(x, decoder.lm_head).float()[0]
