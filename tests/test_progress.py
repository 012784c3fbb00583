"""Progress bars: redrawn in place on a terminal, one line per step elsewhere, and fed by the
reference backend's weight loading."""
from __future__ import annotations

import io

from kiec.progress import ProgressBar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_bar_redraws_in_place_and_ends_with_a_newline():
    screen = Terminal()
    bar = ProgressBar(screen, min_interval=0.0)
    for done in range(5):
        bar("convert weights", done, 4)
    text = screen.getvalue()
    assert text.count("\r") == 5 and text.endswith("4/4 0.0 s\x1b[K\n")
    assert "[############------------] 2/4" in text


def test_in_a_log_each_step_writes_one_line_when_it_ends():
    log = io.StringIO()
    bar = ProgressBar(log)
    for step, total in (("open weights", 1), ("convert weights", 3)):
        for done in range(total + 1):
            bar(step, done, total)
    lines = log.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["open", "convert"] and "\r" not in log.getvalue()
    assert lines[1].startswith("[kiec] convert weights [########################] 3/3 ")


def test_the_reference_backend_reports_every_weight(tiny_llama):
    from kiec.model import load_spec
    from kiec.pipeline import build_graph
    from kiec.runtime.engine import ReferenceBackend
    spec = load_spec(str(tiny_llama))
    calls = []
    ReferenceBackend(spec, progress=lambda step, done, total: calls.append((step, done, total)))
    weights = len(build_graph(spec).weights())
    assert calls[:2] == [("open weights", 0, 1), ("open weights", 1, 1)]
    assert calls[2:] == [("convert weights", n, weights) for n in range(1, weights + 1)]


def test_a_long_prompt_on_the_reference_goes_in_chunks_with_its_progress(tiny_llama):
    """Past PROMPT_CHUNK tokens the reference backend shows the prompt's progress, chunk by chunk; the
    logits are the one-pass forward's (to float rounding: numpy's products take other shapes)."""
    import numpy as np
    from kiec.model import load_spec
    from kiec.runtime.engine import PROMPT_CHUNK, ReferenceBackend
    spec = load_spec(str(tiny_llama), {"max_seq_len": 512})
    tokens = [int(t) for t in np.random.default_rng(0).integers(spec.config.vocab, size=PROMPT_CHUNK + 44)]
    seen = []
    shown = ReferenceBackend(spec, progress=lambda step, done, total: seen.append((step, done, total)))
    got = shown.forward(tokens, 0)
    assert [s for s in seen if s[0] == "prompt"] == [("prompt", 0, len(tokens)), ("prompt", PROMPT_CHUNK, len(tokens)),
                                                     ("prompt", len(tokens), len(tokens))]
    want = ReferenceBackend(spec).forward(tokens, 0)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5)      # equal bits here; float rounding allowed
    seen.clear()
    shown.forward(tokens[:PROMPT_CHUNK], 0)          # a prompt of one chunk: no bar
    assert not seen


def test_a_request_cancelled_while_its_prompt_goes_in_stops_at_the_next_chunk(tiny_llama):
    """A long prompt on the reference goes in chunks; where the request is cancelled (its client left)
    the engine stops at the next chunk with Cancelled, and the cache keeps the prefix it had before: the
    same prompt afterwards gives the logits of a fresh start."""
    from types import SimpleNamespace
    import numpy as np
    import pytest
    from kiec.model import load_spec
    from kiec.errors import Cancelled
    from kiec.runtime.engine import PROMPT_CHUNK, Engine, ReferenceBackend
    from kiec.runtime.sampling import SamplingParams
    spec = load_spec(str(tiny_llama), {"max_seq_len": 512})
    prompt = [int(t) for t in np.random.default_rng(1).integers(spec.config.vocab, size=100 + PROMPT_CHUNK + 44)]
    backend = ReferenceBackend(spec)
    engine = Engine(spec, backend=backend, tokenizer=SimpleNamespace(vocab_size=spec.config.vocab, eos_ids=()))
    backend.forward(prompt[:100], 0)
    engine.cached = prompt[:100]
    asked = []
    with pytest.raises(Cancelled, match=f"after {PROMPT_CHUNK} of the prompt's {len(prompt) - 100} tokens"):
        next(engine.generate(prompt, SamplingParams(max_tokens=1), lambda: asked.append(1) or True))
    assert len(asked) == 1 and engine.cached == prompt[:100]
    again = backend.forward(prompt[100:], 100)
    assert np.allclose(again, ReferenceBackend(spec).forward(prompt, 0), rtol=1e-5, atol=1e-5)
