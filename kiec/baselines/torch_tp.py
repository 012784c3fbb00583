"""The NCCL baseline for lanes: the torch decode step (torch_decode.TorchDecoder) sharded Megatron-style
over L processes, one GPU each, with an NCCL all-reduce between the per-layer kernels.

Rank r of L holds query heads [r H/L, (r+1) H/L) with their KV heads (and that slice of the KV cache),
the matching columns of o, FFN columns [r F/L, (r+1) F/L) of gate/up with the matching columns of
down, and vocabulary rows [r V/L, (r+1) V/L) of the LM head (padded to equal slices). Per layer it
all-reduces the [D] partials of o and of down (`torch.distributed.all_reduce`, exact TP: every rank
waits for every other before the residual add), and all-gathers the logits' slices once per token.
The whole step, collectives included, is captured in one CUDA graph (torch_decode.GraphedStep), so
this is what kiec's lanes are up against: the same sharding, communication between kernels.

`run_ranks` starts the L processes (spawned, so CUDA starts fresh in each), sets up the group
(NCCL on GPUs, gloo on CPU for the tests) and returns rank 0's result. NCCL refuses two ranks on
one GPU, so on a machine of G GPUs the baseline runs for L <= G only.
"""
from __future__ import annotations

import multiprocessing
import os
import queue as queues
import socket
import time
import traceback

import numpy as np
import torch

from ..errors import KiecError
from .torch_decode import GraphedStep, TorchDecoder, time_replays


