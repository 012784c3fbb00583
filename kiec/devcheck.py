"""One device run: build, check and time the monokernel on random-weight models in one go.

    python -m kiec.devcheck --out DIR [--models tiny-llama,llama-3.2-1b,...] [--bench]
                            [--variants "slot_bytes=32768;max_slots=6" --variant-model llama-3.2-1b]
                            [--rounds 3] [--positions 128,400] [--profile-at 200]

For each model it builds the kernel (in parallel), uploads random weights, and checks:
per-stage trace against the Python twin over the first positions (the first stage over
tolerance names the bug), teacher-forced logits against the twin, bitwise determinism of
two identical runs, and that one launch for a whole sequence selects the same tokens as
one launch per step. With --bench it measures the read bandwidth and ms/token; each of
--variants (compile options) is built for --variant-model, checked against the default
build's logits and timed. It prints a short table last and writes DIR/devcheck.json.

Builds of one model are timed in --rounds interleaved rounds (the default build, then each
variant, then again), medians reported: two builds of nearly the same kernel differ by about 1%
through code layout alone, and a drift of the device over the run would otherwise favour
whichever build ran first. Each build's profile is set beside its unprofiled launches
(`profile_overhead`: how much slower the profiled step ran than an unprofiled one there); both
go from --profile-at (200; 8,128 profiles Llama-1B's long context, the split path).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .errors import KiecError
from .runtime.timeline import format_late, format_summary, kinds_of, late_blocks

DEFAULT_MODELS = "tiny-llama,tiny-qwen2,tiny-mistral,llama-3.2-1b,qwen2.5-1.5b"
SEQ = {"tiny-llama": 512, "tiny-qwen2": 512, "tiny-mistral": 600, "llama-3.2-1b": 8192, "qwen2.5-1.5b": 1024}


def built_positions(name: str) -> int:
    """The positions devcheck builds a model for."""
    return SEQ.get(name, 1024)


def model_spec(name: str, root: Path):
    from .model import load_spec
    from .synthetic import preset
    cfg = preset(name)
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return load_spec({"name": name, "weights": str(folder), "max_seq_len": built_positions(name)}), cfg


def check_variant(name, spec, ckpt, compiled, options, reference_logits, log):
    """A build with other compile options: same logits as the default build (to bf16 noise). Returns
    the results and the backend (for time_builds)."""
    from .golden import logit_errors
    from .runtime.gpu import GpuBackend
    backend = GpuBackend(spec, checkpoint=ckpt, compiled=compiled, timeout_s=3.0)
    tokens, want = reference_logits          # the default build's logits of the last steps of `tokens`
    backend.poison()
    errs, agree = logit_errors(backend.teacher_forced(tokens, 0)[-len(want):], want)
    out = {"model": f"{name}[{options.label()}]", "build_s": round(compiled.build_s, 1), "report": compiled.build.report,
           "stage_err": {"vs default": float(f"{errs.max():.3g}")}, "first_bad_stage": None,
           "tf_max_err": float(f"{errs.max():.3g}"), "tf_argmax_agree": agree, "bitwise_repeat": None,
           "device_loop_equal": None, "slots": compiled.sched.grid.slots}
    log(f"{out['model']}: vs default {errs.max():.3g}, slots {out['slots']}, "
        f"{compiled.sched.grid.copies_summary}")
    return out, backend


def check_model(name, spec, cfg, compiled, log, keep: dict | None = None):
    """Every check of one build against the twin. Returns the results and the backend."""
    from .golden import logit_errors, stage_diffs
    from .pack import pack_weights
    from .reference.twin import Twin
    from .runtime.gpu import GpuBackend
    from .synthetic import random_checkpoint
    from .weights import materialize
    out = {"model": name, "build_s": round(compiled.build_s, 1), "report": compiled.build.report}
    t0 = time.perf_counter()
    ckpt = random_checkpoint(cfg, seed=7)
    if keep is not None:
        keep["ckpt"] = ckpt
    backend = GpuBackend(spec, checkpoint=ckpt, compiled=compiled, timeout_s=3.0)
    arrays = {t.name: materialize(ckpt, t) for t in compiled.graph.weights()}
    blob = pack_weights(compiled.sched, arrays, spec.config, spec.max_seq_len, spec.dtype)
    del arrays
    twin = Twin(compiled.sched, blob, spec.config, spec.max_seq_len, spec.dtype)
    out["upload_s"] = round(time.perf_counter() - t0, 1)
    rng = np.random.default_rng(0)
    vocab = spec.config.vocab
    big = spec.config.hidden >= 1024
    # 1. per-stage trace over the first positions
    worst: dict = {}
    first_bad = None
    positions = 3 if big else 6
    context = []
    for pos in range(positions):
        token = int(rng.integers(vocab))
        context.append(token)
        for stage, err in stage_diffs(backend, twin, token, pos):
            kind = stage.split("[")[0]
            worst[kind] = max(worst.get(kind, 0.0), err)
            if first_bad is None and not err < 2e-2:
                first_bad = f"{stage} at pos {pos}: {err:.3g}"
    out["stage_err"] = {k: float(f"{v:.3g}") for k, v in worst.items()}
    out["first_bad_stage"] = first_bad
    log(f"{name}: stage errors {out['stage_err']} first bad {first_bad}")
    # 2. teacher-forced logits against the twin
    steps = 8 if big else 64
    start = positions
    tokens = [int(t) for t in rng.integers(vocab, size=steps)]
    backend.poison()
    got = backend.teacher_forced(tokens, start)
    want = np.stack([twin.step(t, start + i)[0] for i, t in enumerate(tokens)])
    errs, agree = logit_errors(got, want)
    if keep is not None:
        keep["logits"] = (context + tokens, got)
    out["tf_max_err"] = float(f"{errs.max():.3g}")
    out["tf_argmax_agree"] = agree
    # 3. determinism: the same launch twice, bitwise
    backend.poison()
    again = backend.teacher_forced(tokens, start)
    out["bitwise_repeat"] = bool(np.array_equal(got.view(np.uint32), again.view(np.uint32)))
    # 4. one launch per sequence selects what one launch per step selects
    prompt = tokens[:4]
    n_new = 16
    device_tokens = list(backend.generate_on_device(prompt, start, n_new))
    logits = backend.forward(prompt, start)
    host_tokens = []
    for i in range(n_new):
        host_tokens.append(int(np.argmax(logits)))
        if i < n_new - 1:
            logits = backend.forward([host_tokens[-1]], start + len(prompt) + i)
    out["device_loop_equal"] = device_tokens == host_tokens
    if not out["device_loop_equal"]:
        out["device_tokens"], out["host_tokens"] = device_tokens, host_tokens
    log(f"{name}: tf err {out['tf_max_err']} agree {agree} repeat {out['bitwise_repeat']} loop {out['device_loop_equal']}")
    return out, backend


PROFILE_AT = 200        # the position of the profile's launch, and of the 8-step launches beside it


def time_round(backend, max_seq_len: int, positions: tuple = (), profile_at: int = PROFILE_AT) -> dict:
    """One round of ms/token, by the kernel's event times (builds compare without the host's share;
    `kiec bench` times a step as the host pays it): single-step launches (one per step) at positions
    16-30 and one 256-step launch from 128 (one per sequence), 8-step launches at the profile's position,
    the 64 steps before context 8192, and an 8-step launch starting at each of `positions` that the
    model's length allows."""
    per_step = []
    for i in range(15):
        backend._launch([1 + i], 1, 16 + i)
        per_step.append(backend._finish())
    res = {"ms_per_token_launch_per_step": float(np.median(per_step[5:]))}
    backend._launch([1], 256, 128)
    res["ms_per_token_one_launch"] = backend._finish() / 256
    eights = []
    for _ in range(3):
        backend._launch([1], 8, profile_at)
        eights.append(backend._finish() / 8)
    res["ms_per_token_8_steps"] = float(np.median(eights))
    if max_seq_len >= 8192:
        backend._launch([1], 64, 8192 - 64)
        res["ms_per_token_ctx8192"] = backend._finish() / 64
    for p in positions:
        if p + 8 <= max_seq_len:
            backend._launch([1], 8, p)
            res[f"ms_per_token_at_{p}"] = backend._finish() / 8
    return res


