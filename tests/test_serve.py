"""`kiec serve` as clients see it: a real server process on a free localhost port, the real
`openai` client (and raw HTTP for what that client cannot send), answers checked against
the engine run directly on the same model."""
from __future__ import annotations

import asyncio
import http.client
import json
import re
import threading
import time
import urllib.parse

import pytest

# the `test` extra installs the client; a machine without it (the GPU machine runs `pytest -m gpu`,
# and nothing there reaches the package registry) skips the serving tests instead of failing to collect
openai = pytest.importorskip("openai")

from kiec.errors import DeviceError, KiecError
from kiec.runtime.chat import encode_chat
from kiec.runtime.sampling import SamplingParams
from serving import TINY_NAME, ServerProcess, write_tiny_chat_model

KEY = "test-key-0123"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_gguf):
    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), smollm2_gguf)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """The key comes from KIEC_API_KEY; small body limit to test 413 cheaply."""
    proc = ServerProcess(tiny_model, tmp_path_factory.mktemp("log") / "serve.log", "--max-queue", "8",
                         "--max-body-bytes", "65536", env={"KIEC_API_KEY": KEY})
    yield proc.wait_ready()
    proc.stop()


@pytest.fixture(scope="module")
def engine(tiny_model):
    from kiec.model import load_spec
    from kiec.runtime.engine import Engine
    return Engine(load_spec(str(tiny_model)), backend="reference")


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def expected(engine, prompt_ids, **options) -> tuple[str, str, list]:
    """(text, finish_reason, tokens) that the engine alone gives."""
    tokens = list(engine.generate(prompt_ids, SamplingParams(**options)))
    return "".join(t.text for t in tokens), tokens[-1].finish_reason, tokens


def chat_ids(engine, content: str) -> list:
    return encode_chat(engine.tokenizer, [{"role": "user", "content": content}])


def raw(server, method: str, path: str, body=b"", headers=None, chunked=False) -> tuple:
    """(status, headers, JSON body) of one plain HTTP request (a chunked body has no length up front)."""
    url = urllib.parse.urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request(method, path, body=iter([body[i:i + 8192] for i in range(0, len(body), 8192)]) if chunked else body,
                 headers={"Authorization": f"Bearer {KEY}", **(headers or {})}, encode_chunked=chunked)
    response = conn.getresponse()
    status, head, data = response.status, response.headers, response.read()   # headers: any case
    conn.close()
    return status, head, json.loads(data)


def assert_serving(client) -> None:
    answer = client.completions.create(model=TINY_NAME, prompt="still there?", max_tokens=2, temperature=0)
    assert answer.usage.completion_tokens == 2


# --- answers -----------------------------------------------------------------------------------

def test_models_lists_the_served_model(client, engine):
    models = client.models.list().data
    assert [m.id for m in models] == [TINY_NAME]
    assert client.models.retrieve(TINY_NAME).id == TINY_NAME


