"""How the loader words a refusal (file, key, reason) and shows untrusted values in it."""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Any

from moelora.adapter_weights import AdapterLoadError


def _fail(file: Path | str, reason: str, key: str | None = None) -> AdapterLoadError:
    where = f"{file}: key {key!r}: " if key is not None else f"{file}: "
    return AdapterLoadError(where + reason)


_BRIEF = reprlib.Repr()
_BRIEF.maxstring = _BRIEF.maxother = 80
_BRIEF.maxlevel = 2


def _brief(v: Any) -> str:
    """A short repr of an untrusted JSON value for a message: bounded length, and bounded depth (a plain
    repr of a deeply nested value could itself raise RecursionError)."""
    return _BRIEF.repr(v)


def _json_type(v: Any) -> str:
    """The JSON name of a parsed value's type, for messages."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return f"number ({_brief(v)})"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else type(v).__name__
