"""Every sampling option is honoured: frequencies of many draws against the reference
distribution (chi-square), exact penalties, seeds, stop strings and ids, max_tokens and
logprobs through the real engine on a tiny random model."""
from __future__ import annotations

import argparse
import dataclasses
import math

import numpy as np
import pytest

from kiec.errors import KiecError
from kiec.runtime.sampling import Sampler, SamplingParams, StopStrings
from serving import write_tiny_chat_model

DRAWS = 20_000
LOGITS = np.random.default_rng(7).normal(0.0, 1.5, 12)      # one fixed position, 12 tokens
Z_999 = 3.0902                                               # standard normal quantile at 0.999


def reference_distribution(logits, temperature, top_k=0, top_p=1.0, min_p=0.0) -> list:
    """The documented definition, written out in plain Python, independent of Sampler."""
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    probs = [w / sum(weights) for w in weights]

    def keep_only(kept):
        mass = sum(probs[i] for i in kept)
        return [probs[i] / mass if i in kept else 0.0 for i in range(len(probs))]
    ranked = sorted(range(len(probs)), key=lambda i: -probs[i])
    if top_k:
        kth = probs[ranked[top_k - 1]]
        probs = keep_only({i for i in ranked if probs[i] >= kth})
    if top_p < 1.0:
        kept, mass = set(), 0.0
        for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
            kept.add(i)
            mass += probs[i]
            if mass >= top_p:
                break
        probs = keep_only(kept)
    if min_p:
        probs = keep_only({i for i in range(len(probs)) if probs[i] >= min_p * max(probs)})
    return probs


def draw(params: SamplingParams, n: int = DRAWS) -> np.ndarray:
    sampler = Sampler(params)
    return np.bincount([sampler.sample(LOGITS, [])[0] for _ in range(n)], minlength=len(LOGITS))


def chi_square(counts: np.ndarray, probs) -> tuple[float, float]:
    """(statistic, its 0.999 quantile) over the support; cells expecting < 5 draws are pooled."""
    n = counts.sum()
    expected = n * np.asarray(probs)
    support = expected > 0
    big = support & (expected >= 5)
    obs = list(counts[big]) + ([counts[support & ~big].sum()] if (support & ~big).any() else [])
    exp = list(expected[big]) + ([expected[support & ~big].sum()] if (support & ~big).any() else [])
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    quantile = df * (1 - 2 / (9 * df) + Z_999 * math.sqrt(2 / (9 * df))) ** 3   # Wilson-Hilferty
    return stat, quantile


OPTIONS = [
    dict(temperature=0.7),
    dict(temperature=1.0),
    dict(temperature=1.6),
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.3, top_k=6, top_p=0.6),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.8, top_k=8, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_draw_frequencies_follow_the_reference_distribution(options):
    probs = reference_distribution(LOGITS, **options)
    params = SamplingParams(seed=1234, **options)
    np.testing.assert_allclose(Sampler(params).probabilities(LOGITS, []), probs, rtol=1e-12, atol=1e-15)
    counts = draw(params)
    assert all(counts[i] == 0 for i in range(len(probs)) if probs[i] == 0), "a filtered-out token was drawn"
    stat, quantile = chi_square(counts, probs)
    assert stat < quantile, f"chi-square {stat:.1f} >= {quantile:.1f}: draws do not follow {options}"


@pytest.mark.parametrize("drawn, claimed", [
    (dict(temperature=1.0), dict(temperature=1.15)),
    (dict(temperature=1.0, top_k=4), dict(temperature=1.0, top_k=3)),
    (dict(temperature=1.0, top_p=0.8), dict(temperature=1.0, top_p=0.7)),
])
def test_the_frequency_test_tells_options_apart(drawn, claimed):
    """The check above has power: draws under one option fail against a nearby other one."""
    probs = reference_distribution(LOGITS, **claimed)
    counts = draw(SamplingParams(seed=99, **drawn))
    impossible = any(counts[i] > 0 for i in range(len(probs)) if probs[i] == 0)
    stat, quantile = chi_square(counts, probs)
    assert impossible or stat > quantile


def test_greedy_takes_the_argmax_and_top_k_1_is_greedy():
    best = int(np.argmax(LOGITS))
    assert Sampler(SamplingParams()).sample(LOGITS, [])[0] == best
    assert set(np.flatnonzero(draw(SamplingParams(temperature=2.0, top_k=1, seed=0), 500))) == {best}


