"""README.md's code runs as written, on a CPU, offline, with the tiny model and adapters in ``adapters/``.

- Every ```python block runs in a fresh interpreter (``python -c``, the repository root as working
  directory, no GPU visible, the Hugging Face hub offline) and must exit 0. The openai client block of
  "Serve over HTTP" needs a live server: ``tests/test_serve.py`` runs it against ``moelora serve --demo``.
- Every line of the ```bash blocks runs too, unless it installs packages (``pip``), needs a server
  (``moelora serve``, ``curl``) or several processes (``torchrun``): those are the skipped kinds below,
  and a line of any other kind that is not a ``moelora`` command fails the test, so a new README line
  is either run here or skipped on purpose.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TIMEOUT_S = 600  # a shared 2-core machine; each block takes seconds when the machine is idle

# Lines of the README's bash blocks that are not run here, by how they start, and why.
SKIPPED = {
    "pip ": "installs packages",
    "torchrun ": "several processes (tests/test_parallel.py runs `moelora demo --tp 2` under torchrun)",
    "curl ": "needs the server (tests/test_serve.py)",
    "moelora serve": "starts the server (tests/test_serve.py)",
}


def _text() -> str:
    return README.read_text()


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _serve_section(text: str) -> str:
    return text.split("## Serve over HTTP\n", 1)[1].split("\n## ", 1)[0]


def python_blocks() -> list[str]:
    text = _text()
    served = set(_blocks(_serve_section(text), "python"))
    return [b for b in _blocks(text, "python") if b not in served]


def bash_lines() -> list[str]:
    """Each command line of every bash block, continuation lines joined."""
    lines = []
    for block in _blocks(_text(), "bash"):
        lines += [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return lines


def _runnable(line: str) -> bool:
    return not any(line.startswith(prefix) for prefix in SKIPPED)


def _env() -> dict[str, str]:
    """The environment of a user's CPU machine: no GPU, no Triton interpreter unless the line sets it, and
    no network for the Hugging Face hub."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _label(text: str) -> str:
    first = next((line for line in text.splitlines() if line and not line.startswith(("import", "from"))), "")
    return first[:60]


def test_readme_has_code_to_run():
    assert len(python_blocks()) >= 2, "README.md lost its attach and engine examples"
    assert [line for line in bash_lines() if _runnable(line)], "README.md has no bash line to run"


@pytest.mark.parametrize("code", python_blocks(), ids=_label)
def test_readme_python_block_runs(code):
    assert '"cuda' not in code and "'cuda" not in code, "README code must run as written on a CPU"
    done = _run([sys.executable, "-c", code], _env())
    assert done.returncode == 0, f"exit code {done.returncode}\n{code}\n--- stderr ---\n{done.stderr[-4000:]}"


@pytest.mark.parametrize("line", [line for line in bash_lines() if _runnable(line)],
                         ids=lambda line: line.split("#")[0].strip())
def test_readme_bash_line_runs(line):
    words = shlex.split(line, comments=True)
    env = _env()
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    assert words and words[0] == "moelora", (
        f"README bash line {line!r} is neither a moelora command nor of a skipped kind ({sorted(SKIPPED)})"
    )
    done = _run([sys.executable, "-m", "moelora", *words[1:]], env)
    assert done.returncode == 0, (
        f"{line}: exit code {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
    )

