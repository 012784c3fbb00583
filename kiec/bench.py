"""`kiec bench MODEL`: kiec's decode speed against the floor and its peers, in one run on one GPU.

    kiec bench llama-3.2-1b [--contexts 128,8192] [--steps 128] [--no-peers] [--compile-at 128] [--hf] [--options k=v,...] [--json out.json]
    kiec bench llama-3.2-1b --lanes 1,2,4,8 [--dtp-delay 2] [--placement one-launch,shared,spread] --no-compile
    kiec bench llama-3.2-1b --prompts 512,2048,8192     (time to first token; --no-prefill leaves it out)

One run measures, in order: the device's read bandwidth (kiec's own 16-byte grid-stride read,
kiec.probe); kiec's ms/token at each context, one launch per step and one launch per sequence
(the kernel's own event time); the torch peers on the same weights (plain ops in one CUDA graph,
and torch.compile then one CUDA graph, at every context or those --compile-at names: it autotunes
for minutes at each; CUDA events between replays); and, with --hf,
transformers' `generate`. With --lanes (kiec/bench_lanes.py), kiec again at each lane count (each
lane its own blocks, weights, KV cache and inbox): exact tensor parallelism, and past(d) with
--dtp-delay (a laneformer runs its own modes), with the bytes each lane sends per token, placed as
--placement says: `one-launch`, every lane in one grid on this GPU; `shared`, one launch per lane
(the multi-GPU build) all on GPU 0; `spread`, lane i on GPU i. With the peers, the NCCL baseline
too (kiec.baselines.torch_tp: the torch step sharded over L processes, all-reduce between kernels,
one CUDA graph), where L GPUs are present. The floor of a context is its bytes per token
(kiec.inspect) over the best read of this same run. --json is rewritten after every measurement
(marked partial until the run ends), so a run stopped halfway, by a timeout or ^C, keeps what it
timed. MODEL is anything `kiec run` takes, or a synthetic preset (kiec.synthetic.PRESETS): random
weights at real shapes, made in memory.
Everything GPU-side is imported when it runs, so `--help` and the argument checks work anywhere.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .bench_kiec import time_kiec
from .bench_report import PLACEMENTS, format_table, summarize
from .errors import KiecError, is_int, nearest
from .options import CompileOptions


@dataclass(frozen=True)
class BenchOptions:
    contexts: tuple = (128, 8192)
    steps: int = 128          # timed steps per measurement (positions context .. context + steps - 1)
    peers: bool = True
    compile_peer: bool = True  # torch.compile autotunes for minutes: --no-compile leaves that peer out
    compile_at: tuple = ()    # the contexts the torch.compile peer is timed at (its autotuning is per context); () every one
    hf: bool = False
    seed: int = 0             # the random weights of a preset, and the tokens fed
    lanes: tuple = ()         # lane counts to time (exact TP, and past(dtp_delay))
    dtp_delay: int | None = None
    placements: tuple = ("one-launch",)   # where the lanes run (PLACEMENTS)
    prompts: tuple = (512, 2048, 8192)    # prompt lengths to time to first token; () leaves prefill out
    fit_contexts: bool = False  # the default contexts: one past the model's positions is lowered to fit
    fit_prompts: bool = False   # the default prompts, the same
    kernel_options: str = ""    # compile options of kiec's own build (kiec compile --options), e.g. stream_copies_in_flight=4

    @property
    def compile_options(self) -> CompileOptions:
        return CompileOptions.parse(self.kernel_options)

    def __post_init__(self):
        self.compile_options                            # a bad knob is named before any work
        if self.kernel_options and self.lanes:
            raise KiecError("--options", self.kernel_options, "unset with --lanes (the lanes' builds take the defaults)")
        if not self.contexts or any(not is_int(c) or c <= 0 for c in self.contexts):
            raise KiecError("--contexts", self.contexts, "positive context lengths, e.g. 128,8192")
        if len(set(self.contexts)) != len(self.contexts):
            raise KiecError("--contexts", self.contexts, "each context once")
        if not is_int(self.steps) or self.steps < 2:
            raise KiecError("--steps", self.steps, "an integer of at least 2")
        if any(not is_int(n) or n < 1 for n in self.lanes):
            raise KiecError("--lanes", self.lanes, "positive lane counts, e.g. 1,2,4,8")
        if len(set(self.lanes)) != len(self.lanes):
            raise KiecError("--lanes", self.lanes, "each lane count once")
        if not self.placements or any(p not in PLACEMENTS for p in self.placements):
            raise KiecError("--placement", ",".join(self.placements), "a comma-separated choice of " + ", ".join(PLACEMENTS))
        if any(c not in self.contexts for c in self.compile_at):
            raise KiecError("--compile-at", self.compile_at, f"some of the timed contexts {self.contexts}")
        if self.compile_at and not (self.peers and self.compile_peer):
            raise KiecError("--compile-at", self.compile_at, "the torch.compile peer timed (not --no-compile or --no-peers)")
        if not is_int(self.seed) or self.seed < 0:
            raise KiecError("--seed", self.seed, "an integer >= 0")
        if any(not is_int(n) or n < 2 for n in self.prompts):
            raise KiecError("--prompts", self.prompts, "prompt lengths of at least 2 tokens, e.g. 512,2048,8192")
        if len(set(self.prompts)) != len(self.prompts):
            raise KiecError("--prompts", self.prompts, "each prompt length once")

    @property
    def max_seq_len(self) -> int:
        return max(max(self.contexts) + self.steps, max(self.prompts, default=0))


def fitted(options: BenchOptions, max_positions: int) -> BenchOptions:
    """The default contexts and prompts (those not given) for a model of `max_positions` positions: a
    context past max_positions - steps is lowered to it, a prompt past max_positions to it (SmolLM2's
    8,192 positions take context 8,064 with 128 steps). Given ones are left for the checks to refuse."""
    lower = lambda counts, limit: tuple(dict.fromkeys(min(n, limit) for n in counts))
    top = max_positions - options.steps
    if options.fit_contexts and top >= 1:
        options = dataclasses.replace(options, contexts=lower(options.contexts, top),
                                      compile_at=lower(options.compile_at, top))
    if options.fit_prompts:
        options = dataclasses.replace(options, prompts=lower(options.prompts, max_positions))
    return options


def parse_counts(text: str, option: str = "--contexts", example: str = "128,8192") -> tuple:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise KiecError(option, text, f"comma-separated integers, e.g. {example}") from None


class BenchModel:
    """MODEL resolved: its spec (max_seq_len fitted to the run), its weights, a folder transformers loads."""

    def __init__(self, model: str, options: BenchOptions, workdir: Path):
        from .model import arch_config, builtin_models, load_spec
        from .synthetic import PRESETS, preset
        self.name, self.workdir = model, workdir
        self.preset = preset(model) if model in PRESETS and not Path(model).exists() else None
        if self.preset is None and not Path(model).expanduser().exists() and model not in builtin_models():
            raise KiecError("model", model, "a model.json, a model folder, a safetensors or GGUF file, "
                            + ", ".join(builtin_models()) + " or a synthetic preset (" + ", ".join(PRESETS) + ")",
                            nearest(model, list(PRESETS) + list(builtin_models())))
        if self.preset is not None:
            arch = {"laneformer_tp": "laneformer"}.get(self.preset["model_type"], self.preset["model_type"])
            max_positions = arch_config(arch, self.preset).max_positions
        else:
            max_positions = load_spec(model).config.max_positions
        options = fitted(options, max_positions)
        self.options = options
        if max(options.contexts) + options.steps > max_positions:
            raise KiecError("--contexts", max(options.contexts),
                            f"context + steps ({max(options.contexts) + options.steps}) at most the model's "
                            f"max_position_embeddings ({max_positions})")
        if max(options.prompts, default=0) > max_positions:
            raise KiecError("--prompts", max(options.prompts),
                            f"prompts of at most the model's max_position_embeddings ({max_positions}) tokens",
                            "shorter --prompts, or --no-prefill")
        if self.preset is not None:
            (workdir / "config.json").write_text(json.dumps(self.preset))
            self.spec = load_spec({"name": model, "weights": str(workdir), "max_seq_len": options.max_seq_len})
        else:
            self.spec = load_spec(model, {"max_seq_len": options.max_seq_len})
        if options.peers and self.spec.config.arch == "laneformer":
            raise KiecError("model", model, "a llama, qwen2 or mistral model for the torch peers",
                            "pass --no-peers to time kiec alone")
        self.lane_specs = [(n, mode, placement, self.spec.replace(lanes=n, dtp_delay=delay,   # checked now,
                                                                  gpus=1 if placement == "one-launch" else n))  # not after timing
                           for n in options.lanes for mode, delay in self._lane_modes(n)
                           for placement in (options.placements if n > 1 else ("one-launch",))]

    def _lane_modes(self, lanes: int) -> list:
        """(row name, dtp_delay) per lane count: a laneformer's own modes; exact TP and past(d) otherwise."""
        if self.spec.config.arch == "laneformer":
            return [(f"laneformer (delay {self.spec.config.broadcast_delay})", None)]
        modes = [("exact TP", None)]
        if self.options.dtp_delay is not None and lanes > 1:
            modes.append((f"DTP past({self.options.dtp_delay})", self.options.dtp_delay))
        return modes

    def checkpoint(self):
        from .synthetic import random_checkpoint
        from .weights import load_checkpoint
        if self.preset is not None:
            return random_checkpoint(self.preset, self.options.seed)
        return load_checkpoint(self.spec)

    def hf_source(self) -> str:
        """A folder (or GGUF) transformers loads; a preset's random weights are written out for it."""
        if self.preset is not None:
            from .synthetic import write_random_model
            write_random_model(self.workdir, self.preset, self.options.seed, dtype="bf16")   # = checkpoint()
            return str(self.workdir)
        return self.spec.weights