def greedy_run(logits, steps, history=(), **penalties) -> list:
    sampler = Sampler(SamplingParams(**penalties))
    return [sampler.sample(np.array(logits), list(history))[0] for _ in range(steps)]


def test_frequency_penalty_grows_with_each_use_and_ignores_the_prompt():
    # 3 (1.2) -> 3 at 0.9 < 2 (1.0) -> 2 at 0.7 < 3 -> 3 at 0.6 < 2 -> 2 at 0.4 < 3 -> 3 at 0.3 < 1 (0.5)
    assert greedy_run([0.0, 0.5, 1.0, 1.2], 6, history=[3, 3, 3], frequency_penalty=0.3) == [3, 2, 3, 2, 3, 1]


def test_presence_penalty_is_paid_once_per_token():
    # 0 (1.0) -> 0 at 0.8 < 1 (0.9) -> 1 at 0.7 < 0 -> 0 stays at 0.8, above 1: 0 again
    assert greedy_run([1.0, 0.9, 0.0], 4, presence_penalty=0.2) == [0, 1, 0, 0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    assert greedy_run([1.0, 0.8], 1, history=[0], repetition_penalty=1.5) == [1]     # 1.0 / 1.5 < 0.8
    assert greedy_run([-1.0, -1.2], 1, history=[0], repetition_penalty=1.5) == [1]   # -1.0 * 1.5 < -1.2
    sampler = Sampler(SamplingParams(temperature=1.0, repetition_penalty=2.0))
    got = sampler.probabilities(np.array([2.0, -1.0, 0.5, 3.0]), [0, 1])
    want = np.exp([1.0, -2.0, 0.5, 3.0]) / np.exp([1.0, -2.0, 0.5, 3.0]).sum()
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_same_seed_same_draws_other_seed_other_draws():
    def run(seed):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [sampler.sample(LOGITS, [])[0] for _ in range(300)]
    assert run(5) == run(5)
    assert run(5) != run(6)


def test_top_p_zero_keeps_the_most_probable_token_alone():
    # OpenAI's range is [0, 1]: the smallest set whose mass reaches 0 is the top token
    probs = Sampler(SamplingParams(temperature=1.0, top_p=0.0)).probabilities(LOGITS, [])
    assert list(probs) == reference_distribution(LOGITS, 1.0, top_p=0.0)
    assert probs[int(np.argmax(LOGITS))] == 1.0 and set(draw(SamplingParams(temperature=1.0, top_p=0.0), 50).nonzero()[0]) \
        == {int(np.argmax(LOGITS))}


def test_a_negative_seed_is_an_int64_seed():
    # OpenAI's seed is an int64: -1 draws as 2**64 - 1 does, and again the same
    def run(seed):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [sampler.sample(LOGITS, [])[0] for _ in range(200)]
    assert run(-1) == run(2 ** 64 - 1) == run(-1) != run(-2)


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", True), ("top_k", -1),
    ("top_k", 2.5), ("top_p", -0.1), ("top_p", 1.5), ("min_p", 1.1), ("repetition_penalty", 0.0),
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("seed", -2 ** 63 - 1), ("seed", 2 ** 64), ("seed", "7"),
    ("max_tokens", 0),
    ("max_tokens", -5), ("stop", ("",)), ("stop", "END"), ("stop_token_ids", (-1,)), ("logprobs", 21),
    ("ignore_eos", "yes"),
])
def test_invalid_values_are_refused_naming_the_field(field, value):
    with pytest.raises(KiecError) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field and str(err.value).startswith(f"{field}: got ")


def test_stop_strings_hold_back_a_possible_beginning():
    stops = StopStrings(["lo w"])
    assert stops.push("he") == ("he", False)
    assert stops.push("l") == ("", False)              # "l" may begin "lo w"
    assert stops.push("lo wor") == ("l", True)         # "l" + "lo wor": the stop starts at the second l
    free = StopStrings(["xyz"])
    assert free.push("abx") == ("ab", False)
    assert free.push("q") == ("xq", False)             # "xq" cannot begin "xyz" any more
    assert free.push("xy") == ("", False)
    assert free.flush() == "xy"


# --- through the engine, on a tiny random model with SmolLM2's tokenizer ---------------------------

