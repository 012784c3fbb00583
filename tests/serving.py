"""Helpers for the serving tests: a tiny random model that speaks SmolLM2's tokenizer, and a
real `kiec serve` process on a free localhost port."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

TINY_NAME = "tiny-chat"


def write_tiny_chat_model(folder: Path, tokenizer_gguf) -> Path:
    """model.json of a 2-layer random llama with SmolLM2's vocabulary, tokenizer and chat template."""
    from kiec.synthetic import preset, write_random_model
    config = preset("tiny-llama", vocab_size=49152, max_position_embeddings=1024)
    write_random_model(folder, config, seed=3, dtype="fp32")
    path = folder / "model.json"
    path.write_text(json.dumps({"name": TINY_NAME, "architecture": "llama", "config": config,
                                "weights": str(folder / "model.safetensors"), "tokenizer": str(tokenizer_gguf)}))
    return path


def kiec_command(*args) -> list:
    return [sys.executable, "-m", "kiec.cli", *map(str, args)]


class ServerProcess:
    """`kiec serve MODEL --port 0 ...` in a subprocess; its log goes to a file the tests read."""

    def __init__(self, model, log_path: Path, *args, env: dict | None = None):
        self.log_path = log_path
        self.log_file = open(log_path, "w")
        self.proc = subprocess.Popen(kiec_command("serve", model, "--backend", "reference", "--port", "0", *args),
                                     stdout=subprocess.DEVNULL, stderr=self.log_file,
                                     env=dict(os.environ, **(env or {})))
        self.url = None

    def wait_ready(self, timeout: float = 180) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(r"serving \S+ on (http://[\d.]+:\d+)/v1", self.log())
            if found:
                self.url = found.group(1)
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"kiec serve exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.1)
        raise RuntimeError(f"kiec serve did not start in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log_file.close()
