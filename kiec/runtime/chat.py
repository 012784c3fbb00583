"""Conversations: the prompt tokens of a list of messages, and `kiec chat` in a terminal.

The prompt is rendered by the model's own chat template (`Tokenizer.apply_chat`), the
same for the terminal chat, `kiec run --chat` and the server's /v1/chat/completions,
so the three give one model the same tokens for the same conversation.
"""
from __future__ import annotations

import sys

COMMANDS_HELP = "/reset starts a new conversation, /exit (or /quit, or end of input) leaves, /help says this"


def encode_chat(tokenizer, messages: list) -> list[int]:
    """Token ids of `messages` ([{role, content}]) followed by the assistant's turn."""
    text = tokenizer.apply_chat(messages)
    bos = tokenizer.special.get("bos")
    # a template that writes the BOS token itself must not get a second one from encode
    return tokenizer.encode(text, add_special=not (bos and text.startswith(bos)))


class ChatSession:
    """One conversation with the engine, kept as messages and re-rendered each turn
    (the engine's prefix reuse makes the repeated part cheap)."""

    def __init__(self, engine, params, system: str | None = None):
        self.engine, self.params = engine, params
        self.start = [{"role": "system", "content": system}] if system else []
        self.messages = list(self.start)
        self.tokens = []      # the last answer's tokens (their logprobs with --logprobs)

    def reset(self) -> None:
        self.messages = list(self.start)

    def reply(self, text: str, out) -> str:
        """Streams the assistant's answer to `text` into `out` and keeps both in the conversation."""
        ids = encode_chat(self.engine.tokenizer, self.messages + [{"role": "user", "content": text}])
        if len(ids) >= self.engine.max_seq_len:
            raise ContextFull(len(ids), self.engine.max_seq_len)
        self.messages.append({"role": "user", "content": text})
        answer, self.tokens = "", []
        try:
            for token in self.engine.generate(ids, self.params):
                out.write(token.text)
                out.flush()
                answer += token.text
                self.tokens.append(token)
        finally:      # an interrupted answer stays in the conversation as far as it got
            self.messages.append({"role": "assistant", "content": answer})
            out.write("\n")
            out.flush()
        return answer


class ContextFull(Exception):
    def __init__(self, tokens: int, limit: int):
        super().__init__(f"the conversation is {tokens} tokens, the model's max_seq_len is {limit}; "
                         "/reset to start a new one")


def chat_loop(session: ChatSession, stdin=None, out=None, err=None, quiet: bool = False) -> int:
    """Reads user lines until /exit or end of input; the answers stream to `out`, status to `err`."""
    stdin, out, err = stdin or sys.stdin, out or sys.stdout, err or sys.stderr
    interactive = stdin.isatty()
    if interactive and not quiet:
        print(f"[kiec] chatting with {session.engine.spec.name}; {COMMANDS_HELP}", file=err)
    while True:
        try:
            line = _read_line(stdin, out, interactive)
        except KeyboardInterrupt:
            return 0
        text = "" if line is None else line.strip()
        if line is None or text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            session.reset()
            print("[kiec] new conversation", file=err)
            continue
        if text.startswith("/") and " " not in text:      # a command, not a message: "/usr/bin is?" is one
            print(f"[kiec] {'' if text == '/help' else f'no command {text}: '}{COMMANDS_HELP}", file=err)
            continue
        if not text:
            continue
        try:
            session.reply(text, out)
        except ContextFull as full:
            print(f"[kiec] {full}", file=err)
            out.write("\n")                 # still one answer line per message read from a pipe
            out.flush()
            continue
        except KeyboardInterrupt:       # Ctrl-C stops the answer, not the chat
            continue
        if session.params.logprobs is not None:
            print_logprobs(session.engine.tokenizer, session.tokens, err)
        if not quiet:
            s = session.engine.last_stats
            print(f"[kiec] {s.completion_tokens} tokens, first after {s.ttft_s * 1e3:.0f} ms, "
                  f"{s.decode_tok_s:.1f} tok/s", file=err)


def print_logprobs(tokenizer, tokens, err) -> None:
    """One line per token: the token, its logprob, the alternatives (`--logprobs N`)."""
    show = lambda t: repr(tokenizer.decode([t], skip_special=False))   # noqa: E731
    for token in tokens:
        alternatives = "  ".join(f"{show(t)} {lp:.3f}" for t, lp in token.top_logprobs.items())
        print(f"{show(token.id):>16} {token.logprob:8.3f}  {alternatives}", file=err)


def _read_line(stdin, out, interactive: bool):
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())
        try:
            return input("> ")
        except EOFError:
            out.write("\n")
            return None
    line = stdin.readline()
    return line if line else None