@pytest.fixture(scope="module")
def engine(tmp_path_factory, smollm2_gguf):
    from kiec.model import load_spec
    from kiec.runtime.engine import Engine
    model = write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), smollm2_gguf)
    return Engine(load_spec(str(model)), backend="reference")


PROMPT = "The quick brown fox"


def generate(engine, **options):
    return list(engine.generate(engine.encode(PROMPT), SamplingParams(ignore_eos=True, **options)))


def test_engine_same_seed_same_tokens_whatever_ran_before(engine):
    first = [t.id for t in generate(engine, temperature=1.0, seed=21, max_tokens=12)]
    generate(engine, temperature=1.0, seed=3, max_tokens=5)                      # changes the cache
    assert [t.id for t in generate(engine, temperature=1.0, seed=21, max_tokens=12)] == first
    assert [t.id for t in generate(engine, temperature=1.0, seed=22, max_tokens=12)] != first


def test_max_tokens_is_exact_and_ends_with_length(engine):
    tokens = generate(engine, max_tokens=7)
    assert len(tokens) == 7 and [t.finish_reason for t in tokens] == [None] * 6 + ["length"]


def test_stop_token_ids_end_the_completion_at_the_first_one(engine):
    free = generate(engine, max_tokens=10)
    stop = free[3].id
    first = next(i for i, t in enumerate(free) if t.id == stop)
    tokens = generate(engine, max_tokens=10, stop_token_ids=(stop,))
    assert [t.id for t in tokens] == [t.id for t in free[: first + 1]]
    assert tokens[-1].finish_reason == "stop" and tokens[-1].text == ""


def test_stop_string_split_across_tokens_is_cut_and_never_streamed(engine):
    free = generate(engine, max_tokens=16)
    pieces = [t.text for t in free]
    text = "".join(pieces)

    def split_stop(i):     # the last 2 characters of token i and the first 2 of token i + 1
        return pieces[i][-2:] + pieces[i + 1][:2]
    at = next(i for i in range(2, len(free) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2
              and text.find(split_stop(i)) == len("".join(pieces[: i + 1])) - 2)
    tokens = generate(engine, max_tokens=16, stop=(split_stop(at),))
    streamed = [t.text for t in tokens]
    assert len(tokens) == at + 2 and tokens[-1].finish_reason == "stop"
    assert streamed[:at] == pieces[:at]
    assert streamed[at] == pieces[at][:-2], "the stop string's first half was streamed before it completed"
    assert streamed[at + 1] == "" and "".join(streamed) == text[: text.find(split_stop(at))]


def test_held_back_text_is_given_when_no_stop_string_comes(engine):
    free = generate(engine, max_tokens=6)
    text = "".join(t.text for t in free)
    # a stop string that begins with the completion's last two characters but never completes
    tokens = generate(engine, max_tokens=6, stop=(text[-2:] + "\x00",))
    assert "".join(t.text for t in tokens) == text and tokens[-1].finish_reason == "length"


class ScriptedBackend:
    """Logits that make greedy decoding pick `script`'s tokens in turn."""
    name = "scripted"

    def __init__(self, script, vocab: int, max_seq_len: int = 64):
        self.script, self.vocab, self.max_seq_len = list(script), vocab, max_seq_len

    def forward(self, tokens, start, cancelled=None):
        logits = np.zeros(self.vocab, np.float32)
        logits[self.script.pop(0)] = 1.0
        return logits


def scripted(engine, script, **options) -> list:
    from kiec.runtime.engine import Engine
    tok = engine.tokenizer
    scripted_engine = Engine(engine.spec, backend=ScriptedBackend(script, tok.vocab_size), tokenizer=tok)
    return list(scripted_engine.generate(tok.encode(PROMPT), SamplingParams(**options)))


@pytest.mark.parametrize("end", ["length", "eos"])
def test_the_last_token_gives_its_whole_characters(engine, end):
    """A token can end with a character's first bytes: what comes before them is text, at the last token too."""
    from test_tokenizer import _char_then_partial
    tok = engine.tokenizer
    hi, partial, eos = tok.encode(" hi")[0], _char_then_partial(tok), tok.eos_ids[0]
    script = [hi, partial] + ([eos] if end == "eos" else [])
    tokens = scripted(engine, script, max_tokens=2 if end == "length" else 3)
    assert "".join(t.text for t in tokens) == tok.decode([hi, partial])
    assert tokens[-1].finish_reason == ("length" if end == "length" else "stop")


def test_a_stop_string_in_a_token_with_a_partial_character_stops_there(engine):
    from test_tokenizer import _char_then_partial
    tok = engine.tokenizer
    hi, partial = tok.encode(" hi")[0], _char_then_partial(tok)
    whole = tok.decode([partial])[:-1]
    for script in ([hi, partial], [hi, partial, hi, hi]):     # the stop in the last token, and before it
        tokens = scripted(engine, script, max_tokens=len(script), stop=(whole,))
        assert len(tokens) == 2 and tokens[-1].finish_reason == "stop"
        assert "".join(t.text for t in tokens) == " hi"


def test_a_token_id_past_the_vocabulary_is_refused(engine):
    with pytest.raises(KiecError, match=r"prompt: got 49152; expected token ids in \[0, 49152\)"):
        next(engine.generate([1, 49152], SamplingParams(max_tokens=2)))
    from kiec.runtime.gpu import check_token_ids            # the GPU backend's own check, for its other callers
    check_token_ids([0, 4], 5)
    for bad in (5, -1):
        with pytest.raises(KiecError, match=f"token: got {bad}; expected token ids in \\[0, 5\\)"):
            check_token_ids([1, bad], 5)


def test_a_tokenizer_past_the_model_s_vocabulary_is_said_at_load(engine, caplog):
    from kiec.runtime.engine import Engine
    tok = engine.tokenizer
    small = engine.spec.replace(config=dataclasses.replace(engine.spec.config, vocab=256))
    with caplog.at_level("WARNING", logger="kiec"):
        Engine(small, backend=ScriptedBackend([], 256), tokenizer=tok)
    assert f"the tokenizer knows {tok.vocab_size} tokens and {small.name} has 256 embedding rows" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="kiec"):
        Engine(engine.spec, backend=ScriptedBackend([], tok.vocab_size), tokenizer=tok)
    assert caplog.text == ""