def time_builds(builds: dict, rounds: int, out_dir: Path | None, log, positions: tuple = (),
                profile_at: int = PROFILE_AT) -> dict:
    """builds: label -> (backend, max_seq_len), builds of one model. Interleaved rounds of time_round,
    then each build's profile (its raw stamps saved as out_dir/profile-LABEL.npy). Returns label ->
    medians over the rounds, the profile and its overhead; or a build's `timing_error`, which leaves
    the others timed."""
    from .runtime.gpu import slug
    samples = {label: [] for label in builds}
    out = {}

    def failed(label, err):
        out[label] = {"timing_error": f"{type(err).__name__}: {err}"[:2000]}
        log(f"{label}: timing FAILED {out[label]['timing_error']}")
    for _ in range(rounds):
        for label, (backend, max_seq_len) in builds.items():
            if label in out:
                continue
            try:
                samples[label].append(time_round(backend, max_seq_len, positions, profile_at))
            except Exception as err:
                failed(label, err)
    for label, (backend, _) in builds.items():
        if label in out:
            continue
        res = {key: float(np.median([s[key] for s in samples[label]])) for key in samples[label][0]}
        res["rounds"] = rounds
        try:
            prof = backend.profile(1, profile_at)
        except Exception as err:
            failed(label, err)
            continue
        raw = prof.pop("raw")
        names = prof.pop("stage_names", None)
        if out_dir is not None:         # python -m kiec.runtime.timeline reads both
            np.save(out_dir / f"profile-{slug(label)}.npy", raw)
            if names:
                (out_dir / f"profile-{slug(label)}.json").write_text(json.dumps({"stages": names}))
        res["profile"] = prof
        # an unprofiled 8-step launch's mean step (its first step starts cold) against the profiled step
        res["profile_overhead"] = prof["step_us"] / (1e3 * res["ms_per_token_8_steps"]) - 1
        # whether the same blocks end the FFN's stages last in every layer (a static share could even them)
        kinds = kinds_of(names or [])
        late = "".join("\n" + format_late(late_blocks(raw, kinds, k), k) for k in ("gate_up", "down") if k in kinds)
        res["profile_text"] = (f"  profile of step {prof['step']} of {prof['steps']} (launch {prof['launch_ms']:.3f} ms; "
                               f"{prof['step_us']:.1f} us against {1e3 * res['ms_per_token_8_steps']:.1f} a step unprofiled, "
                               f"{100 * res['profile_overhead']:+.1f}%):\n" + format_summary(prof) + late)
        log(f"{label}: {res['ms_per_token_one_launch']:.4f} ms/token one launch, "
            f"{res['ms_per_token_launch_per_step']:.4f} one launch per step, the kernel's time (medians of {rounds} rounds)")
        swept = [f"{p}: {res[f'ms_per_token_at_{p}']:.4f}" for p in positions if f"ms_per_token_at_{p}" in res]
        if swept:
            log(f"  ms/token of 8-step launches from position {', '.join(swept)}")
        log(res["profile_text"])
        out[label] = res
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--out", default=".")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--variants", default="", help="';'-separated compile options to build and time")
    ap.add_argument("--variant-model", default="llama-3.2-1b")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds of each build (medians reported)")
    ap.add_argument("--positions", default="", help="','-separated positions to time 8-step launches from as well")
    ap.add_argument("--profile-at", type=int, default=PROFILE_AT,
                    help="the position of the profiled launch and of the 8-step launches beside it")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        raise KiecError("--rounds", args.rounds, "at least 1")
    try:
        positions = tuple(int(p) for p in args.positions.split(",") if p.strip())
    except ValueError:
        raise KiecError("--positions", args.positions, "','-separated whole numbers") from None
    if any(p < 0 for p in positions):
        raise KiecError("--positions", args.positions, "positions of 0 or more")
    timed = {*args.models.split(","), *([args.variant_model] if args.variants.strip() else [])}
    for n in sorted(timed):                                     # the profiled launch runs 8 steps
        seq = built_positions(n)
        if not 0 <= args.profile_at <= seq - 8:
            raise KiecError("--profile-at", args.profile_at, f"0 to {seq - 8} ({n} is built for {seq} positions, and 8 steps are run)")
    from .options import CompileOptions
    variants = [CompileOptions.parse(v) for v in args.variants.split(";") if v.strip()]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    logf = open(out_dir / "devcheck.log", "w")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()
    from .runtime.gpu import CompiledModel, device_multiprocessors
    sms = device_multiprocessors()
    log(f"device multiprocessors: {sms}")
    results = {"multiprocessors": sms}
    if args.bench:
        from .probe import read_bandwidth
        results["bandwidth"] = read_bandwidth()
        log(f"read bandwidth: {results['bandwidth']['median_bps'] / 1e12:.3f} TB/s median, "
            f"{results['bandwidth']['best_bps'] / 1e12:.3f} best")
    root = Path(tempfile.mkdtemp(prefix="kiec-devcheck-"))
    names = args.models.split(",")
    specs = {n: model_spec(n, root) for n in names}
    with ThreadPoolExecutor(max_workers=len(names) + len(variants)) as pool:
        futures = {n: pool.submit(CompiledModel, specs[n][0], sms, root / "build", True) for n in names}
        variant_futures = [pool.submit(CompiledModel, specs[args.variant_model][0], sms, root / "build", True, None, v)
                           for v in variants]
    results["models"] = []
    kept: dict = {}
    together: dict = {}        # the variant model's builds, timed in the same rounds: label -> (backend, max_seq_len)
    for n in names:
        try:
            compiled = futures[n].result()
            log(f"{n}: built in {compiled.build_s:.1f} s, {compiled.sched.grid.copies_summary}; "
                f"{compiled.build.report.splitlines()[-1]}")
            out, backend = check_model(n, *specs[n], compiled, log, kept if n == args.variant_model else None)
            results["models"].append(out)
            build = {n: (backend, specs[n][0].max_seq_len)}
            if n == args.variant_model and variants:
                together.update(build)
            elif args.bench:
                out.update(time_builds(build, args.rounds, out_dir, log, positions, args.profile_at)[n])
            del backend, build
        except Exception as err:
            log(f"{n}: FAILED {type(err).__name__}: {err}")
            log(traceback.format_exc())
            results["models"].append({"model": n, "error": f"{type(err).__name__}: {err}"[:2000]})
        (out_dir / "devcheck.json").write_text(json.dumps(results, indent=1, default=str))
    for options, future in zip(variants, variant_futures):
        try:
            spec = specs[args.variant_model][0]
            out, backend = check_variant(args.variant_model, spec, kept["ckpt"], future.result(), options,
                                         kept["logits"], log)
            results["models"].append(out)
            together[out["model"]] = (backend, spec.max_seq_len)
            del backend
        except Exception as err:
            log(f"variant {options}: FAILED {type(err).__name__}: {err}")
            log(traceback.format_exc())
            results["models"].append({"model": f"{args.variant_model}[{options.label()}]", "error": str(err)[:2000]})
        (out_dir / "devcheck.json").write_text(json.dumps(results, indent=1, default=str))
    if together:
        try:
            times = time_builds(together, args.rounds, out_dir, log, positions, args.profile_at)
            for r in results["models"]:
                r.update(times.get(r["model"], {}))
        except Exception as err:
            log(f"timing {', '.join(together)}: FAILED {type(err).__name__}: {err}")
            log(traceback.format_exc())
        together.clear()
        (out_dir / "devcheck.json").write_text(json.dumps(results, indent=1, default=str))
    print("\nmodel                            stage-err(max)  first-bad                tf-err   agree  repeat loop   "
          "ms/tok(step) ms/tok(seq) ms/tok(8192)")
    for r in results["models"]:
        if "error" in r:
            print(f"{r['model']:<32} ERROR {r['error'][:100]}")
            continue
        se = max(r["stage_err"].values())
        print(f"{r['model']:<32} {se:<15.3g} {str(r['first_bad_stage'])[:24]:<24} {r['tf_max_err']:<8.3g} "
              f"{r['tf_argmax_agree']:<6.2f} {str(r['bitwise_repeat']):<6} {str(r['device_loop_equal']):<6} "
              f"{r.get('ms_per_token_launch_per_step', float('nan')):<12.4f} {r.get('ms_per_token_one_launch', float('nan')):<11.4f} "
              f"{r.get('ms_per_token_ctx8192', float('nan')):.4f}")
    return 1 if any("error" in r for r in results["models"]) else 0


if __name__ == "__main__":
    sys.exit(main())