# --- measurements (GPU) ---------------------------------------------------------------------------

def time_torch_peers(spec, checkpoint, options: BenchOptions, rng, log, found) -> None:
    """found(context, "torch graph" or "torch.compile graph", measurement) as each is timed; the cache
    fits each context. A peer that fails at a context (out of memory, a compile error) is a row that
    says so, and the others are still timed."""
    import torch
    from .baselines.torch_decode import GraphedStep, TorchDecoder, compile_step, time_replays
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype]
    built = peer_row(lambda: {"decoder": TorchDecoder(spec, checkpoint, options.contexts[0] + options.steps,
                                                     device="cuda", dtype=dtype)})

    def names(context):
        """The torch rows timed at `context`."""
        compiles = options.compile_peer and context in (options.compile_at or options.contexts)
        return ("torch graph",) + (("torch.compile graph",) if compiles else ())
    if "not_run" in built:              # every torch row says why, at every context
        for context in options.contexts:
            for name in names(context):
                found(context, name, built)
        return
    decoder = built["decoder"]
    compiled = compile_step(decoder) if options.compile_peer else None
    for context in options.contexts:
        resized = peer_row(lambda: decoder.resize_cache(context + options.steps) or {})  # attention reads the whole static cache
        if "not_run" in resized:
            for name in names(context):
                found(context, name, resized)
            continue
        for name in names(context):
            step = decoder if name == "torch graph" else compiled
            log(f"{name} at context {context}" + (" (compiling, autotuning)" if step is compiled else ""))
            token = int(rng.integers(spec.config.vocab))
            found(context, name, peer_row(lambda: time_replays(GraphedStep(step, decoder), token, context,
                                                                 options.steps)))
            torch.cuda.empty_cache()
    del decoder, compiled
    torch.cuda.empty_cache()


