"""The command line: ``moelora smoke`` and ``moelora inspect`` (also as ``python -m moelora``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moelora.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", str(ROOT / "adapters" / "tiny-qwen3-moe")]


@pytest.mark.interpreter
def test_smoke_runs_the_kernels_and_checks_them(capsys):
    assert main(["smoke", "--device", "cpu"]) == 0
    assert "all outputs match the reference" in capsys.readouterr().out


def test_inspect_good_adapter(capsys):
    assert main(["inspect", str(ROOT / "adapters" / "sql"), *TINY]) == 0
    out = capsys.readouterr().out
    assert "F2 fused expert parameters" in out and "ranks        [8]" in out and "attention" in out


def test_inspect_broken_adapter_exits_non_zero(tmp_path, capsys):
    bad = tmp_path / "chat"
    shutil.copytree(ROOT / "adapters" / "chat", bad)
    weights = bad / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert main(["inspect", str(bad), *TINY]) == 1
    err = capsys.readouterr().err
    assert "adapter_model.safetensors" in err and "cannot serve this adapter" in err


def test_inspect_needs_a_shape(capsys):
    assert main(["inspect", str(ROOT / "adapters" / "sql")]) == 2
    assert "--model" in capsys.readouterr().err


def test_python_dash_m_is_the_same_cli():
    result = subprocess.run(
        [sys.executable, "-m", "moelora", "inspect", str(ROOT / "adapters" / "chat"), *TINY],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "rsLoRA" in result.stdout or "scalings" in result.stdout


def test_demo_serves_mixed_adapters_and_matches_peft(capsys):
    # The main job on the embedded default: three adapters, an async hot-load, an LRU eviction, a
    # request with no adapter; exit code 0 only when every request matches PEFT.
    assert main(["demo", "--device", "cpu", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "all requests match PEFT" in out and "gate-up-only" in out and "(none)" in out


def test_demo_argument_errors(capsys):
    assert main(["demo", "--model", "somewhere"]) == 2
    assert main(["demo", "--adapter", "noequals"]) == 2