def test_completion_equals_the_engine(client, engine):
    want, finish, tokens = expected(engine, engine.encode("Once upon a time"), max_tokens=12)
    got = client.completions.create(model=TINY_NAME, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert got.choices[0].text == want and got.choices[0].finish_reason == finish
    assert got.usage.prompt_tokens == len(engine.encode("Once upon a time"))
    assert got.usage.completion_tokens == len(tokens)


def test_top_p_zero_draws_the_greedy_text(client, engine):
    # OpenAI's top_p is in [0, 1]: 0 keeps the most probable token, whatever the temperature
    want, _, _ = expected(engine, engine.encode("Once upon a time"), max_tokens=8)
    got = client.completions.create(model=TINY_NAME, prompt="Once upon a time", max_tokens=8, temperature=1.5,
                                    top_p=0, seed=7)
    assert got.choices[0].text == want


def test_completion_stream_carries_the_same_text(client, engine):
    want, finish, _ = expected(engine, engine.encode("Once upon a time"), max_tokens=12)
    stream = client.completions.create(model=TINY_NAME, prompt="Once upon a time", max_tokens=12,
                                       temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == finish


def test_chat_stream_and_not_equal_the_engine_on_the_chat_template(client, engine):
    ids = chat_ids(engine, "Write a haiku")
    want, finish, _ = expected(engine, ids, max_tokens=10)
    messages = [{"role": "user", "content": "Write a haiku"}]
    got = client.chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=10, temperature=0)
    assert got.choices[0].message.content == want and got.choices[0].finish_reason == finish
    assert got.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=10,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == got.usage.completion_tokens


# one option at a time, at a value that changes this prompt's sampled completion
OPTION_CASES = [("temperature", 1.8), ("top_p", 0.3), ("top_k", 3), ("min_p", 0.3)]
SDK_FIELDS = {"temperature", "top_p", "presence_penalty", "frequency_penalty"}


@pytest.mark.parametrize("name, value", OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
def test_every_sampling_option_reaches_the_engine(client, engine, name, value):
    base = dict(temperature=1.0, seed=1234, max_tokens=16)
    ids = engine.encode("Sampling")
    without, _, _ = expected(engine, ids, **base)
    want, _, _ = expected(engine, ids, **dict(base, **{name: value}))
    assert want != without, f"{name}={value} changes nothing here: the case would not show it arriving"
    options = dict(base, **({name: value} if name in SDK_FIELDS else {}))
    got = client.completions.create(model=TINY_NAME, prompt="Sampling",
                                    extra_body={} if name in SDK_FIELDS else {name: value}, **options)
    assert got.choices[0].text == want


def test_every_sampling_field_lands_in_the_engine_s_params(engine):
    """The penalties change a random model's completion only where it repeats itself, which this tiny one
    does not do soon: each field is checked where the request becomes the engine's SamplingParams."""
    from kiec.runtime.openai_request import Served, parse_chat, parse_completion
    served = Served(TINY_NAME, engine.max_seq_len, engine.spec.config.vocab)
    fields = dict(temperature=0.7, top_p=0.8, top_k=5, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.4,
                  frequency_penalty=-0.6, seed=9, stop=["END"], stop_token_ids=[2], ignore_eos=True)
    for parse, body in ((parse_completion, {"prompt": "hi", "max_tokens": 7}),
                        (parse_chat, {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7})):
        params = parse(dict(body, **fields), served, engine.tokenizer).params
        got = {name: getattr(params, name) for name in fields}
        assert got == dict(fields, stop=("END",), stop_token_ids=(2,)) and params.max_tokens == 7


def test_stop_strings_and_stop_ids_through_the_server(client, engine):
    ids = engine.encode("Stop here")
    free, _, tokens = expected(engine, ids, max_tokens=12, ignore_eos=True)
    stop = free[len(tokens[0].text) + 1: len(tokens[0].text) + 4]     # three characters inside the text
    want = free[: free.find(stop)]
    got = client.completions.create(model=TINY_NAME, prompt="Stop here", max_tokens=12, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert (got.choices[0].text, got.choices[0].finish_reason) == (want, "stop")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=TINY_NAME, prompt="Stop here", max_tokens=12, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == want
    got = client.completions.create(model=TINY_NAME, prompt="Stop here", max_tokens=12, temperature=0,
                                    extra_body={"stop_token_ids": [tokens[2].id], "ignore_eos": True})
    assert got.usage.completion_tokens <= 3 and got.choices[0].finish_reason == "stop"


def test_logprobs_in_openai_shapes(client, engine):
    _, _, tokens = expected(engine, engine.encode("Numbers"), max_tokens=4, logprobs=3)
    got = client.completions.create(model=TINY_NAME, prompt="Numbers", max_tokens=4, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([t.logprob for t in tokens], abs=1e-9)
    assert [len(top) for top in lp.top_logprobs] == [3] * 4
    assert lp.text_offset[0] == 0 and lp.tokens[0] == engine.tokenizer.decode([tokens[0].id])
    _, _, tokens = expected(engine, chat_ids(engine, "Numbers"), max_tokens=4, logprobs=2)
    got = client.chat.completions.create(model=TINY_NAME, messages=[{"role": "user", "content": "Numbers"}],
                                         max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = got.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([t.logprob for t in tokens], abs=1e-9)
    for c, t in zip(content, tokens):
        assert [a.logprob for a in c.top_logprobs] == pytest.approx(list(t.top_logprobs.values()), abs=1e-9)
    assert [c.bytes for c in content] == [list(engine.tokenizer.token_bytes(t.id)) for t in tokens]


def test_chat_logprob_bytes_join_characters_split_over_tokens(engine):
    from kiec.runtime.engine import Token
    from kiec.runtime.openai_response import Reply
    ids = engine.tokenizer.encode("é 😀 日本")
    reply = Reply("chat", TINY_NAME, engine.tokenizer, logprobs=True)
    for i in ids:
        reply.add(Token(id=i, text="", logprob=-1.0, top_logprobs={i: -1.0}))
    parts = reply.body(None)["choices"][0]["logprobs"]["content"]
    assert any("\ufffd" in p["token"] for p in parts)        # the emoji's bytes span tokens
    assert bytes(b for p in parts for b in p["bytes"]).decode() == "é 😀 日本"
    assert [p["top_logprobs"][0]["bytes"] for p in parts] == [p["bytes"] for p in parts]


# --- bad requests: each gets its error, and the server goes on -----------------------------------

BAD_BODIES = [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 3', 400, None, None),
    ("/v1/completions", b'["not", "an", "object"]', 400, None, None),
    ("/v1/completions", b'{"prompt": "hi", "temprature": 0.5}', 400, "temprature", None),
    ("/v1/completions", b'{"model": "gpt-4", "prompt": "hi"}', 404, "model", "model_not_found"),
    ("/v1/completions", b'{"model": "../../etc/passwd", "prompt": "hi"}', 404, "model", "model_not_found"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": -1}', 400, "max_tokens", None),
    ("/v1/completions", b'{"prompt": "hi", "temperature": "hot"}', 400, "temperature", None),
    ("/v1/completions", b'{"prompt": "hi", "top_p": 1.5}', 400, "top_p", None),
    ("/v1/completions", b'{"prompt": "hi", "n": 2}', 400, "n", None),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": 50}', 400, "logprobs", None),
    ("/v1/completions", b'{"prompt": [1, 2, 99999999]}', 400, "prompt", None),
    ("/v1/completions", b'{"prompt": ["one", "two"]}', 400, "prompt", None),
    ("/v1/completions", b'{"prompt": ""}', 400, "prompt", None),
    ("/v1/completions", json.dumps({"prompt": [5] * 1024}).encode(), 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", b'{"prompt": "hi \\ud800 there"}', 400, "prompt", None),
    ("/v1/completions", b'{"prompt": "hi", "n": true}', 400, "n", None),
    ("/v1/completions", b'{"prompt": "hi", "stream_options": {"include_usage": true}}', 400, "stream_options", None),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["ok", ""]}', 400, "stop", None),
    ("/v1/completions", b'{"prompt": "hi", "stop_token_ids": [2, 99999999]}', 400, "stop_token_ids", None),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400, "messages[0].role", None),
    ("/v1/chat/completions", b'{"messages": [{"role": ["user"], "content": "hi"}]}', 400, "messages[0].role", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "prediction": {"type": "content", '
     b'"content": "hi"}}', 400, "prediction", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}', 400,
     "top_logprobs", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\udc00"}]}', 400,
     "messages[0].content", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi", "tool_calls": [{"id": "x"}]}]}', 400,
     "messages[0].tool_calls", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}', 400,
     "max_completion_tokens", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "5", '
     b'"max_completion_tokens": 5}', 400, "max_tokens", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}',
     400, "tools", None),
]


@pytest.mark.parametrize("path, body, status, param, code", BAD_BODIES, ids=lambda v: str(v)[:40])
def test_bad_request_gets_an_openai_error_naming_the_field(server, client, path, body, status, param, code):
    got, _, answer = raw(server, "POST", path, body, {"Content-Type": "application/json"})
    assert got == status
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)
    if param:
        assert error["message"].startswith(param.split("[")[0])
    assert_serving(client)


def test_errors_show_values_as_sent(server):
    _, _, answer = raw(server, "POST", "/v1/completions", b'{"prompt": "hi", "stop": ["ok", ""]}')
    assert "got ['ok', '']" in answer["error"]["message"]


def test_an_answered_assistant_message_goes_back_as_the_sdk_dumps_it(client, engine):
    """The openai SDK's `message.model_dump()` carries refusal, tool_calls, audio ... as null."""
    first = client.chat.completions.create(model=TINY_NAME, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=3, temperature=0)
    said = first.choices[0].message.model_dump()
    assert said["tool_calls"] is None and said["refusal"] is None
    messages = [{"role": "user", "content": "Hi"}, said, {"role": "user", "content": "Again"}]
    again = client.chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=3, temperature=0)
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    want, _, _ = expected(engine, encode_chat(engine.tokenizer, plain), max_tokens=3)
    assert again.choices[0].message.content == want


def test_a_tiny_repetition_penalty_keeps_the_draw_finite(client):
    """Dividing by 1e-310 puts a logit past float64's range; the draw must still be a token."""
    for stream in (False, True):
        answer = client.completions.create(model=TINY_NAME, prompt="hello hello hello", max_tokens=3,
                                           temperature=0.7, seed=1, stream=stream,
                                           extra_body={"repetition_penalty": 1e-310})
        chunks = list(answer) if stream else [answer]
        assert chunks[-1].choices[0].finish_reason == "length"


class FailingJob:
    """A job whose engine raises `error` before its first token."""
    stats = None

    def __init__(self, error):
        self.error, self.cancelled = error, threading.Event()

    async def tokens(self):
        raise self.error
        yield

    def cancel(self):
        self.cancelled.set()


async def _stay():
    await asyncio.sleep(3600)               # the client stays


# an engine's failures as the client sees them: the GPU's (the kernel stopped itself) and the engine's
# own are the server's (500: the client may retry), a KiecError about the request is the client's (400)
ENGINE_FAILURES = [(ValueError("the engine broke"), 500, "server_error"),
                   (DeviceError("kernel", "a counter wait timed out", "a launch that completes"), 500, "server_error"),
                   (KiecError("max_tokens", 0, "a positive count"), 400, "invalid_request_error")]


@pytest.mark.parametrize("error, status, kind", ENGINE_FAILURES, ids=lambda v: type(v).__name__)
def test_a_stream_whose_engine_fails_ends_with_an_error_event_and_done(engine, error, status, kind):
    """Headers are sent before the engine runs, so its failure must travel as an event."""
    from kiec.runtime.openai_response import Reply
    from kiec.runtime.server import EventStream
    sent, logged = [], []

    async def send(message):
        sent.append(message)
    stream = EventStream(FailingJob(error), Reply("completion", TINY_NAME, engine.tokenizer, False), False,
                         lambda *how: logged.append(how))
    asyncio.run(stream({}, _stay, send))
    assert sent[0]["status"] == 200 and sent[-1]["more_body"] is False
    events = b"".join(m.get("body", b"") for m in sent[1:]).decode().split("\n\n")[:-1]
    assert json.loads(events[0][len("data: "):])["error"]["type"] == kind
    assert events[-1] == "data: [DONE]"
    assert logged == [(200, True)]          # the log line: the status sent, and failed (not cancelled)


@pytest.mark.parametrize("error, status, kind", ENGINE_FAILURES, ids=lambda v: type(v).__name__)
def test_an_answer_whose_engine_fails_is_an_error_of_the_right_status(engine, error, status, kind):
    from kiec.runtime.openai_request import ApiError
    from kiec.runtime.openai_response import Reply
    from kiec.runtime.server import _collect
    logged = []
    with pytest.raises(ApiError if isinstance(error, KiecError) else type(error)) as err:
        asyncio.run(_collect(FailingJob(error), Reply("completion", TINY_NAME, engine.tokenizer, False), _stay,
                             lambda *how: logged.append(how)))
    if isinstance(error, KiecError):
        assert (err.value.status, err.value.kind) == (status, kind)
    assert logged == [(status, True)]


def test_the_worker_logs_a_gpu_failure_and_not_a_bad_request(caplog):
    from kiec.runtime.sampling import SamplingParams as Params
    from kiec.runtime.worker import EngineWorker

    class FailingEngine:
        last_stats = None

        def __init__(self, error):
            self.error = error

        def generate(self, prompt, params, cancelled):
            raise self.error
            yield

    async def run(error):
        worker = EngineWorker(FailingEngine(error), 4)
        job = worker.submit([1, 2], Params())
        with pytest.raises(type(error)):
            async for _ in job.tokens():
                pass
        worker.stop()
    for error, status, _ in ENGINE_FAILURES[1:]:
        caplog.clear()
        asyncio.run(run(error))
        assert ("engine failed" in caplog.text) == (status == 500), (error, caplog.text)


def test_an_engine_that_fails_to_start_a_job_fails_it_and_the_worker_goes_on(caplog):
    """An error from the engine's generate call itself (before its first token) reaches the job's client
    and the log; the worker's thread lives on and runs the next job."""
    from kiec.runtime.worker import EngineWorker

    class Unstartable:
        last_stats = None
        calls = 0

        def generate(self, prompt, params, cancelled):
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("no engine today")
            return self.nothing()

        def nothing(self):            # a generator with no tokens, as Engine.generate's would be
            return
            yield

    async def run() -> tuple:
        worker = EngineWorker(Unstartable(), 4)
        first, second = worker.submit([1], None), worker.submit([2], None)
        with pytest.raises(RuntimeError, match="no engine today"):
            async for _ in first.tokens():
                pass
        got = [token async for token in second.tokens()]
        worker.stop()
        return got, worker.status()

    got, status = asyncio.run(run())
    assert got == [] and status["failed"] == 1 and status["completed"] == 1
    assert "engine failed" in caplog.text


def test_the_request_log_says_failed_and_the_status_sent(caplog):
    import logging
    from types import SimpleNamespace
    from kiec.runtime.server import _log_request
    request = SimpleNamespace(method="POST", url=SimpleNamespace(path="/v1/completions"))
    job = SimpleNamespace(stats=None, queued_s=0.001, cancelled=threading.Event(), prompt=[1, 2, 3], left_in_prompt=False)
    reply = SimpleNamespace(id="cmpl-1", finish_reason=None)
    with caplog.at_level(logging.INFO, logger="kiec"):
        _log_request(request, job, reply, 500, True)
        _log_request(request, job, reply, 200, False)
        job.left_in_prompt = True
        _log_request(request, job, reply, 200, False)
    assert "POST /v1/completions 500 cmpl-1 failed" in caplog.text
    assert "POST /v1/completions 200 cmpl-1 cancelled: queued 1 ms\n" in caplog.text
    assert "200 cmpl-1 cancelled: queued 1 ms, left during its prompt of 3 tokens" in caplog.text


def test_a_body_cut_short_by_its_client_is_a_plain_error():
    from starlette.requests import ClientDisconnect
    from kiec.runtime.openai_request import ApiError
    from kiec.runtime.server import _read_body

    class Leaving:
        headers = {"content-length": "100"}

        async def stream(self):
            yield b"{}"
            raise ClientDisconnect()
    with pytest.raises(ApiError, match="closed the connection"):
        asyncio.run(_read_body(Leaving(), 1000))


def test_the_address_printed_is_a_url_for_ipv6_too():
    from kiec.runtime.server import base_url
    assert base_url("127.0.0.1", 8000) == "http://127.0.0.1:8000/v1"
    assert base_url("::1", 8000) == "http://[::1]:8000/v1"


def test_fields_the_sdk_sends_that_change_nothing_are_accepted(client, engine):
    """Identifiers and cache hints are ignored; fields kiec cannot honour pass when null, as sent unused."""
    want, _, _ = expected(engine, chat_ids(engine, "Hi"), max_tokens=4)
    got = client.chat.completions.create(model=TINY_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                         temperature=0, extra_body={"prompt_cache_key": "abc", "safety_identifier": "u1",
                                                                    "prompt_cache_retention": "24h", "prediction": None,
                                                                    "audio": None, "modalities": []})
    assert got.choices[0].message.content == want


def test_unknown_field_error_suggests_the_near_name(server):
    _, _, answer = raw(server, "POST", "/v1/completions", b'{"prompt": "hi", "temprature": 0.5}')
    assert "did you mean 'temperature'" in answer["error"]["message"]


def test_the_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=TINY_NAME, prompt="hi", max_tokens=-3)
    assert err.value.body["param"] == "max_tokens"
    assert_serving(client)


