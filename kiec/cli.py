"""kiec's command line: compile, run, inspect, bench, serve, chat.

Every user error is a KiecError, printed as one line (field, value, expected) with
exit code 2 and no traceback.
"""
from __future__ import annotations

import argparse
import sys

from .errors import KiecError


def _spec(args):
    from .model import load_spec
    overrides = {}
    for key in ("max_seq_len", "lanes", "gpus", "dtp_delay", "target"):
        value = getattr(args, key, None)
        if value is not None:
            overrides[key] = value
    return load_spec(args.model, overrides)


def _add_model(p, default="smollm2"):
    p.add_argument("model", nargs="?", default=default,
                   help="model.json, a model folder, a GGUF file, or 'smollm2' (the default)")
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
    p.add_argument("--logprobs", type=int)


def sampling_from_args(args):
    from .runtime.sampling import SamplingParams
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, seed=args.seed, max_tokens=args.max_tokens,
                          stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_id), logprobs=args.logprobs)


def cmd_run(args) -> int:
    from .runtime.engine import Engine
    spec = _spec(args)
    params = sampling_from_args(args)
    engine = Engine(spec, backend=args.backend)
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat([{"role": "user", "content": prompt}])
    ids = engine.encode(prompt)
    if not args.quiet:
        print(f"[kiec] {spec.name} on {engine.backend.name}: {len(ids)} prompt tokens", file=sys.stderr)
    if not args.chat:
        sys.stdout.write(prompt)
    for token in engine.generate(ids, params):
        sys.stdout.write(token.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    s = engine.last_stats
    if not args.quiet:
        print(f"[kiec] {s.completion_tokens} tokens, first after {s.ttft_s * 1e3:.0f} ms, "
              f"{s.decode_tok_s:.1f} tok/s decode", file=sys.stderr)
    return 0


def cmd_inspect(args) -> int:
    from .inspect import describe
    print(describe(_spec(args), context=args.context))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kiec", description=__doc__.splitlines()[0])
    parser.add_argument("--quiet", action="store_true", help="no progress or status lines")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="generate text for a prompt")
    _add_model(p)
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--backend", default="auto", choices=["auto", "gpu", "reference"])
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_sampling_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("inspect", help="print the graph, parameters, bytes per token, the per-lane split")
    _add_model(p)
    p.add_argument("--context", type=int, default=128, help="context length for the KV-cache bytes")
    p.set_defaults(func=cmd_inspect)

    for register in _extensions():
        register(sub)

    args = parser.parse_args(argv)
    import logging
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="[kiec] %(message)s")
    try:
        return args.func(args)
    except KiecError as err:
        print(f"kiec: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _extensions():
    """Subcommands that live beside the modules they drive."""
    from .commands import COMMANDS
    return COMMANDS


if __name__ == "__main__":
    sys.exit(main())
