"""The engine's `Token`s -> OpenAI response bodies and stream chunks (completions and chat).

One `Reply` per request gathers its tokens; it writes the non-streaming body at the
end, or a chunk per token when streaming. Logprob shapes follow OpenAI: completions
report {tokens, token_logprobs, top_logprobs, text_offset}, chat {content: [{token,
logprob, bytes, top_logprobs}]}.
"""
from __future__ import annotations

import time
import uuid


class Reply:
    def __init__(self, kind: str, model: str, tokenizer, logprobs: bool):
        self.kind, self.model, self.tokenizer, self.logprobs = kind, model, tokenizer, logprobs
        self.id = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text = ""
        self.finish_reason = None
        self.logprob_parts: list = []      # the logprob entries of every token, in the kind's shape

    def add(self, token) -> dict:
        """Takes one token; returns the stream chunk that carries it."""
        offset = len(self.text)
        self.text += token.text
        self.finish_reason = token.finish_reason or self.finish_reason
        part = self._logprob_part(token, offset) if self.logprobs else None
        if part is not None:
            self.logprob_parts.append(part)
        return self._chunk({"content": token.text} if self.kind == "chat" else token.text,
                           self._logprobs([part]) if part is not None else None, token.finish_reason)

    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant's role; completion streams have no opening chunk."""
        return self._chunk({"role": "assistant", "content": ""}, None, None) if self.kind == "chat" else None

    def usage_chunk(self, stats) -> dict:
        return dict(self._head(), choices=[], usage=usage(stats))

    def body(self, stats) -> dict:
        """The whole non-streaming response."""
        choice = {"index": 0, "logprobs": self._logprobs(self.logprob_parts) if self.logprobs else None,
                  "finish_reason": self.finish_reason}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": self.text}
        else:
            choice["text"] = self.text
        return dict(self._head(stream=False), choices=[choice], usage=usage(stats))

    def _head(self, stream: bool = True) -> dict:
        kind = "text_completion" if self.kind == "completion" else \
            "chat.completion.chunk" if stream else "chat.completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(self, delta, logprobs, finish) -> dict:
        choice = {"index": 0, "logprobs": logprobs, "finish_reason": finish}
        if self.kind == "chat":
            choice["delta"] = delta
        else:
            choice["text"] = delta
        return dict(self._head(), choices=[choice])

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special=False)

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        """A token's text decoded alone, and its own bytes: those of a character split over tokens
        join up again, where the text shows U+FFFD."""
        return {"token": self._token_text(token_id), "logprob": logprob,
                "bytes": list(self.tokenizer.token_bytes(token_id))}

    def _logprob_part(self, token, offset: int):
        if token.logprob is None:
            return None
        if self.kind == "completion":
            top = {self._token_text(t): lp for t, lp in token.top_logprobs.items()}
            return (self._token_text(token.id), token.logprob, top, offset)
        return dict(self._chat_entry(token.id, token.logprob),
                    top_logprobs=[self._chat_entry(t, lp) for t, lp in token.top_logprobs.items()])

    def _logprobs(self, parts: list) -> dict:
        if self.kind == "chat":
            return {"content": parts}
        return {"tokens": [p[0] for p in parts], "token_logprobs": [p[1] for p in parts],
                "top_logprobs": [p[2] for p in parts], "text_offset": [p[3] for p in parts]}


def usage(stats) -> dict:
    prompt = stats.prompt_tokens if stats else 0
    completion = stats.completion_tokens if stats else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens if stats else 0}}