def test_api_key_is_required(server, client):
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, _, answer = raw(server, "GET", "/v1/models", headers=headers)
        assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    for scheme in ("Bearer", "bearer", "BEARER"):          # RFC 7235: the scheme is case-insensitive
        assert raw(server, "GET", "/v1/models", headers={"Authorization": f"{scheme} {KEY}"})[0] == 200
    status, _, _ = raw(server, "POST", "/v1/completions", b'{"prompt": "hi"}', {"Authorization": "Bearer x"})
    assert status == 401
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert_serving(client)


def test_body_over_the_limit_is_413(server, client):
    body = json.dumps({"prompt": "x" * 70_000}).encode()
    status, _, answer = raw(server, "POST", "/v1/completions", body)
    assert status == 413 and answer["error"]["code"] == "request_too_large"
    status, _, _ = raw(server, "POST", "/v1/completions", body, chunked=True)
    assert status == 413
    assert_serving(client)


def test_unknown_route_and_method_are_openai_shaped(server):
    status, _, answer = raw(server, "GET", "/v1/engines")
    assert status == 404 and "error" in answer
    status, _, answer = raw(server, "GET", "/v1/completions")
    assert status == 405 and "error" in answer


def test_binds_loopback_by_default(server):
    assert server.url.startswith("http://127.0.0.1:")


