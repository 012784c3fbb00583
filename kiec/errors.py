"""The one error type users see: it names the field, the value and what was expected; and the
exceptions the runtime raises beside it (a device's failure, a cancelled request)."""
from __future__ import annotations

import difflib


class KiecError(Exception):
    """A user-facing error. The CLI prints it as one line, without a traceback."""

    def __init__(self, field: str, value, expected: str, hint: str = ""):
        self.field, self.value, self.expected, self.hint = field, value, expected, hint
        text = f"{field}: got {_show(value)}; expected {expected}"
        super().__init__(text + (f" ({hint})" if hint else ""))


class DeviceError(KiecError):
    """The GPU kernel stopped itself (a bounded wait ran out) or a CUDA/HIP call failed."""


class Cancelled(Exception):
    """A request cancelled (its client left) while its prompt went in: not an error of the request or
    the server. The engine's cache keeps the prefix it had before."""


def is_request_error(err: BaseException) -> bool:
    """A KiecError about what was asked (the client's to mend); a DeviceError, or any other exception,
    is the server's."""
    return isinstance(err, KiecError) and not isinstance(err, DeviceError)


def is_int(value) -> bool:
    """An int, not a bool: JSON's true and false are ints to Python, and a count or an index given as true
    must be refused, not read as 1."""
    return isinstance(value, int) and not isinstance(value, bool)


def first_outside(values, size: int):
    """The first of `values` outside [0, size) (token ids against a vocabulary), or None."""
    return next((v for v in values if not 0 <= v < size), None)


def is_number(value) -> bool:
    """An int or a float, not a bool (as is_int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def writable_folder(field: str, path):
    """`path` made if need be; a KiecError naming `field` where it cannot be (a file is in the way,
    no permission, a read-only disk), before any work is spent on what would go there."""
    from pathlib import Path
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise KiecError(field, str(path), "a folder kiec can create and write", err.strerror) from None
    return path


def nearest(word: str, known) -> str:
    """'did you mean' text for an unknown key; empty when nothing is close."""
    match = difflib.get_close_matches(word, list(known), n=1, cutoff=0.5)
    return f"did you mean {match[0]!r}?" if match else ""
