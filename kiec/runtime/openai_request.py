"""OpenAI request bodies -> a `GenerationRequest` (prompt token ids + SamplingParams).

Every field is checked here, once: an unknown field, a wrong type or an out-of-range
value is an `ApiError` naming the field (`param`), the value and what was expected, in
OpenAI's error shape. Nothing in a request is ever used as a path: `model` is only
compared with the served model's name.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import KiecError, first_outside, is_int, nearest
from .chat import encode_chat
from .sampling import SamplingParams

# fields OpenAI clients send that change nothing here
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier",
           "prompt_cache_key", "prompt_cache_retention"}
# fields of OpenAI's API that kiec cannot honour: accepted as null or empty (as clients send them unused)
UNSUPPORTED = {"modalities", "audio", "prediction", "reasoning_effort", "verbosity", "functions", "function_call",
               "web_search_options"}
SAMPLING = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos"}
COMMON = {"model", "stream", "stream_options", "n", "logit_bias"} | SAMPLING | IGNORED
COMPLETION_FIELDS = COMMON | {"prompt", "max_tokens", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON | {"messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
                        "tools", "tool_choice", "response_format"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MESSAGE_FIELDS = {"role", "content", "name"}
EMPTY = (None, [], {})     # what clients send in a message's other fields (refusal, tool_calls, ...) when unused


class ApiError(Exception):
    """An error answer: HTTP status and OpenAI's {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(param: str, value, expected: str, status: int = 400, code: str | None = None) -> ApiError:
    return ApiError(status, str(KiecError(param, value, expected)), param, code)


@dataclass(frozen=True)
class Served:
    """What a request is checked against: the one model this server serves."""
    name: str
    max_seq_len: int
    vocab: int


@dataclass(frozen=True)
class GenerationRequest:
    kind: str                 # "completion" or "chat"
    prompt: tuple             # token ids
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False


def parse_completion(body, served: Served, tokenizer) -> GenerationRequest:
    _check_common(body, COMPLETION_FIELDS, served)
    for name, allowed in (("echo", (False,)), ("best_of", (1,)), ("suffix", ("",))):
        if body.get(name) not in (None,) + allowed:
            raise invalid(name, body[name], f"{allowed[0]!r} or null: not supported by kiec")
    ids = _prompt_ids(body.get("prompt"), served, tokenizer)
    logprobs = body.get("logprobs")
    if logprobs is not None and (not is_int(logprobs) or not 0 <= logprobs <= 20):
        raise invalid("logprobs", logprobs, "an integer in [0, 20] (alternatives per token) or null")
    params = _sampling(body, served, max_tokens=_get(body, "max_tokens", 16), logprobs=logprobs)
    return _request("completion", ids, "prompt", params, body, served)


def parse_chat(body, served: Served, tokenizer) -> GenerationRequest:
    _check_common(body, CHAT_FIELDS, served)
    for name in ("tools", "tool_choice"):
        if body.get(name) not in (None, [], "none"):
            raise invalid(name, body[name], "null: kiec does not call tools")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise invalid("response_format", fmt, '{"type": "text"} or null: kiec writes free text only')
    messages = _messages(body.get("messages"))
    try:
        ids = encode_chat(tokenizer, messages)
    except KiecError as err:           # the template's own raise_exception
        raise ApiError(400, str(err), "messages") from None
    wants = _get(body, "logprobs", False)
    if not isinstance(wants, bool):
        raise invalid("logprobs", wants, "true or false")
    top = _get(body, "top_logprobs", 0)
    if not is_int(top) or not 0 <= top <= 20:
        raise invalid("top_logprobs", top, "an integer in [0, 20]")
    if top and not wants:
        raise invalid("top_logprobs", top, "to come with logprobs: true")
    max_tokens = served.max_seq_len
    for name in ("max_tokens", "max_completion_tokens"):    # the newer name wins where both come
        value = body.get(name)
        if value is not None and (not is_int(value) or value < 1):
            raise invalid(name, value, "a positive integer")
        max_tokens = _get(body, name, max_tokens)
    params = _sampling(body, served, max_tokens=max_tokens, logprobs=top if wants else None)
    return _request("chat", ids, "messages", params, body, served)


def _get(body: dict, name: str, default):
    """A field's value; null means the default, as OpenAI clients send it."""
    value = body.get(name)
    return default if value is None else value


