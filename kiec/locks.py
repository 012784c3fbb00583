"""One process at a time in a folder: an advisory lock (flock) on a file beside what it guards.

Two `kiec run`s of one model, or the test suite's workers, may build the same kernel folder at once:
ninja in both would compile the same object and write the same log. Whoever comes second waits for
the first, then finds its work done. POSIX only, as the toolchains kiec drives are.
"""
from __future__ import annotations

import fcntl
import sys
from contextlib import contextmanager
from pathlib import Path

from .errors import KiecError


@contextmanager
def held(lock_file: Path, waiting: str | None = None):
    """Holds `lock_file`'s lock for the block; says `waiting` on stderr if another process holds it."""
    try:
        f = open(lock_file, "a")
    except OSError as err:
        raise KiecError("lock file", str(lock_file), "a file kiec can create and write", err.strerror) from None
    with f:
        try:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if waiting:
                    print(f"[kiec] {waiting}", file=sys.stderr)
                fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as err:          # a file system that takes no locks (some FUSE mounts), no locks left
            raise KiecError("lock file", str(lock_file), "a file on a file system that takes locks (flock)",
                            err.strerror) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
