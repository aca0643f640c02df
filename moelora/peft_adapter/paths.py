"""The adapter directory: the names of its files, and the checks of a path before anything is read."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from moelora.adapter_weights import AdapterLoadError
from moelora.peft_adapter.messages import _brief, _fail

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
BIN_NAME = "adapter_model.bin"


def check_adapter_path(path: Any) -> Path:
    """``path`` as a :class:`~pathlib.Path`, refusing what cannot name an adapter directory.

    Call it before resolving a path: ``Path("")`` is the current directory, so an empty (or
    whitespace-only) path would silently load whatever adapter lies there.

    Raises:
        TypeError: ``path`` is not a ``str`` or an ``os.PathLike`` of one (``None``, bytes, a number, ...).
        AdapterLoadError: ``path`` is empty, only whitespace, or holds a NUL character.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            "adapter path must be a str or os.PathLike (a directory), got "
            f"{type(path).__name__} {_brief(path)}"
        )
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"adapter path must be a str or os.PathLike of a str, got {type(text).__name__}")
    if not text.strip():
        raise AdapterLoadError(
            f"adapter path is empty ({text!r}): an empty path would read the current directory; "
            f"pass the adapter directory (holding {CONFIG_NAME} and {WEIGHTS_NAME})"
        )
    if "\0" in text:
        raise AdapterLoadError(f"adapter path {text!r} holds a NUL character")
    return Path(text)


def _check_files(adir: Path, cfg_file: Path, w_file: Path) -> None:
    """The adapter directory holds a regular config and safetensors file (a clear message for each miss)."""
    if not adir.exists():
        raise _fail(adir, "adapter directory does not exist")
    if not adir.is_dir():
        raise _fail(
            adir, f"not a directory: an adapter is a directory holding {CONFIG_NAME} and {WEIGHTS_NAME}"
        )
    if not cfg_file.exists():
        raise _fail(cfg_file, "missing: a PEFT adapter directory must hold adapter_config.json")
    if not w_file.exists():
        if (adir / BIN_NAME).exists():
            raise _fail(
                adir / BIN_NAME,
                f"only a pickled PyTorch {BIN_NAME} was found; it is not read (loading a pickle can run "
                "code). "
                'Convert it to safetensors, e.g. python -c "import torch; from safetensors.torch import '
                f"save_file; save_file(torch.load('{BIN_NAME}', weights_only=True), '{WEIGHTS_NAME}')\", or "
                "re-save it with PEFT's save_pretrained(..., safe_serialization=True)",
            )
        raise _fail(w_file, "missing: a PEFT adapter directory must hold adapter_model.safetensors")
    if not cfg_file.is_file():
        raise _fail(cfg_file, "not a regular file")
    if not w_file.is_file():
        raise _fail(w_file, "not a regular file")


def _adapter_files(path: str | os.PathLike[str]) -> tuple[Path, Path, Path]:
    """``(directory, config file, safetensors file)`` of the adapter at ``path``, all checked to exist
    (:func:`check_adapter_path`, :func:`_check_files`); an OS error accessing them is an AdapterLoadError."""
    adir = check_adapter_path(path)
    cfg_file = adir / CONFIG_NAME
    w_file = adir / WEIGHTS_NAME
    try:
        _check_files(adir, cfg_file, w_file)
    except OSError as e:  # e.g. a name too long, a directory without search permission
        raise _fail(adir, f"cannot access the adapter directory: {type(e).__name__}: {e}") from e
    return adir, cfg_file, w_file


def _nested_adapter_hint(adir: Path) -> str:
    """`` (its subfolder 'adapter' holds one)`` when an adapter lies one level down (``adapters/f1-qwen``)."""
    try:
        inner = sorted(d.name for d in adir.iterdir() if (d / CONFIG_NAME).is_file())
    except OSError:
        return ""
    if not inner:
        return ""
    if len(inner) == 1:
        return f" (its subfolder {inner[0]!r} holds one)"
    return f" (its subfolders {', '.join(map(repr, inner))} hold one each)"