def _check_common(body, known: set, served: Served) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body: got {type(body).__name__}; expected a JSON object")
    for name in body:
        if name in UNSUPPORTED:
            if body[name] not in EMPTY:
                raise invalid(name, body[name], f"null or absent: kiec does not support {name}")
            continue
        if name not in known:
            hint = nearest(name, known)
            raise ApiError(400, f"{name}: unknown field; expected one of {', '.join(sorted(known))}"
                           + (f" ({hint})" if hint else ""), name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", model, "the served model's name (a string)")
    if model is not None and model != served.name:
        raise ApiError(404, f"model {model!r} not found: this server serves {served.name!r}", "model",
                       "model_not_found")
    n = _get(body, "n", 1)
    if not is_int(n) or n != 1:
        raise invalid("n", n, "1: one sequence at a time (batch size 1)")
    if body.get("logit_bias") not in (None, {}):
        raise invalid("logit_bias", body["logit_bias"], "null or {}: not supported by kiec")
    if not isinstance(_get(body, "stream", False), bool):
        raise invalid("stream", body["stream"], "true or false")
    options = _get(body, "stream_options", {})
    if not isinstance(options, dict) or set(options) - {"include_usage"} \
            or not isinstance(options.get("include_usage", False), bool):
        raise invalid("stream_options", options, '{"include_usage": true or false}')
    if options and not _get(body, "stream", False):
        raise invalid("stream_options", options, 'null unless "stream" is true')


def _sampling(body: dict, served: Served, max_tokens, logprobs) -> SamplingParams:
    stop = _get(body, "stop", ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else stop
    ids = _get(body, "stop_token_ids", ())
    ids = tuple(ids) if isinstance(ids, list) else ids
    values = dict(temperature=_get(body, "temperature", 1.0), top_p=_get(body, "top_p", 1.0),
                  top_k=_get(body, "top_k", 0), min_p=_get(body, "min_p", 0.0),
                  repetition_penalty=_get(body, "repetition_penalty", 1.0),
                  presence_penalty=_get(body, "presence_penalty", 0.0),
                  frequency_penalty=_get(body, "frequency_penalty", 0.0), seed=body.get("seed"),
                  max_tokens=max_tokens, stop=stop, stop_token_ids=ids, logprobs=logprobs,
                  ignore_eos=_get(body, "ignore_eos", False))
    try:
        params = SamplingParams(**values)
    except KiecError as err:           # shown as sent (stop as a list, not the tuple it became)
        raise invalid(err.field, body.get(err.field, err.value), err.expected) from None
    try:
        params.check_vocab(served.vocab)
    except KiecError as err:
        raise invalid(err.field, err.value, err.expected) from None
    return params


def _request(kind: str, ids: list, field: str, params, body: dict, served: Served) -> GenerationRequest:
    if not ids:
        raise invalid(field, "", "text that makes at least one token")
    if len(ids) >= served.max_seq_len:
        raise ApiError(400, f"{field}: got {len(ids)} tokens; expected fewer than the model's max_seq_len "
                       f"({served.max_seq_len}), leaving room to generate", field, "context_length_exceeded")
    options = _get(body, "stream_options", {})
    return GenerationRequest(kind, tuple(ids), params, _get(body, "stream", False),
                             bool(options.get("include_usage", False)))


def _prompt_ids(prompt, served: Served, tokenizer) -> list:
    """A string, a list of token ids, or either of them alone in a list (one prompt per request)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(_text(prompt, "prompt"))
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        bad = first_outside(prompt, served.vocab)
        if bad is not None:
            raise invalid("prompt", bad, f"token ids in [0, {served.vocab})")
        return list(prompt)
    raise invalid("prompt", prompt, "one prompt: a string or a list of token ids (batch size 1)")


def _messages(messages) -> list:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", messages, "a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(where, m, "an object with role, content (and optionally name)")
        for key in sorted(set(m) - MESSAGE_FIELDS):
            if m[key] not in EMPTY:
                raise invalid(f"{where}.{key}", m[key], "null or empty: kiec reads role, content and name only "
                              "(tool calls are not supported)")
        if not isinstance(m.get("role"), str) or m["role"] not in ROLES:
            raise invalid(f"{where}.role", m.get("role"), " / ".join(ROLES))
        out.append({"role": ROLES[m["role"]], "content": _content(m.get("content"), f"{where}.content")})
    return out


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return _text(content, where)
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return _text("".join(p["text"] for p in content), where)
    raise invalid(where, content, 'a string or a list of {"type": "text", "text": ...} parts')


def _text(text: str, where: str) -> str:
    """JSON's \\u escapes can spell half of a UTF-16 pair, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise invalid(where, text[max(0, err.start - 20): err.end + 20],
                      "valid Unicode text (a lone UTF-16 surrogate, \\ud800-\\udfff, is not)") from None
    return text
