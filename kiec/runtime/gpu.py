"""The GPU backend: the compiled monokernel behind the Backend interface.

`CompiledModel` runs the pipeline to a built .so (cached) and loads it; `GpuBackend`
uploads the packed weights once, owns the KV cache on the device (positions are the
runtime's to track), and drives launches: one step per launch (`forward`, logits back
to the host), or a whole sequence in one launch with selection and the stop check on
the GPU and tokens streamed through pinned host memory (`generate_on_device`).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np

from ..errors import Cancelled, DeviceError, KiecError, first_outside, is_int
from ..model import ModelSpec

PREFILL_KINDS = ("embed", "norm", "qkv", "rope_kv", "attention", "o", "gate_up", "down")   # kiec_prefill's order
REGION_ACTS, REGION_KV, REGION_HISTORY, REGION_TRACE, REGION_TOKENS, REGION_PROFILE = 0, 1, 2, 3, 4, 5


def check_token_ids(tokens, vocab: int, field: str = "token") -> None:
    """The kernels read an embedding row by id with no bounds check: an id past the vocabulary would
    read another tensor's bytes (a tokenizer can know more tokens than the model has rows)."""
    bad = first_outside((int(t) for t in tokens), vocab)
    if bad is not None:
        raise KiecError(field, bad, f"token ids in [0, {vocab}) (the model's vocabulary)")


