"""GpuBackend's bookkeeping around launches, with a stand-in for the compiled module (no GPU): the
step counter the kernel's epochs count from must stay true to the device's counters whatever fails."""
from __future__ import annotations

import numpy as np
import pytest

from kiec.errors import Cancelled, KiecError
from kiec.runtime.gpu import GpuBackend


class StandInKernel:
    """What GpuBackend calls on the module; `refuse` makes the next launch raise as the C API does."""

    def __init__(self):
        self.calls, self.refuse, self.written = [], None, 0

    def launch(self, forced, n_steps, start, step_base, *rest):
        self.calls.append(("launch", int(step_base)))
        if self.refuse:
            raise RuntimeError(self.refuse)
        self.written = n_steps

    def poll(self):
        return np.zeros(self.written, np.uint32)

    def finish(self):
        self.calls.append(("finish",))
        return [0] * 8, 1.0

    def reset(self):
        self.calls.append(("reset",))

    def prefill(self, tokens, start, profile):
        self.calls.append(("prefill", int(start), len(tokens)))
        return 2.0, []

    def read(self, region, offset, nbytes):
        return np.zeros(nbytes, np.uint8)


def backend() -> GpuBackend:
    b = GpuBackend.__new__(GpuBackend)          # no build, no device: only the launch bookkeeping
    b.kernel, b.max_seq_len, b.vocab, b.timeout_s = StandInKernel(), 64, 100, 1.0
    b.step_base, b.running = 0, False
    b.use_prefill, b.info, b.logits_offset = True, {"prefill_chunk": 4}, 0
    return b


def test_steps_count_on_and_wrap_at_32_bits():
    b = backend()
    b._launch([1, 2], 5, 0)
    b._finish()
    assert b.step_base == 5 and not b.running
    b.step_base = 0xFFFFFFFE                     # the kernel's counters wrap at 32 bits, and so does the base
    b._launch([1], 4, 5)
    b._finish()
    assert b.step_base == 2


def test_a_refused_launch_resets_the_counters_and_the_base_together():
    b = backend()
    b._launch([1], 3, 0)
    b._finish()
    b.kernel.refuse = "bad launch: 0 steps"
    with pytest.raises(RuntimeError, match="bad launch"):
        b._launch([1], 3, 3)
    assert b.kernel.calls[-2:] == [("launch", 3), ("reset",)] and b.step_base == 0 and not b.running
    b.kernel.refuse = None
    b._launch([1], 1, 3)
    assert b.kernel.calls[-1] == ("launch", 0)


def test_no_launch_while_one_runs():
    b = backend()
    b._launch([1], 3, 0)
    with pytest.raises(KiecError, match="launch: got 'another'"):
        b._launch([1], 3, 3)
    assert [c[0] for c in b.kernel.calls] == ["launch"]        # the running one untouched, nothing reset
    b._finish()
    b._launch([1], 1, 3)
    assert b.kernel.calls[-1] == ("launch", 3)


def test_a_prompt_cancelled_during_its_prefill_stops_at_the_next_chunk():
    """Without a cancel check the prompt (all but its last token) is one prefill call; with one, a call a
    kernel chunk (4 tokens here), asked between them: a cancel after the first chunk stops there."""
    b = backend()
    b.forward(list(range(11)), 0)
    assert [c for c in b.kernel.calls if c[0] == "prefill"] == [("prefill", 0, 10)] and b.last_prefill_ms == 2.0
    b = backend()
    b.forward(list(range(11)), 5, cancelled=lambda: False)
    assert [c for c in b.kernel.calls if c[0] == "prefill"] == [("prefill", 5, 4), ("prefill", 9, 4), ("prefill", 13, 2)]
    assert b.last_prefill_ms == 6.0 and ("finish",) in b.kernel.calls
    b = backend()
    asked = []
    with pytest.raises(Cancelled, match="after 4 of the prompt's 11 tokens"):
        b.forward(list(range(11)), 0, cancelled=lambda: asked.append(1) or True)
    assert [c[0] for c in b.kernel.calls] == ["prefill"] and len(asked) == 1 and b.last_prefill_ms == 2.0
    b = backend()                                   # a bad id in a later chunk: refused before the first
    with pytest.raises(KiecError, match="token ids in"):
        b.forward([1] * 9 + [100, 1], 0, cancelled=lambda: False)
    assert b.kernel.calls == []
