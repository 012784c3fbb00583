"""The arguments several commands share (the model and its overrides, sampling) and what they
become: a ModelSpec, SamplingParams, an Engine. The commands that take them live in kiec.cli,
kiec.commands and kiec.compiler; they import from here, and nothing here imports them."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An argparse type: argparse's own error names the flag."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a positive integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"got {value}; expected a positive integer")
    return value


def spec_from_args(args):
    """The model spec a command names, with the command's overrides."""
    from .model import load_spec
    if args.model == "smollm2":      # fetched here, so that --quiet reaches the download's messages
        from .fetch import smollm2_gguf
        smollm2_gguf(quiet=getattr(args, "quiet", False))
    overrides = {}
    for key in ("max_seq_len", "lanes", "gpus", "dtp_delay", "target"):
        value = getattr(args, key, None)
        if value is not None:
            overrides[key] = value
    return load_spec(args.model, overrides)


def add_model_args(p, default="smollm2"):
    """The model argument and the spec overrides every model command takes."""
    p.add_argument("model", nargs="?", default=default,
                   help="model.json, a model folder, a safetensors or GGUF file, or 'smollm2' (the default)")
    p.add_argument("--max-seq-len", dest="max_seq_len", type=int)
    p.add_argument("--lanes", type=int)
    p.add_argument("--gpus", type=int)
    p.add_argument("--dtp-delay", dest="dtp_delay", type=int,
                   help="apply past(d) DTP to a model not trained for it (an approximation)")


def add_sampling_args(p) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--stop-token-id", action="append", type=int, default=[])
    p.add_argument("--logprobs", type=int, help="print each token's logprob and this many alternatives")
    p.add_argument("--ignore-eos", action="store_true", help="go on past the model's end-of-turn tokens")


def sampling_from_args(args):
    from .runtime.sampling import SamplingParams
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, seed=args.seed, max_tokens=args.max_tokens,
                          stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_id), logprobs=args.logprobs,
                          ignore_eos=args.ignore_eos)


def engine_from_args(args, spec):
    """The engine for a command, with progress bars on stderr unless --quiet."""
    from .progress import ProgressBar
    from .runtime.engine import Engine
    return Engine(spec, backend=args.backend, progress=None if args.quiet else ProgressBar())