def peer_row(measure) -> dict:
    """A peer's measurement, or the row that says why there is none: the peers are other people's
    code (torch, torch.compile, transformers), and kiec's own rows are timed by then."""
    try:
        return measure()
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0]
        return {"not_run": f"failed: {type(err).__name__}: {first}"[:300]}


def run_bench(model: BenchModel, options: BenchOptions, log=lambda message: None, save=lambda raw: None) -> dict:
    """Every measurement of one run, raw (summarize() adds the floor, shares and speedups). `save` gets
    the measurements so far after each one, so a run stopped halfway keeps what it timed."""
    from .inspect import bytes_per_token
    from .probe import read_bandwidth
    from .runtime.gpu import GpuBackend
    spec = model.spec
    raw = {"model": model.name, "arch": spec.config.arch, "dtype": spec.dtype, "steps": options.steps,
           "options": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(options).items()},
           "device": _device_name(), "contexts": [], "prefill": None, "lanes": [], "nccl": []}
    measured = {}

    def found(context: int, name: str, row: dict) -> None:
        measured[context][name] = row
        log(f"{name} at context {context}: "
            + (row["not_run"] if "not_run" in row else f"{row['ms_per_token']:.4f} ms/token"))
        save(raw)

    log("read bandwidth (kiec.probe)")
    raw["bandwidth"] = read_bandwidth()
    log("weights")
    checkpoint = model.checkpoint()
    log("kiec: build and upload")
    backend = GpuBackend(spec, checkpoint=checkpoint, quiet=True, options=options.compile_options)
    rng = np.random.default_rng(options.seed)
    for context in options.contexts:
        log(f"kiec at context {context}")
        measured[context] = {}
        # the KV cache as the timed steps read it: positions context .. context + steps - 1 attend
        # context + 1 .. context + steps positions, context + (steps + 1) / 2 on average
        read = bytes_per_token(spec, context + (options.steps + 1) / 2)
        raw["contexts"].append({"context": context, "bytes_per_token": read, "measured": measured[context]})
        for name, row in time_kiec(backend, context, options.steps, rng).items():
            found(context, name, row)
    prefill = None
    if options.prompts and backend.use_prefill:
        from .bench_prefill import layer_matrix_params, matrix_rate, time_kiec_prefill
        log("bf16 matrix rate (torch.matmul)")
        prefill = {"matrix_rate": matrix_rate(), "layer_matrix_params": layer_matrix_params(spec)}
        log(f"kiec time to first token at {', '.join(map(str, options.prompts))} tokens")
        prefill["kiec"] = time_kiec_prefill(backend, options.prompts, rng)
    elif options.prompts:
        prefill = {"off": backend.sched.config.get("prefill_off") or "prefill turned off"}
    del backend
    if prefill and "kiec" in prefill and options.peers:
        from .bench_prefill import time_torch_prefill
        log("torch batched prefill")
        prefill["torch"] = peer_row(lambda: time_torch_prefill(spec, checkpoint, options.prompts, rng))
    raw["prefill"] = prefill
    save(raw)
    if options.peers:
        time_torch_peers(spec, checkpoint, options, rng, log, found)
    if options.hf:
        from .baselines.hf_generate import load_hf_model, time_generate
        log("HF generate: load")
        hf = peer_row(lambda: load_hf_model(model.hf_source(), "cuda", spec.dtype))
        for context in options.contexts:
            log(f"HF generate at context {context}")
            found(context, "HF generate", hf if isinstance(hf, dict) and "not_run" in hf
                  else peer_row(lambda: time_generate(hf, context, options.steps, options.seed)))
    from .bench_lanes import time_lanes, time_nccl
    for row in time_lanes(model, checkpoint, options, rng, log):
        raw["lanes"].append(row)
        save(raw)
    for row in time_nccl(model, options, log) if options.lanes and options.peers else ():
        raw["nccl"].append(row)
        save(raw)
    return raw