# --- several clients at once -------------------------------------------------------------------

def test_concurrent_clients_each_get_their_own_answer(server, engine):
    jobs = [(i, f"client {i} asks about topic {i * 7}", i % 2 == 0) for i in range(8)]
    want = {i: expected(engine, chat_ids(engine, text), temperature=1.0, seed=100 + i, max_tokens=6)[0]
            for i, text, _ in jobs}
    got, errors = {}, []
    start = threading.Barrier(len(jobs))

    def ask(i, text, stream):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        start.wait()
        try:
            args = dict(model=TINY_NAME, messages=[{"role": "user", "content": text}], temperature=1.0,
                        seed=100 + i, max_tokens=6)
            if stream:
                got[i] = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                    stream=True, **args))
            else:
                got[i] = client.chat.completions.create(**args).choices[0].message.content
        except Exception as err:     # reported below with the request it belongs to
            errors.append((i, err))
    threads = [threading.Thread(target=ask, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and got == want


def open_stream(server, max_tokens: int):
    """A long streaming completion, read up to its first token; (connection, response)."""
    url = urllib.parse.urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    body = json.dumps({"prompt": "a long story", "max_tokens": max_tokens, "stream": True, "temperature": 0,
                       "ignore_eos": True})
    conn.request("POST", "/v1/completions", body=body, headers={"Authorization": f"Bearer {KEY}"})
    response = conn.getresponse()
    assert response.status == 200
    while not response.readline().startswith(b"data: {"):
        pass
    return conn, response


def health(server) -> dict:
    return raw(server, "GET", "/health")[2]


def wait_for(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def send_only(server, body: dict):
    """A request whose answer is never read: the connection, to close while it waits."""
    url = urllib.parse.urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Authorization": f"Bearer {KEY}"})
    return conn


def test_requests_wait_in_order_and_leaving_clients_free_the_engine(server, client):
    before = health(server)
    conn, _ = open_stream(server, max_tokens=1000)
    finished = []

    def ask(i):
        answer = client.completions.create(model=TINY_NAME, prompt=f"queued {i}", max_tokens=2, temperature=0)
        finished.append((i, answer.id))
    threads, leaver = [], None
    for i in range(4):       # each one enters the queue before the next is sent
        threads.append(threading.Thread(target=ask, args=(i,)))
        threads[-1].start()
        wait_for(lambda: health(server)["waiting"] == len(threads) + (leaver is not None))
        if i == 1:           # a client that gives up while it waits is never run
            leaver = send_only(server, {"prompt": "I will leave", "max_tokens": 500, "stream": True})
            wait_for(lambda: health(server)["waiting"] == 3)
    assert finished == [] and health(server)["running"]
    leaver.close()
    conn.close()             # the streaming client leaves: its generation stops, the queue moves
    for t in threads:
        t.join(timeout=60)
    log = server.log()
    assert sorted(i for i, _ in finished) == [0, 1, 2, 3]
    assert sorted(finished, key=lambda done: log.index(done[1])) == sorted(finished), "answered out of order"
    after = health(server)
    assert after["cancelled"] == before["cancelled"] + 2
    assert after["completed"] == before["completed"] + 4
    cancelled = re.findall(r"200 cmpl-\w+ cancelled: \d+ prompt tokens \(\d+ cached\), (\d+) completion tokens", log)
    assert cancelled and int(cancelled[-1]) < 1000
    assert re.search(r"200 cmpl-\w+ cancelled: queued", log)


def test_a_job_cancelled_while_its_prompt_goes_in_counts_as_cancelled_not_failed():
    """The engine stops a cancelled job between chunks of its prompt (Cancelled): the worker counts it
    cancelled, logs no error, sends its client nothing and goes on to the next job."""
    import asyncio
    from kiec.errors import Cancelled
    from kiec.runtime.worker import EngineWorker

    class LongPrompt:                 # an engine whose prompt goes in until the job is cancelled
        last_stats = None

        def generate(self, prompt, params, cancelled):
            while not cancelled():
                time.sleep(0.005)
            raise Cancelled("after the first chunk")
            yield                     # a generator, as Engine.generate is

    async def run() -> tuple:
        worker = EngineWorker(LongPrompt(), max_queue=2)
        job = worker.submit([1, 2, 3], None)
        await asyncio.sleep(0.05)
        job.cancel()
        got = [token async for token in job.tokens()]
        worker.stop()
        return got, job, worker.status()

    got, job, status = asyncio.run(run())
    assert got == [] and job.left_in_prompt
    assert status["cancelled"] == 1 and status["failed"] == 0 and not status["running"]


def test_a_waiting_client_that_leaves_frees_its_place_in_the_queue(tiny_model, tmp_path):
    proc = ServerProcess(tiny_model, tmp_path / "serve.log", "--max-queue", "1").wait_ready()
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        conn, _ = open_stream(proc, max_tokens=1000)
        for _ in range(3):          # each leaves before the engine reaches it
            leaver = send_only(proc, {"prompt": "I will leave", "max_tokens": 5})
            wait_for(lambda: health(proc)["waiting"] == 1)
            leaver.close()
            wait_for(lambda: health(proc)["waiting"] == 0)
        waiting = threading.Thread(target=assert_serving, args=(client,))
        waiting.start()             # the one place in the queue is free again
        wait_for(lambda: health(proc)["waiting"] == 1)
        assert health(proc)["rejected"] == 0
        conn.close()
        waiting.join(timeout=60)
        assert not waiting.is_alive()
        wait_for(lambda: health(proc)["cancelled"] == 4)
    finally:
        proc.stop()


def test_full_queue_answers_503_and_the_server_recovers(tiny_model, tmp_path):
    proc = ServerProcess(tiny_model, tmp_path / "serve.log", "--max-queue", "1").wait_ready()
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        conn, _ = open_stream(proc, max_tokens=1000)
        waiting = threading.Thread(target=assert_serving, args=(client,))
        waiting.start()
        wait_for(lambda: health(proc)["waiting"] == 1)
        status, headers, answer = raw(proc, "POST", "/v1/completions", b'{"prompt": "one too many"}')
        assert status == 503 and answer["error"]["code"] == "queue_full" and headers["Retry-After"] == "1"
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=TINY_NAME, prompt="one too many", max_tokens=2)
        conn.close()
        waiting.join(timeout=60)
        assert not waiting.is_alive()
        assert_serving(client)
        assert health(proc)["rejected"] == 2
    finally:
        proc.stop()


# --- a soak of sequential requests, each checked against the engine -------------------------------

def test_soak_of_sequential_requests_loses_and_mixes_nothing(server, client, engine):
    lines_before = server.log().count("tok/s decode")
    for i in range(240):
        text, seed, stream, chat = f"soak request {i}", 1000 + i, i % 3 == 0, i % 2 == 0
        ids = chat_ids(engine, text) if chat else engine.encode(text)
        want = expected(engine, ids, temperature=1.0, seed=seed, max_tokens=4)[0]
        args = dict(model=TINY_NAME, temperature=1.0, seed=seed, max_tokens=4, stream=stream)
        if chat:
            answer = client.chat.completions.create(messages=[{"role": "user", "content": text}], **args)
            got = "".join(c.choices[0].delta.content or "" for c in answer) if stream \
                else answer.choices[0].message.content
        else:
            answer = client.completions.create(prompt=text, **args)
            got = "".join(c.choices[0].text for c in answer) if stream else answer.choices[0].text
        assert got == want, f"request {i}"
    wait_for(lambda: server.log().count("tok/s decode") >= lines_before + 240)   # one log line each


# --- the real SmolLM2 -----------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_chat_through_the_server_equals_the_engine(tmp_path):
    from kiec.model import load_spec
    from kiec.runtime.engine import Engine
    proc = ServerProcess("smollm2", tmp_path / "serve.log")        # loads while this process does too
    try:
        engine = Engine(load_spec("smollm2"), backend="reference")
        question = "What is the capital of France?"
        want, finish, _ = expected(engine, chat_ids(engine, question), max_tokens=24)
        client = openai.OpenAI(base_url=proc.wait_ready().url + "/v1", api_key="unused", max_retries=0,
                               timeout=120)
        got = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=24, temperature=0,
                                             messages=[{"role": "user", "content": question}])
        assert got.choices[0].message.content == want and got.choices[0].finish_reason == finish
        assert "Paris" in want
    finally:
        proc.stop()


@pytest.mark.parametrize("field, value, expected", [
    ("port", 70000, "an integer in [0, 65535]"), ("max_body_bytes", 100, "an integer >= 1024"),
    ("max_queue", -1, "an integer >= 0"), ("api_key", " ", "a non-empty key, or none"),
    ("model_name", "", "a non-empty name, or none (the model's own)")])
def test_serve_options_name_a_bad_value(field, value, expected):
    from kiec.errors import KiecError
    from kiec.runtime.server import ServeOptions
    with pytest.raises(KiecError, match=re.escape(f"{field}: got {value!r}; expected {expected}")):
        ServeOptions(**{field: value})
