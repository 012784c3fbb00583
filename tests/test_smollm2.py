"""The real SmolLM2-135M-Instruct (Q4_1 GGUF from the package registry): kiec's numpy reference
in fp32 writes the same greedy tokens as transformers' fp32 `generate` on the same file."""
from __future__ import annotations

import numpy as np
import pytest

from refcheck import reference, relative_errors

pytestmark = pytest.mark.slow
PROMPT = "def fibonacci(n):"
STEPS = 32


@pytest.fixture(scope="module")
def kiec_smollm2(smollm2_gguf, one_gguf_parse):
    from kiec.model import load_spec
    from kiec.runtime.tokenizer import load_tokenizer
    spec = load_spec(str(smollm2_gguf), {"max_seq_len": 64})
    return spec, reference(spec, np.float32), load_tokenizer(spec.tokenizer)


def _kiec_greedy(ref, prompt: list, steps: int):
    """Greedy decoding on kiec's reference: the tokens and the logits each step was chosen from."""
    ref.reset()
    logits = [ref.forward(prompt)[-1]]
    tokens = []
    for _ in range(steps):
        tokens.append(int(np.argmax(logits[-1])))
        if len(tokens) < steps:
            logits.append(ref.forward([tokens[-1]])[-1])
    return tokens, np.stack(logits)


@pytest.fixture(scope="module")
def both_greedy(kiec_smollm2, smollm2_hf, smollm2_hf_tokenizer):
    import torch
    spec, ref, tok = kiec_smollm2
    prompt = tok.encode(PROMPT)
    assert prompt == smollm2_hf_tokenizer(PROMPT).input_ids
    ours, our_logits = _kiec_greedy(ref, prompt, STEPS)
    with torch.no_grad():
        out = smollm2_hf.generate(torch.tensor([prompt]), max_new_tokens=STEPS, min_new_tokens=STEPS,
                                  do_sample=False, pad_token_id=smollm2_hf_tokenizer.eos_token_id)
    theirs = out[0, len(prompt):].tolist()
    return prompt, ours, our_logits, theirs


def test_greedy_tokens_identical(both_greedy, smollm2_hf_tokenizer):
    prompt, ours, _, theirs = both_greedy
    assert len(theirs) == STEPS
    assert ours == theirs
    # the continuation checked by hand on the H200 and with transformers
    assert smollm2_hf_tokenizer.decode(theirs).startswith("\n    if n == 0:\n        return 1\n")


def test_greedy_logits_close(both_greedy, smollm2_hf):
    """Each step's logits (kiec fp32, prefill + decode) against one teacher-forced HF fp32 forward."""
    import torch
    prompt, ours, our_logits, _ = both_greedy
    with torch.no_grad():
        hf = smollm2_hf(torch.tensor([prompt + ours[:-1]])).logits[0, len(prompt) - 1:].double().numpy()
    err = relative_errors(our_logits, hf)
    assert err.shape == (STEPS,)
    assert (err <= 1e-4).all(), f"worst step {err.argmax()}: {err.max():.3g}"


def test_decoded_text_round_trips(both_greedy, kiec_smollm2, smollm2_hf_tokenizer):
    _, ours, _, _ = both_greedy
    tok = kiec_smollm2[2]
    text = tok.decode(ours)
    assert text == smollm2_hf_tokenizer.decode(ours)
    pieces = tok.stream_decoder()
    assert "".join(pieces.push(t) for t in ours) == text
