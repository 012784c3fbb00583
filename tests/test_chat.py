"""`kiec chat` driven through its stdin, as a person's terminal would, checked against the
engine run directly on the same conversation."""
from __future__ import annotations

import subprocess

import pytest

from kiec.runtime.chat import encode_chat
from kiec.runtime.sampling import SamplingParams
from serving import kiec_command, write_tiny_chat_model

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_gguf):
    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), smollm2_gguf)


@pytest.fixture(scope="module")
def engine(tiny_model):
    from kiec.model import load_spec
    from kiec.runtime.engine import Engine
    return Engine(load_spec(str(tiny_model)), backend="reference")


def answer(engine, messages) -> str:
    ids = encode_chat(engine.tokenizer, messages)
    return "".join(t.text for t in engine.generate(ids, SamplingParams(max_tokens=MAX_TOKENS)))


def chat(model, stdin: str, *flags) -> subprocess.CompletedProcess:
    return subprocess.run(kiec_command("chat", model, "--backend", "reference", "--max-tokens", MAX_TOKENS, *flags),
                          input=stdin, capture_output=True, text=True, timeout=120)


def test_chat_keeps_the_conversation_resets_and_exits(tiny_model, engine):
    first = answer(engine, [{"role": "user", "content": "hello"}])
    second = answer(engine, [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first},
                             {"role": "user", "content": "tell me more"}])
    run = chat(tiny_model, "hello\ntell me more\n/reset\nhello\n/exit\nnever read\n", "--quiet")
    assert run.returncode == 0, run.stderr
    assert run.stdout == first + "\n" + second + "\n" + first + "\n"
    assert "new conversation" in run.stderr and "convert weights" not in run.stderr


def test_end_of_input_ends_the_chat_and_status_goes_to_stderr(tiny_model, engine):
    with_system = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "bonjour"}]
    run = chat(tiny_model, "\nbonjour\n", "--system", "Answer in French.")
    assert run.returncode == 0, run.stderr
    assert run.stdout == answer(engine, with_system) + "\n"          # the empty line asked nothing
    assert "convert weights" in run.stderr and "tok/s" in run.stderr  # progress and the speed line


def test_a_message_beyond_the_context_is_refused_and_the_chat_goes_on(tiny_model, engine):
    short = answer(engine, [{"role": "user", "content": "hi"}])
    run = chat(tiny_model, "word " * 60 + "\nhi\n", "--max-seq-len", "48", "--quiet")
    assert run.returncode == 0, run.stderr
    assert run.stdout == "\n" + short + "\n"           # the refused message's answer line is empty
    assert "max_seq_len is 48" in run.stderr


def test_a_word_after_a_slash_is_a_command_not_a_message(tiny_model, engine):
    """/help and an unknown /word are answered on stderr, /quit leaves; a message with a space that starts
    with a slash goes to the model."""
    path = answer(engine, [{"role": "user", "content": "/usr/bin is what?"}])
    run = chat(tiny_model, "/help\n/foo\n/usr/bin is what?\n/quit\nnever read\n", "--quiet")
    assert run.returncode == 0, run.stderr
    assert run.stdout == path + "\n"
    lines = run.stderr.splitlines()
    assert lines[0].startswith("[kiec] /reset starts a new conversation") and lines[1].startswith("[kiec] no command /foo: ")


def test_logprobs_print_a_line_per_token_of_each_answer(tiny_model):
    run = chat(tiny_model, "hello\nagain\n", "--quiet", "--logprobs", "2")
    assert run.returncode == 0, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 2 * MAX_TOKENS and all(len(line.split()) >= 6 for line in lines)   # token, logprob, 2 pairs
