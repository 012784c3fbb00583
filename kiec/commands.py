"""Subcommands registered beside the modules they drive (cli.py holds run and inspect)."""
from __future__ import annotations

import os


def register_serve(sub) -> None:
    from .cli_args import add_model_args
    from .runtime.server import ServeOptions
    d = ServeOptions()
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    add_model_args(p)
    p.add_argument("--backend", default="auto", choices=["auto", "gpu", "reference"])
    p.add_argument("--host", default=d.host, help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=d.port, help="0: any free port (the log line says which)")
    p.add_argument("--api-key", default=os.environ.get("KIEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $KIEC_API_KEY; none: no key)")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="requests that may wait while one runs; past that: 503")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="larger bodies: 413")
    p.add_argument("--model-name", help="the name clients send as `model` (default: the model's own)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from .cli_args import engine_from_args, spec_from_args
    from .runtime.server import ServeOptions, bind, check_serve_extra, serve
    check_serve_extra()                           # before the model loads
    options = ServeOptions(host=args.host, port=args.port, api_key=args.api_key, max_queue=args.max_queue,
                           max_body_bytes=args.max_body_bytes, model_name=args.model_name)
    spec = spec_from_args(args)
    sock = bind(options.host, options.port)      # a taken port fails now, not after the weights load
    return serve(engine_from_args(args, spec), options, sock)


def register_chat(sub) -> None:
    from .cli_args import add_model_args, add_sampling_args
    p = sub.add_parser("chat", help="an interactive chat in the terminal (/reset, /exit, /help)")
    add_model_args(p)
    p.add_argument("--backend", default="auto", choices=["auto", "gpu", "reference"])
    p.add_argument("--system", help="a system message to start every conversation with")
    add_sampling_args(p)
    p.set_defaults(func=cmd_chat, max_tokens=512)


def cmd_chat(args) -> int:
    from .cli_args import engine_from_args, sampling_from_args, spec_from_args
    from .runtime.chat import ChatSession, chat_loop
    params = sampling_from_args(args)
    session = ChatSession(engine_from_args(args, spec_from_args(args)), params, system=args.system)
    return chat_loop(session, quiet=args.quiet)


from .bench import register_bench  # noqa: E402  (beside the module it drives)
from .compiler import register_compile  # noqa: E402  (beside the module it drives)

COMMANDS: list = [register_compile, register_bench, register_serve, register_chat]
