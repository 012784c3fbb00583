"""kiec's command line: compile, run, inspect, bench, serve, chat.

Every user error is a KiecError, printed as one line (field, value, expected) with
exit code 2 and no traceback.
"""
from __future__ import annotations

import argparse
import os
import sys

from .cli_args import (add_model_args, add_sampling_args, engine_from_args, positive_int, sampling_from_args,
                       spec_from_args)
from .errors import KiecError


def cmd_run(args) -> int:
    from .runtime.chat import encode_chat, print_logprobs
    spec = spec_from_args(args)
    params = sampling_from_args(args)
    engine = engine_from_args(args, spec)
    if args.chat:
        ids = encode_chat(engine.tokenizer, [{"role": "user", "content": args.prompt}])
    else:
        ids = engine.encode(args.prompt)
        engine.check_request(ids, params)          # before the echo: an error is not glued to the prompt
        sys.stdout.write(args.prompt)
    if not args.quiet:
        print(f"[kiec] {spec.name} on {engine.backend.name}: {len(ids)} prompt tokens", file=sys.stderr)
    tokens = []
    for token in engine.generate(ids, params):
        sys.stdout.write(token.text)
        sys.stdout.flush()
        tokens.append(token)
    sys.stdout.write("\n")
    if params.logprobs is not None:
        print_logprobs(engine.tokenizer, tokens, sys.stderr)
    s = engine.last_stats
    if not args.quiet:
        full = tokens and tokens[-1].finish_reason == "length" and s.completion_tokens < params.max_tokens
        print(f"[kiec] {s.completion_tokens} tokens, first after {s.ttft_s * 1e3:.0f} ms, "
              f"{s.decode_tok_s:.1f} tok/s decode" + (f"; stopped with the context full (max_seq_len "
              f"{engine.max_seq_len}: --max-seq-len)" if full else ""), file=sys.stderr)
    return 0


def cmd_inspect(args) -> int:
    from .inspect import describe
    spec = spec_from_args(args)
    context = min(128, spec.max_seq_len) if args.context is None else args.context
    if not 1 <= context <= spec.max_seq_len:
        raise KiecError("--context", context, f"a context length in [1, {spec.max_seq_len}] (max_seq_len)")
    if args.dtp_error:
        from .dtp_error import check_dtp_error_spec, dtp_error
        check_dtp_error_spec(spec, args.tokens)      # before the report: its error is the command's answer
    print(describe(spec, context=context))
    if args.dtp_error:
        print(dtp_error(spec, args.tokens).summary(spec))
    return 0


def _add_common(p, top: bool) -> None:
    """--quiet and --log-level, before or after the subcommand (a subcommand's copy defaults to
    SUPPRESS, so it does not overwrite what was given before it)."""
    keep = {} if top else {"default": argparse.SUPPRESS}
    p.add_argument("--quiet", action="store_true", help="no progress bars or status lines", **keep)
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], **keep,
                   help="log detail on stderr, progress and status lines at info (default: info, warning with --quiet)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kiec", description=__doc__.splitlines()[0])
    _add_common(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="generate text for a prompt")
    add_model_args(p)
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--backend", default="auto", choices=["auto", "gpu", "reference"])
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_sampling_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("inspect", help="print the graph, parameters, bytes per token, the per-lane split")
    add_model_args(p)
    p.add_argument("--context", type=int, help="context length for the KV-cache bytes (default: 128, or max_seq_len)")
    p.add_argument("--dtp-error", action="store_true",
                   help="with --lanes and --dtp-delay: how far past(d) moves the logits (KL, top-1), on the reference")
    p.add_argument("--tokens", type=positive_int, default=32, help="teacher-forced tokens for --dtp-error")
    p.set_defaults(func=cmd_inspect)

    for register in _extensions():
        register(sub)
    for command in sub.choices.values():     # the common flags also after the subcommand
        _add_common(command, top=False)

    args = parser.parse_args(argv)
    import logging
    level = args.log_level or ("warning" if args.quiet else "info")
    logging.basicConfig(level=getattr(logging, level.upper()), format="[kiec] %(message)s")
    args.quiet = level in ("warning", "error")       # progress and status lines are info: --log-level decides
    try:
        return args.func(args)
    except KiecError as err:
        print(f"kiec: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:          # the reader left (`kiec run | head`): stop as cat does, no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # so the exit's flush finds no pipe
        return 141


def _extensions():
    """Subcommands that live beside the modules they drive."""
    from .commands import COMMANDS
    return COMMANDS


if __name__ == "__main__":
    sys.exit(main())
