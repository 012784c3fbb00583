"""`kiec serve`: an OpenAI-compatible HTTP server for one model, one sequence at a time.

Routes: POST /v1/completions, POST /v1/chat/completions (streaming by server-sent
events or not), GET /v1/models[/{name}], GET /health. Starlette + uvicorn: the event
loop only parses, queues and writes; the engine runs on its own thread (worker.py).

Safe by default: it binds 127.0.0.1, an API key (if set) is required on every /v1
route, bodies are bounded (413), prompts by the context (400, as OpenAI answers), a
full queue answers 503, and nothing in a request can name a file. Each request logs
one line with its tokens, time to first token and decode speed.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import socket
import sys
import time
from dataclasses import dataclass

from ..errors import DeviceError, KiecError, is_int, is_request_error
from .openai_request import ApiError, Served, parse_chat, parse_completion
from .openai_response import Reply
from .worker import EngineWorker, QueueFull

log = logging.getLogger("kiec.serve")


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 64              # requests that may wait while one runs
    max_body_bytes: int = 4 << 20    # a 4 MiB body holds far more text than any context
    model_name: str | None = None    # the name clients send as `model`; the model's own by default

    def __post_init__(self):
        if not is_int(self.port) or not 0 <= self.port <= 65535:
            raise KiecError("port", self.port, "an integer in [0, 65535] (0: any free port)")
        if not is_int(self.max_body_bytes) \
                or self.max_body_bytes < 1024:
            raise KiecError("max_body_bytes", self.max_body_bytes, "an integer >= 1024")
        if not is_int(self.max_queue) or self.max_queue < 0:
            raise KiecError("max_queue", self.max_queue, "an integer >= 0 (requests that may wait for the engine)")
        if self.api_key is not None and not self.api_key.strip():
            raise KiecError("api_key", self.api_key, "a non-empty key, or none")
        if self.model_name is not None and not self.model_name.strip():
            raise KiecError("model_name", self.model_name, "a non-empty name, or none (the model's own)")


def check_serve_extra() -> None:
    """The serve extra's packages are installed (a KiecError naming the missing one, else nothing)."""
    import importlib.util
    for package in ("starlette", "uvicorn"):
        try:
            found = importlib.util.find_spec(package) is not None
        except (ImportError, ValueError):        # a package shadowed by a broken or None module
            found = False
        if not found:
            raise KiecError("serve", f"{package} is not installed", "kiec's serve extra",
                            "pip install 'kiec[serve]'")