def shard_decoder(decoder: TorchDecoder, rank: int, world: int, group=None) -> TorchDecoder:
    """`decoder` (full weights, any device) cut down in place to rank `rank`'s slices of `world`."""
    layer0 = decoder.layers[0]
    for field, count in (("num_key_value_heads", layer0.kv_heads), ("intermediate_size", layer0.w_down.shape[1])):
        if count % world:
            raise KiecError(field, count, f"a multiple of the tensor-parallel ranks ({world})")
    rows = lambda t, n: t.view(world, n // world, *t.shape[1:])[rank]          # noqa: E731  [n, ...] -> slice r
    cols = lambda t: t.view(t.shape[0], world, t.shape[1] // world)[:, rank]   # noqa: E731  [m, n] -> [:, slice r]
    for layer in decoder.layers:
        q, kv, f = layer.q_dim, layer.kv_dim, layer.w_down.shape[1]
        wq, wk, wv = layer.wqkv.split([q, kv, kv])
        layer.wqkv = torch.cat([rows(wq, q), rows(wk, kv), rows(wv, kv)]).contiguous()
        if layer.bqkv is not None:
            bq, bk, bv = layer.bqkv.split([q, kv, kv])
            layer.bqkv = torch.cat([rows(bq, q), rows(bk, kv), rows(bv, kv)]).contiguous()
        layer.wo = cols(layer.wo).contiguous()
        gate, up = layer.w_gate_up.split([f, f])
        layer.w_gate_up = torch.cat([rows(gate, f), rows(up, f)]).contiguous()
        layer.w_down = cols(layer.w_down).contiguous()
        layer.heads, layer.kv_heads = layer.heads // world, layer.kv_heads // world
        layer.q_dim, layer.kv_dim = q // world, kv // world
    vocab, dim = decoder.lm_head.shape
    padded = -(-vocab // world) * world
    head = torch.zeros(padded, dim, dtype=decoder.lm_head.dtype, device=decoder.lm_head.device)
    head[:vocab] = decoder.lm_head
    decoder.lm_head = rows(head, padded).contiguous()      # a tied embedding keeps its own full copy
    layers, kv_heads, _, head_dim = decoder.cache_shape
    decoder.cache_shape = (layers, kv_heads // world, 0, head_dim)
    decoder.group = group if group is not None else torch.distributed.group.WORLD
    decoder.resize_cache(decoder.max_seq)
    return decoder


def sharded_decoder(spec, checkpoint, max_seq: int, rank: int, world: int, device, dtype) -> TorchDecoder:
    """Rank `rank`'s decoder: the full one built on the CPU, sharded, then moved to `device`."""
    decoder = shard_decoder(TorchDecoder(spec, checkpoint, max_seq, "cpu", dtype), rank, world)
    decoder.to(device)                                     # the cache and positions move with the weights
    decoder.device = torch.device(device)
    return decoder


# --- the process group ----------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank: int, world: int, port: int, backend: str, results, args) -> None:
    # The outcome goes to the parent before the group is torn down: a teardown can block while
    # other ranks sit in a collective, and the parent would then never hear why.
    try:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")      # NVLink multicast stays off (the machine's rule)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                             world_size=world, device_id=torch.device("cuda", rank)
                                             if backend == "nccl" else None)
        value = fn(rank, world, *args)
        results.put((rank, None, value if rank == 0 else None))
    except BaseException:                                   # noqa: BLE001 - reported to the parent
        results.put((rank, traceback.format_exc(), None))
        return                                              # the parent kills what is left
    torch.distributed.destroy_process_group()


def _first_cause(rank: int, world: int, error: str, procs, results, heard: set) -> str:
    """What to report when `rank` failed. A rank that exits without an answer makes the others fail
    on their connections (its socket closes first), so such a rank, seen within a second, is named
    first; ranks that answered or failed themselves are not."""
    heard = heard | {rank}
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            heard.add(results.get(timeout=0.1)[0])
        except queues.Empty:
            pass
        silent = [(r, p.exitcode) for r, p in enumerate(procs) if r not in heard and p.exitcode is not None]
        if silent:
            r, code = silent[0]
            return f"rank {r} of {world} exited with code {code} without an answer; then rank {rank} failed:\n{error}"
    return f"rank {rank} of {world} failed:\n{error}"


def run_ranks(fn, world: int, *args, backend: str = "nccl", timeout_s: float = 900.0):
    """fn(rank, world, *args) in `world` spawned processes of one group; rank 0's return value.
    A rank that fails, dies or exits without an answer fails the call, naming the rank and its
    traceback or exit code."""
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise KiecError("ranks", world, f"at most the GPUs of this machine ({torch.cuda.device_count()}): NCCL "
                        "takes one GPU per rank")
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, backend, results, args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got, waited = {}, 0.0
    try:
        while len(got) < world:
            try:
                rank, error, value = results.get(timeout=1.0)
            except queues.Empty:
                waited += 1.0
                silent = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode is not None and r not in got]
                if not silent:
                    if waited > timeout_s:
                        raise RuntimeError(f"the {world} ranks did not finish in {timeout_s:.0f} s") from None
                    continue
                try:                      # its answer may still be in the queue's pipe: one more look
                    rank, error, value = results.get(timeout=2.0)
                except queues.Empty:
                    rank, code = silent[0]
                    raise RuntimeError(f"rank {rank} of {world} exited with code {code} without an answer") from None
            if error:
                raise RuntimeError(_first_cause(rank, world, error, procs, results, set(got)))
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10 if len(got) == world else 0)
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()
    return got[0]


# --- what the ranks run ---------------------------------------------------------------------------

def teacher_forced(rank: int, world: int, spec, tokens, dtype=torch.float32) -> np.ndarray:
    """Logits [T, V] of the sharded decoder fed `tokens` one at a time from position 0 (eager; CPU
    under gloo, the rank's GPU under NCCL)."""
    from ..weights import load_checkpoint
    device = f"cuda:{rank}" if torch.distributed.get_backend() == "nccl" else "cpu"
    decoder = sharded_decoder(spec, load_checkpoint(spec), len(tokens), rank, world, device, dtype)
    out = []
    with torch.no_grad():
        for pos, token in enumerate(tokens):
            logits, _ = decoder(torch.tensor([token], device=device), torch.tensor([pos], device=device))
            out.append(logits.cpu().numpy())
    return np.stack(out)


def timed_decode(rank: int, world: int, model, contexts, steps: int) -> dict:
    """ms/token of the sharded step in one CUDA graph at each context (rank 0's CUDA events).
    `model` is a kiec.bench.BenchModel: every rank makes the same weights itself."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[model.spec.dtype]
    device = f"cuda:{rank}"
    decoder = sharded_decoder(model.spec, model.checkpoint(), max(contexts) + steps, rank, world, device, dtype)
    out = {}
    for context in contexts:
        decoder.resize_cache(context + steps)
        graphed = GraphedStep(decoder, decoder)
        out[context] = time_replays(graphed, 1, context, steps)
        del graphed
    return out