def _device_name() -> str:
    try:
        import torch
        return torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    except ImportError:
        return ""


def require_gpu(peers: bool) -> None:
    from .runtime.gpu import gpu_available
    if not gpu_available():
        raise KiecError("device", "no GPU", "an NVIDIA GPU with nvidia-smi and nvcc (kiec bench times kernels on it)")
    if peers:
        try:
            import torch
        except ImportError:
            raise KiecError("torch", "not installed", "torch with CUDA for the peers", "or pass --no-peers") from None
        if not torch.cuda.is_available():
            raise KiecError("torch", f"{torch.__version__} without CUDA", "torch with CUDA for the peers",
                            "or pass --no-peers")


# --- the command ----------------------------------------------------------------------------------

def register_bench(sub) -> None:
    from .synthetic import PRESETS
    d = BenchOptions()
    p = sub.add_parser("bench", help="kiec's ms/token against the read-bandwidth floor and the torch / HF peers (GPU)")
    p.add_argument("model", help="a model.json, a model folder, a safetensors or GGUF file, 'smollm2', or a synthetic preset with "
                                 "random weights: " + ", ".join(PRESETS))
    p.add_argument("--contexts", help=f"context lengths to time at, comma-separated (default: "
                                      f"{','.join(map(str, d.contexts))}, lowered to fit a model with fewer positions)")
    p.add_argument("--steps", type=int, default=d.steps, help="timed decode steps per measurement (default: %(default)s)")
    p.add_argument("--no-peers", action="store_true", help="time kiec alone (no torch peers)")
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile peer (it autotunes for minutes)")
    p.add_argument("--compile-at", default="", help="time the torch.compile peer at these contexts only, comma-separated "
                                                    "(it autotunes again for each; default: every context)")
    p.add_argument("--hf", action="store_true", help="also time transformers' generate (slow)")
    p.add_argument("--seed", type=int, default=d.seed, help="a preset's random weights and the tokens fed")
    p.add_argument("--lanes", default="", help="also time kiec at these lane counts (comma-separated, e.g. 1,2,4,8), "
                                                "and with the peers the NCCL baseline")
    p.add_argument("--placement", default=",".join(d.placements),
                   help="with --lanes, where they run, comma-separated: " +
                        "; ".join(f"{k}: {v}" for k, v in PLACEMENTS.items()) + " (default: %(default)s)")
    p.add_argument("--dtp-delay", type=int, default=None,
                   help="with --lanes: also time Delayed Tensor Parallelism past(D) (an approximation of the model)")
    p.add_argument("--prompts", help=f"prompt lengths to time to first token, comma-separated (default: "
                                     f"{','.join(map(str, d.prompts))}, lowered to fit a model with fewer positions)")
    p.add_argument("--no-prefill", action="store_true", help="leave out the time to first token")
    p.add_argument("--options", default="", help="compile options of kiec's own build, as kiec compile takes them "
                   "(e.g. stream_copies_in_flight=4); not with --lanes")
    p.add_argument("--json", type=Path, help="write every measurement and derived number here (rewritten as each "
                                              "one is timed, marked partial until the run ends)")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    if args.dtp_delay is not None and not args.lanes:
        raise KiecError("--dtp-delay", args.dtp_delay, "--lanes as well (DTP needs several lanes)")
    d = BenchOptions()
    options = BenchOptions(contexts=parse_counts(args.contexts) if args.contexts else d.contexts, steps=args.steps,
                           peers=not args.no_peers,
                           compile_peer=not args.no_compile, hf=args.hf, seed=args.seed,
                           compile_at=parse_counts(args.compile_at, "--compile-at", "128") if args.compile_at else (),
                           lanes=parse_counts(args.lanes, "--lanes", "1,2,4,8") if args.lanes else (),
                           dtp_delay=args.dtp_delay, placements=tuple(args.placement.split(",")),
                           prompts=() if args.no_prefill else parse_counts(args.prompts, "--prompts", "512,2048,8192")
                           if args.prompts else d.prompts,
                           fit_contexts=args.contexts is None, fit_prompts=args.prompts is None,
                           kernel_options=args.options)
    if args.json is not None and not args.json.parent.is_dir():     # found now, not after minutes of timing
        raise KiecError("--json", str(args.json), "a file in an existing folder")
    quiet = getattr(args, "quiet", False)
    log = (lambda m: None) if quiet else (lambda m: print(f"[kiec bench] {m}", file=sys.stderr, flush=True))
    so_far = {}

    def save(raw: dict) -> None:
        """The measurements so far, marked partial, in --json: a run stopped halfway (a timeout, ^C)
        keeps them."""
        so_far["summary"] = summarize(dict(raw, partial=True))
        if args.json:
            write_json(args.json, so_far["summary"])

    with tempfile.TemporaryDirectory(prefix="kiec-bench-") as workdir:
        model = BenchModel(args.model, options, Path(workdir))    # argument errors come before the GPU check
        if model.options != options:
            log(f"contexts {','.join(map(str, model.options.contexts))}"
                + (f", prompts {','.join(map(str, model.options.prompts))}" if options.prompts else "")
                + " (the defaults, lowered to the model's positions)")
            options = model.options
        require_gpu(options.peers or bool(options.prompts))
        try:
            summary = summarize(run_bench(model, options, log, save))
        except KeyboardInterrupt:
            if "summary" not in so_far:
                raise
            print(format_table(so_far["summary"]))
            return 130
    if args.json:
        write_json(args.json, summary)
    print(format_table(summary))
    return 0


def write_json(path: Path, summary: dict) -> None:
    """Whole or not at all: a run stopped while writing leaves the last complete file."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(summary, indent=1))
    os.replace(part, path)