def gpu_available() -> bool:
    if shutil.which("nvidia-smi") is None or shutil.which("nvcc") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def gpu_count() -> int:
    """GPUs this process may use: those nvidia-smi lists, or as many as CUDA_VISIBLE_DEVICES names (0 without one)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    count = sum(line.startswith("GPU ") for line in listed.stdout.splitlines()) if listed.returncode == 0 else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:         # the runtime numbers the visible ones 0, 1, ... up to the first bad entry
        count = min(count, len([d for d in visible.split(",") if d.strip()]))
    return count


# CUdevice_attribute values (cuda.h)
MULTIPROCESSOR_COUNT, MEMORY_CLOCK_RATE, GLOBAL_MEMORY_BUS_WIDTH = 16, 36, 37


def device_attributes(device: int, *attributes: int) -> list | None:
    """CUDA driver attributes of a device (nvidia-smi-independent), or None without a driver or device."""
    try:
        import ctypes
        cuda = ctypes.CDLL("libcuda.so.1")
        if cuda.cuInit(0):
            return None
        dev = ctypes.c_int()
        if cuda.cuDeviceGet(ctypes.byref(dev), device):
            return None
        values = []
        for attribute in attributes:
            value = ctypes.c_int()
            if cuda.cuDeviceGetAttribute(ctypes.byref(value), attribute, dev):
                return None
            values.append(value.value)
        return values
    except OSError:
        return None


def device_multiprocessors(device: int = 0) -> int | None:
    """The multiprocessor count."""
    values = device_attributes(device, MULTIPROCESSOR_COUNT)
    return values[0] or None if values else None


def device_block_bandwidth(device: int = 0) -> float | None:
    """A multiprocessor's share of the device's peak memory bandwidth, bytes/s: the memory clock (kHz,
    two transfers a cycle) times the bus width, over the multiprocessors (H100 SXM: 3.35 TB/s / 132)."""
    values = device_attributes(device, MULTIPROCESSOR_COUNT, MEMORY_CLOCK_RATE, GLOBAL_MEMORY_BUS_WIDTH)
    if not values or not all(values):
        return None
    sms, clock_khz, bus_bits = values
    return 2 * clock_khz * 1e3 * bus_bits / 8 / sms


def lane_devices(spec: ModelSpec, device: int = 0, devices=None) -> list:
    """The device of each launch: [device] when every lane runs on one GPU; with `gpus` > 1, one per
    lane (0, 1, ... unless given; a device may repeat, and those lanes then share it)."""
    if devices is None:
        return [device] if spec.gpus == 1 else list(range(spec.gpus))
    devices = list(devices)
    if len(devices) != spec.gpus or any(not is_int(d) or d < 0 for d in devices):
        raise KiecError("devices", devices, f"{spec.gpus} device id(s), one per launch (the model's gpus)")
    return devices


def lane_multiprocessors(devices) -> int | None:
    """The multiprocessors one launch is compiled for: its device's, split between the launches that
    share it (lanes of a multi-GPU build tried on one GPU)."""
    sms = device_multiprocessors(devices[0])
    return sms // max(devices.count(d) for d in devices) if sms else None


class CompiledModel:
    """A model's schedule, sources and built module (one build per source hash), for `device`'s memory
    (its pace sets how many weight copies a block keeps in flight; None: the target's count)."""

    def __init__(self, spec: ModelSpec, multiprocessors: int | None = None, build_root: Path | None = None,
                 quiet: bool = False, dump: Path | None = None, options=None, device: int | None = 0):
        from ..fetch import cache_dir
        from ..pipeline import render_sources
        from ..targets import get_target
        from ..toolchain import build
        self.spec = spec
        self.target = get_target(spec.target)
        block_bandwidth = device_block_bandwidth(device) if device is not None else None
        self.graph, self.sched, self.files, self.name = render_sources(spec, multiprocessors, dump, options,
                                                                       block_bandwidth)
        folder = (build_root or cache_dir() / "build") / f"{slug(spec.name)}-{self.name[5:]}"
        t0 = time.perf_counter()
        self.build = build(self.files, self.target, folder, self.name, quiet=quiet)
        self.build_s = time.perf_counter() - t0
        module_spec = importlib.util.spec_from_file_location(self.name, self.build.module_path)
        self.module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(self.module)
        if dump is not None:
            for name in ("kernel.hip", "kiec_port.h", "kiec_api.h", "module.cpp", "build.ninja"):
                shutil.copy(folder / name, dump / name)
            shutil.copy(self.build.module_path, dump / self.build.module_path.name)


def slug(name: str) -> str:
    """A name as a file name: letters, digits and -_. kept, the rest '-'."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in name)[:48]


class GpuBackend:
    name = "gpu"

    def __init__(self, spec: ModelSpec, device: int = 0, quiet: bool = False, progress=None,
                 timeout_s: float = 5.0, checkpoint=None, compiled: CompiledModel | None = None,
                 prefill: bool = True, devices=None, options=None):
        from ..pack import pack_weights
        from ..weights import load_checkpoint, materialize
        self.spec, self.device, self.timeout_s = spec, device, timeout_s
        self.devices = lane_devices(spec, device, devices)
        self.compiled = compiled or CompiledModel(spec, lane_multiprocessors(self.devices), quiet=quiet,
                                                  options=options, device=self.devices[0])
        self.sched = self.compiled.sched
        self.kernel = self.compiled.module.Kernel(self.devices)
        ckpt = checkpoint or load_checkpoint(spec)
        arrays = {t.name: materialize(ckpt, t) for t in self.compiled.graph.weights()}
        blob = pack_weights(self.sched, arrays, spec.config, spec.max_seq_len, spec.dtype, progress)
        del arrays
        self.kernel.upload(blob)
        self.info = self.compiled.module.info()
        self.max_seq_len = spec.max_seq_len
        self.vocab = spec.config.vocab
        self.step_base = 0
        self.running = False            # a launch is in flight (between _launch and _finish)
        self.logits_offset = self.sched.memory["acts"]["logits"][0]
        # the matrix-unit prefill takes a prompt's tokens but the last; without it (several lanes, or
        # prefill=False) the decode kernel takes them one step each
        self.use_prefill = prefill and self.info["prefill_chunk"] > 0
        self.last_prefill_ms = 0.0

    # --- launches ---------------------------------------------------------------------------------
    def _launch(self, forced, n_steps: int, start: int, temperature: float = 0.0, seed: int = 0,
                stop_ids=(), history: bool = False, trace: bool = False, profile: bool = False) -> None:
        if start + n_steps > self.max_seq_len:
            raise KiecError("context", start + n_steps, f"at most max_seq_len ({self.max_seq_len}) tokens")
        check_token_ids(forced, self.vocab)
        if self.running:
            raise KiecError("launch", "another", "the running launch finished first (its token stream closed)")
        try:
            self.kernel.launch(np.asarray(forced, dtype=np.uint32), n_steps, start, self.step_base, float(temperature),
                               int(seed) & 0xFFFFFFFF, [int(t) for t in stop_ids][:8], history, trace, profile,
                               self.timeout_s)
        except Exception:
            # nothing runs now; a launch refused before it started left the counters where they were, one
            # that failed halfway reset them: reset them here too, so that the epochs restart from zero
            self.kernel.reset()
            self.step_base = 0
            raise
        self.running = True

    def _check_prompt(self, tokens: list, start: int) -> None:
        if start + len(tokens) > self.max_seq_len:
            raise KiecError("context", start + len(tokens), f"at most max_seq_len ({self.max_seq_len}) tokens")
        check_token_ids(tokens, self.vocab)

    def _run_prefill(self, tokens: list, start: int, profile: bool):
        """The kernels over `tokens`, which the caller has checked (_check_prompt)."""
        ms, kinds = self.kernel.prefill(np.asarray(tokens, dtype=np.uint32), start, profile)
        return float(ms), kinds

    def prefill(self, tokens, start: int) -> float:
        """K and V of `tokens` at positions start.. into the cache (matrix-unit kernels); GPU milliseconds."""
        tokens = list(tokens)
        self._check_prompt(tokens, start)
        self.last_prefill_ms = self._run_prefill(tokens, start, False)[0]
        return self.last_prefill_ms

    def prefill_profile(self, tokens, start: int) -> dict:
        """Where a prefill's GPU time goes: milliseconds per kind of launch (each launch drained, so the
        kinds add up to more than an unprofiled prefill), and the total."""
        tokens = list(tokens)
        self._check_prompt(tokens, start)
        ms, kinds = self._run_prefill(tokens, start, True)
        return {"total_ms": ms, **{k: float(v) for k, v in zip(PREFILL_KINDS, kinds)}}

    def _prefilled(self, tokens, start: int, cancelled=None):
        """Prefills all of `tokens` but the last where the kernels exist; returns what the decode kernel
        takes. Where `cancelled` is given the prefill goes one kernel chunk a call (prefill_chunk tokens,
        as the kernels take them anyway), asking it between calls: Cancelled once it says so."""
        tokens = list(tokens)
        if not (self.use_prefill and len(tokens) > 1):
            return tokens, start
        body = tokens[:-1]
        self._check_prompt(body, start)             # the whole prompt, before its first chunk writes the cache
        step = self.info["prefill_chunk"] if cancelled is not None else len(body)
        total = 0.0
        for done in range(0, len(body), step):
            if done and cancelled():
                self.last_prefill_ms = total
                raise Cancelled(f"after {done} of the prompt's {len(tokens)} tokens")
            total += self._run_prefill(body[done:done + step], start + done, False)[0]
        self.last_prefill_ms = total
        return tokens[-1:], start + len(tokens) - 1

    def _finish(self) -> float:
        self.running = False
        record, ms = self.kernel.finish()
        done = len(self.kernel.poll())
        if record[0]:
            self.step_base = 0
            raise self._device_error(record)
        self.step_base = (self.step_base + done) & 0xFFFFFFFF     # the kernel's counters wrap at 32 bits too
        return ms

    def _device_error(self, record) -> DeviceError:
        code, stage, layer, tile, block, target, seen, step = record
        kinds = {1: "a counter wait timed out", 2: "a weight-ring wait timed out", 3: "an unknown stage kind",
                 4: "an activation's mark never came (wait timed out)"}
        where = self.sched.stages[stage].name if stage < len(self.sched.stages) else f"stage {stage}"
        return DeviceError("kernel", f"{kinds.get(code, f'error {code}')} in {where} (layer {layer}), tile {tile}, "
                           f"block {block}, step {step}", "a launch that completes",
                           f"waited for {target}, saw {seen}; the kernel stopped itself instead of hanging")

    def forward(self, tokens, start: int, cancelled=None) -> np.ndarray:
        """Logits [vocab] after feeding `tokens` at positions start..: a prefill of all but the last,
        then one decode step (or, without prefill kernels, one launch of len(tokens) decode steps).
        `cancelled()` is asked between the prefill's chunks and before the step: Cancelled once it says so."""
        tokens, start = self._prefilled(tokens, start, cancelled)
        if cancelled is not None and cancelled():
            raise Cancelled("after the prompt's prefill")
        self._launch(tokens, len(tokens), start)
        self._finish()
        return self.read_logits()

    def poison(self) -> None:
        """NaN into every buffer a step rewrites: an element the next launch misses stays NaN."""
        self.kernel.poison()

    def read_logits(self) -> np.ndarray:
        return self.kernel.read(REGION_ACTS, self.logits_offset, 4 * self.vocab).view(np.float32).copy()

    def teacher_forced(self, tokens, start: int) -> np.ndarray:
        """Logits [T, vocab] for every position of `tokens` (one launch, logits history on)."""
        tokens = list(tokens)
        self._launch(tokens, len(tokens), start, history=True)
        self._finish()
        raw = self.kernel.read(REGION_HISTORY, 0, 4 * self.vocab * len(tokens))
        return raw.view(np.float32).reshape(len(tokens), self.vocab).copy()

    def trace(self, token: int, pos: int) -> dict:
        """One step with every stage's output kept: stage index -> array (lanes, n) or (n,)."""
        from ..codegen import trace_layout
        self._launch([token], 1, pos, trace=True)
        self._finish()
        layout, total = trace_layout(self.sched)
        flat = self.kernel.read(REGION_TRACE, 0, 4 * total).view(np.float32)
        return {i: flat[o:o + n * lanes].reshape(lanes, n) if lanes > 1 or self.sched.stages[i].kind != "lm_head"
                else flat[o:o + n] for i, (o, n, lanes) in layout.items()}

    def profile(self, token: int, start: int, steps: int = 8) -> dict:
        """Where a steady-state step spends its time: a launch of `steps` steps from `token`, the middle
        one (`steps // 2`) stamped by the kernel (kiec.runtime.timeline). Returns the summary, plus "raw":
        the stamps [stages, blocks, fields] in ns, "stage_names", "launch_ms", "step" and "steps"."""
        from .timeline import FIELDS, summarize
        self._launch([token], steps, start, profile=True)
        ms = self._finish()
        stages, blocks = len(self.sched.stages), self.sched.grid.blocks
        raw = self.kernel.read(REGION_PROFILE, 0, 8 * stages * blocks * len(FIELDS)).view(np.uint64)
        raw = raw.reshape(stages, blocks, len(FIELDS)).copy()
        out = summarize(raw, [s.kind for s in self.sched.stages])
        out.update(launch_ms=ms, raw=raw, step=steps // 2, steps=steps, stage_names=[s.name for s in self.sched.stages])
        return out

    def generate_on_device(self, prompt, start: int, max_new: int, temperature: float = 0.0, seed: int = 0,
                           stop_ids=(), poll_s: float = 0.0002):
        """A prefill, then one launch for the whole completion; yields tokens as the kernel writes them
        to host memory."""
        prompt, start = self._prefilled(prompt, start)
        steps = min(len(prompt) - 1 + max_new, self.max_seq_len - start)
        self._launch(prompt, steps, start, temperature, seed, stop_ids)
        sent = len(prompt) - 1
        try:
            while True:
                got = self.kernel.poll()
                while sent < len(got):
                    yield int(got[sent])
                    sent += 1
                if sent >= steps:
                    break
                if self._stopped(got, stop_ids, len(prompt)):
                    break
                time.sleep(poll_s)
        finally:
            self._finish()
        got = self.kernel.poll()
        for t in got[sent:]:
            yield int(t)

    @staticmethod
    def _stopped(got, stop_ids, n_prompt: int) -> bool:
        return len(got) >= n_prompt and int(got[-1]) in set(stop_ids)