def test_logprobs_are_the_log_softmax_of_the_model_logits(engine):
    from kiec.runtime.engine import ReferenceBackend
    # the options reshape what is drawn from, not the logprobs: those stay the model's own
    tokens = generate(engine, temperature=0.7, top_k=5, repetition_penalty=1.3, seed=8, max_tokens=5, logprobs=4)
    backend = ReferenceBackend(engine.spec)          # a second model, outside the engine's cache
    prompt = engine.encode(PROMPT)
    for i, token in enumerate(tokens):
        logits = backend.forward(prompt + [t.id for t in tokens[:i]], 0).astype(np.float64)
        logp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        assert token.logprob == pytest.approx(logp[token.id], abs=1e-4)
        best = np.argsort(-logp)[:4]
        assert list(token.top_logprobs) == [int(b) for b in best]
        assert list(token.top_logprobs.values()) == pytest.approx(logp[best], abs=1e-4)


def test_cli_sampling_flags_reach_sampling_params():
    from kiec.cli_args import add_sampling_args, sampling_from_args
    parser = argparse.ArgumentParser()
    add_sampling_args(parser)
    args = parser.parse_args("--max-tokens 9 --temperature 0.5 --top-k 7 --top-p 0.8 --min-p 0.02 "
                             "--repetition-penalty 1.1 --presence-penalty 0.3 --frequency-penalty -0.2 --seed 4 "
                             "--stop END --stop ### --stop-token-id 2 --logprobs 3 --ignore-eos".split())
    assert sampling_from_args(args) == SamplingParams(
        max_tokens=9, temperature=0.5, top_k=7, top_p=0.8, min_p=0.02, repetition_penalty=1.1, presence_penalty=0.3,
        frequency_penalty=-0.2, seed=4, stop=("END", "###"), stop_token_ids=(2,), logprobs=3, ignore_eos=True)


def test_kiec_run_streams_what_the_engine_generates(engine, capsys):
    from kiec.cli import main
    options = dict(temperature=0.9, top_k=40, seed=17, max_tokens=8)
    want = "".join(t.text for t in generate(engine, **options))
    assert main(["run", engine.spec.source, "--backend", "reference", "--prompt", PROMPT, "--quiet",
                 "--temperature", "0.9", "--top-k", "40", "--seed", "17", "--max-tokens", "8",
                 "--ignore-eos", "--logprobs", "2"]) == 0
    out, err = capsys.readouterr()
    assert out == PROMPT + want + "\n"
    assert len(err.strip().splitlines()) == 8        # one logprob line per token