def create_app(engine, options: ServeOptions):
    """The Starlette app around `engine` (which it then owns: only its worker thread calls it)."""
    check_serve_extra()
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route
    api = OpenAIRoutes(engine, options)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(api.worker.stop)     # ends the engine thread when the server stops

    routes = [Route("/v1/completions", api.guarded(api.generation(parse_completion)), methods=["POST"]),
              Route("/v1/chat/completions", api.guarded(api.generation(parse_chat)), methods=["POST"]),
              Route("/v1/models", api.guarded(api.models), methods=["GET"]),
              Route("/v1/models/{name:path}", api.guarded(api.model), methods=["GET"]),
              Route("/health", api.guarded(api.health, needs_key=False), methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={HTTPException: api.http_error, Exception: api.failure},
                    lifespan=lifespan)
    app.state.worker = api.worker
    return app


class OpenAIRoutes:
    """The handlers: each checks the key, reads and checks the request, then queues it."""

    def __init__(self, engine, options: ServeOptions):
        self.engine, self.options = engine, options
        self.name = options.model_name or engine.spec.name
        self.served = Served(self.name, engine.max_seq_len, engine.spec.config.vocab)
        self.worker = EngineWorker(engine, options.max_queue)
        self.card = {"id": self.name, "object": "model", "created": int(time.time()), "owned_by": "kiec",
                     "max_model_len": engine.max_seq_len}

    def guarded(self, handler, needs_key: bool = True):
        async def endpoint(request):
            try:
                if needs_key:
                    _authorize(request, self.options.api_key)
                return await handler(request)
            except ApiError as err:
                log.info("%s %s %d: %s", request.method, request.url.path, err.status, err.message)
                return _error(err)
        return endpoint

    def generation(self, parse):
        async def handler(request):
            raw = await _read_body(request, self.options.max_body_bytes)
            gen = await asyncio.to_thread(_parse, parse, raw, self.served, self.engine.tokenizer)
            try:
                job = self.worker.submit(list(gen.prompt), gen.params)
            except QueueFull:
                raise ApiError(503, f"the server is busy: {self.options.max_queue} requests already wait for "
                               "the engine (--max-queue); retry later", None, "queue_full", "server_error") from None
            reply = Reply(gen.kind, self.name, self.engine.tokenizer, gen.params.logprobs is not None)
            done = lambda status, failed: _log_request(request, job, reply, status, failed)   # noqa: E731
            if gen.stream:
                return EventStream(job, reply, gen.include_usage, done)
            return _json(await _collect(job, reply, request.receive, done))
        return handler

    async def models(self, request):
        return _json({"object": "list", "data": [self.card]})

    async def model(self, request):
        asked = request.path_params["name"]
        if asked != self.name:
            raise ApiError(404, f"model {asked!r} not found: this server serves {self.name!r}", "model",
                           "model_not_found")
        return _json(self.card)

    async def health(self, request):
        return _json({"status": "ok", "model": self.name, **self.worker.status()})

    async def http_error(self, request, exc):
        """Starlette's own 404 (no such route) and 405 (wrong method), in OpenAI's shape."""
        return _error(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    async def failure(self, request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return _error(_engine_error(exc))


def _json(body: dict, status: int = 200, headers=None):
    from starlette.responses import JSONResponse
    return JSONResponse(body, status_code=status, headers=headers)


def _error(err: ApiError):
    return _json(err.body(), err.status, {"Retry-After": "1"} if err.status == 503 else None)


def _authorize(request, key: str | None) -> None:
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):   # RFC 7235: any case
        raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                       None, "invalid_api_key")


async def _read_body(request, limit: int) -> bytes:
    """The body, never holding more than `limit` bytes of it."""
    length = request.headers.get("content-length")
    too_big = ApiError(413, f"the request body is larger than {limit} bytes (--max-body-bytes)", None,
                       "request_too_large")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise too_big
    from starlette.requests import ClientDisconnect
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_big
    except ClientDisconnect:         # nobody is left to answer: one line in the log, no traceback
        raise ApiError(400, "the client closed the connection before sending its whole body") from None
    return bytes(body)


def _parse(parse, raw: bytes, served: Served, tokenizer):
    """JSON and fields -> GenerationRequest; runs on a helper thread (parsing and tokenizing take time)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}") from None
    return parse(body, served, tokenizer)


async def _watch_disconnect(receive, job) -> None:
    """Cancels `job` when its client goes away (the engine then stops at the next token)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    job.cancel()


def _engine_error(err: Exception) -> ApiError:
    """An error as the client gets it: the request's fault (400, naming the field), or the server's (500:
    a GPU kernel that stopped itself, or any other failure, is no reason for the client not to retry)."""
    if is_request_error(err):
        return ApiError(400, str(err), err.field)
    if isinstance(err, DeviceError):
        return ApiError(500, f"the GPU failed: {err}", kind="server_error")
    return ApiError(500, f"internal error: {type(err).__name__}", kind="server_error")


async def _collect(job, reply: Reply, receive, done) -> dict:
    watcher = asyncio.create_task(_watch_disconnect(receive, job))
    status, failed = 200, False
    try:
        async for token in job.tokens():
            reply.add(token)
    except KiecError as err:
        error = _engine_error(err)
        status, failed = error.status, True
        raise error from None
    except Exception:                # the engine failed (the worker logged it): the app answers 500
        status, failed = 500, True
        raise
    finally:
        watcher.cancel()
        if reply.finish_reason is None:
            job.cancel()
        done(status, failed)
    return reply.body(job.stats)


class EventStream:
    """A text/event-stream response fed by a job, one `data:` event per token, then [DONE].
    It watches its client itself, so a client that leaves stops the engine at once."""

    def __init__(self, job, reply: Reply, include_usage: bool, done):
        self.job, self.reply, self.include_usage, self.done = job, reply, include_usage, done

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.create_task(_watch_disconnect(receive, self.job))
        failed = False
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            first = self.reply.first_chunk()
            if first is not None:
                await send(_event(first))
            try:
                async for token in self.job.tokens():
                    if self.job.cancelled.is_set():
                        return
                    await send(_event(self.reply.add(token)))
            except OSError:
                raise
            except Exception as err:     # headers are gone: the error travels as an event (the worker logged the server's)
                failed = True
                await send(_event(_engine_error(err).body()))
            if self.include_usage:
                await send(_event(self.reply.usage_chunk(self.job.stats)))
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        except OSError:                  # the client went away while we wrote
            self.job.cancel()
        finally:
            watcher.cancel()
            if self.reply.finish_reason is None:
                self.job.cancel()
            self.done(200, failed)      # the status went out with the headers


def _event(data: dict) -> dict:
    body = b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"
    return {"type": "http.response.body", "body": body, "more_body": True}


def _log_request(request, job, reply: Reply, status: int, failed: bool) -> None:
    s = job.stats
    outcome = reply.finish_reason or ("failed" if failed else "cancelled")
    if s is None:
        left = f", left during its prompt of {len(job.prompt)} tokens" if job.left_in_prompt else ""
        log.info("%s %s %d %s %s: queued %.0f ms%s", request.method, request.url.path, status, reply.id, outcome,
                 job.queued_s * 1e3, left)
        return
    log.info("%s %s %d %s %s: %d prompt tokens (%d cached), %d completion tokens, queued %.0f ms, "
             "first token %.0f ms, %.1f tok/s decode, %.2f s", request.method, request.url.path, status, reply.id, outcome,
             s.prompt_tokens, s.cached_tokens, s.completion_tokens, job.queued_s * 1e3, s.ttft_s * 1e3,
             s.decode_tok_s, s.total_s)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free one; the log says which)."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        family = socket.AF_INET          # a host name such as localhost
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)   # TCP: asyncio then sets TCP_NODELAY
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise KiecError("--host/--port", f"{host}:{port}", "an address this machine can listen on", str(err)) from None
    sock.listen(128)
    return sock


def serve(engine, options: ServeOptions, sock: socket.socket | None = None) -> int:
    """Runs the server until interrupted (Ctrl-C or SIGTERM), on `sock` if given (see `bind`)."""
    import uvicorn
    app = create_app(engine, options)
    sock = sock or bind(options.host, options.port)
    host, port = sock.getsockname()[:2]
    if not _is_loopback(options.host) and options.api_key is None:
        log.warning("listening on %s without an API key: anyone who can reach it can use the model "
                    "(set --api-key or KIEC_API_KEY)", options.host)
    # the address is the command's answer (port 0 picks one): it is printed even with --quiet
    print(f"[kiec] serving {options.model_name or engine.spec.name} on {base_url(host, port)} "
          f"({engine.backend.name} backend, max_seq_len {engine.max_seq_len}, queue {options.max_queue})",
          file=sys.stderr, flush=True)
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:   # uvicorn's start-up chatter
        logging.getLogger("uvicorn").setLevel(logging.WARNING)
    config = uvicorn.Config(app, log_config=None, access_log=False, timeout_graceful_shutdown=5,
                            lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def base_url(host: str, port: int) -> str:
    """The API's root URL on host:port; an IPv6 address goes in brackets."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
