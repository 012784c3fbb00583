"""The README tells the truth: its first two commands are the ones CI runs, its model.json example
parses (every key of model.json shown), and the commands it lists exist."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kiec.model import SPEC_KEYS, load_spec
from kiec.synthetic import preset, write_random_model

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
RUN_COMMAND = 'python3 -m pip install -e . && kiec run --prompt "def fibonacci(n):"'
TEST_COMMAND = 'python3 -m pip install -e ".[test,golden]" torch==2.13.0 && python3 -m pytest -q'


def _blocks(language: str) -> list:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.S | re.M)


def test_readme_starts_with_the_run_and_test_commands():
    first, second = _blocks("bash")[:2]
    assert first.strip() == RUN_COMMAND
    assert second.strip() == TEST_COMMAND
    assert README.index(RUN_COMMAND) < README.index("## ")      # before any section


def test_ci_runs_exactly_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.startswith("#!/usr/bin/env bash")
    assert "set -euo pipefail" in ci
    assert TEST_COMMAND in ci.splitlines()


def test_readme_shows_the_continuation_the_golden_test_checks():
    shown = _blocks("text")[0]
    assert shown.startswith('def fibonacci(n):\n    if n == 0:\n        return 1\n')


def _example() -> dict:
    (text,) = _blocks("json")
    return json.loads(text)


def test_model_json_example_has_every_key():
    assert list(_example()) == list(SPEC_KEYS)
    for key in SPEC_KEYS:
        assert f"| `{key}` |" in README, f"model.json key {key} is not in the README's table"


def test_model_json_example_parses(tmp_path):
    raw = _example()
    checkpoint = tmp_path / Path(raw["weights"]).parent
    write_random_model(checkpoint, preset("tiny-llama", max_position_embeddings=8192), seed=3)
    (tmp_path / raw["tokenizer"]).write_text("{}")
    path = tmp_path / "model.json"
    path.write_text(json.dumps(raw))
    spec = load_spec(str(path))
    assert spec.name == raw["name"] and spec.config.arch == raw["architecture"]
    assert spec.weights == str(tmp_path / raw["weights"])
    assert spec.tokenizer == str(tmp_path / raw["tokenizer"])
    assert (spec.target, spec.lanes, spec.gpus, spec.dtp_delay, spec.max_seq_len, spec.dtype) == (
        raw["target"], raw["lanes"], raw["gpus"], raw["dtp_delay"], raw["max_seq_len"], raw["dtype"])
    # the other forms the table names: the config inline, the weights as a folder
    inline = dict(raw, config=json.loads((checkpoint / "config.json").read_text()), weights=str(checkpoint),
                  tokenizer=spec.tokenizer)
    assert load_spec(inline).config == spec.config


def test_every_listed_command_exists(capsys):
    from kiec import cli
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    choices = next(c for c in re.findall(r"\{([\w,]+)\}", capsys.readouterr().out) if "run" in c.split(","))
    listed = re.findall(r"^\| `kiec (\w+)", README, flags=re.M)
    assert listed, "the README lists no commands"
    assert set(listed) == set(choices.split(",")), f"README lists {sorted(listed)}, kiec has {choices}"
