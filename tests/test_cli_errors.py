"""Bad input to the command line is one line on stderr (``moelora <cmd>: error: ...``), exit code 2, no
traceback; the demo compares with PEFT only what it applies; the layer's dtype message; the packaging
(core without transformers/peft, the wheel's contents) and the demo outside a checkout."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import moelora.cli as cli
from moelora.cli import main

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = ROOT / "adapters"


def _run_cli(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moelora", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)


def _assert_usage_error(result: subprocess.CompletedProcess, command: str, *words: str) -> None:
    """Exit code 2, exactly one line on stderr in the commands' format, naming ``words``; no traceback."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"moelora {command}: error: "), result.stderr
    for word in words:
        assert word in result.stderr, (word, result.stderr)


def _bad_dirs(tmp_path: Path) -> dict[str, Path]:
    """An empty directory (no config.json, no adapter files) and a folder with a config.json that is no
    transformers config."""
    empty = tmp_path / "empty"
    empty.mkdir()
    not_hf = tmp_path / "not-hf"
    not_hf.mkdir()
    (not_hf / "config.json").write_text('{"hello": 1}')
    return {"empty": empty, "not-hf": not_hf}


GOOD_PAIR = ["--adapter", f"a={ADAPTERS / 'chat'}", "--adapter", f"b={ADAPTERS / 'math'}"]

# (command line with {empty}/{not-hf} placeholders, words the one line must hold)
CASES = {
    "demo cuda": (["demo", "--device", "cuda"], ["--device cuda", "no CUDA GPU", "expected"]),
    "demo unknown device": (["demo", "--device", "tpu"], ["--device", "'tpu'", "choose from"]),
    "demo missing model": (["demo", "--model", "/nope", *GOOD_PAIR], ["--model /nope", "no such directory",
                                                                       "expected"]),
    "demo model dir without config": (["demo", "--model", "{empty}", *GOOD_PAIR],
                                      ["--model", "no config.json", "expected"]),
    "demo model not transformers": (["demo", "--model", "{not-hf}", *GOOD_PAIR], ["no model_type"]),
    "demo adapter without =": (["demo", "--adapter", "chat"], ["--adapter chat", "NAME=DIR"]),
    "demo adapter empty name": (["demo", "--adapter", f"={ADAPTERS / 'chat'}", "--adapter", "b=x"],
                                ["empty name", "NAME=DIR"]),
    "demo adapter missing": (["demo", "--adapter", "a=/nope", "--adapter", f"b={ADAPTERS / 'chat'}"],
                             ["--adapter a=/nope", "/nope"]),
    "demo adapter not peft": (["demo", "--adapter", "a={empty}", "--adapter", f"b={ADAPTERS / 'chat'}"],
                              ["--adapter a=", "adapter_config.json"]),
    "demo one adapter": (["demo", "--adapter", f"a={ADAPTERS / 'chat'}"], ["at least two"]),
    "serve cuda": (["serve", "--demo", "--device", "cuda"], ["--device cuda", "no CUDA GPU"]),
    "serve missing model": (["serve", "--model", "/nope"], ["--model /nope", "no such directory"]),
    "serve model positional": (["serve", "{not-hf}"], ["MODEL", "no model_type"]),
    "serve adapter without =": (["serve", "--demo", "--adapter", "chat"], ["--adapter chat", "NAME=DIR"]),
    "serve adapter missing": (["serve", "--demo", "--adapter", "x=/nope"], ["--adapter x=/nope"]),
    "inspect missing adapter": (["inspect", "/nope"], ["/nope", "not a readable PEFT adapter"]),
    "inspect missing model": (["inspect", str(ADAPTERS / "chat"), "--model", "/nope"], ["--model /nope"]),
    "smoke cuda": (["smoke", "--device", "cuda"], ["--device cuda", "no CUDA GPU"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_and_exit_code_2(case, tmp_path):
    args, words = CASES[case]
    if "cuda" in case.split() and torch.cuda.is_available():
        pytest.skip("checks the error on a machine without CUDA")
    dirs = _bad_dirs(tmp_path)
    args = [a.format(**dirs) if "{" in a else a for a in args]
    _assert_usage_error(_run_cli(*args), case.split()[0], *words)


def test_bench_bad_config_is_one_line(tmp_path):
    # bench keeps its own prefix (tests/test_bench_cli.py); still one line, exit code 2, no traceback
    result = _run_cli("bench", "--dry-run", "--config", str(tmp_path / "nope.json"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("moelora bench: --config") and result.stderr.count("\n") == 1


def test_library_value_errors_are_usage_errors_and_others_keep_their_traceback(monkeypatch, capsys):
    # A ValueError/TypeError the library raises about the input: one line (a multi-line message joined),
    # exit code 2. Any other exception is a bug: it propagates with its traceback.
    def raise_value_error(args):
        raise ValueError("first line\nsecond line")

    monkeypatch.setattr(cli, "cmd_smoke", raise_value_error)
    # (main builds its parser per call, which reads cmd_smoke then)
    assert main(["smoke", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err == "moelora smoke: error: first line; second line\n"

    def raise_runtime_error(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "cmd_smoke", raise_runtime_error)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["smoke", "--device", "cpu"])


def test_demo_leaves_out_what_it_does_not_apply(monkeypatch, capsys):
    # The shipped sql adapter also has attention LoRA, which moelora does not apply: the demo says so in
    # one line and compares with a PEFT reference that does not apply it either.
    monkeypatch.chdir(ROOT)
    assert main(["demo", "--adapter", "a=adapters/sql", "--adapter", "b=adapters/chat"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "left out of the comparison with PEFT" in line]
    assert lines == ["adapter 'a': LoRA of model.layers.{0,1,2}.self_attn.q_proj, "
                     "model.layers.{0,1,2}.self_attn.v_proj (12 tensors, outside the routed experts) is not "
                     "applied, and left out of the comparison with PEFT"], out
    assert "all requests match PEFT" in out


def test_layer_dtype_message_blames_x():
    from moelora.layer import FusedMoEWithLoRA
    from moelora.pool import MoELoRAMemoryPool

    num_experts, hidden, inter = 4, 32, 16
    pool = MoELoRAMemoryPool(num_experts=num_experts, hidden_size=hidden, intermediate_size=inter,
                             layer_ids=[0], max_loras=1, max_rank=4, dtype=torch.bfloat16, device="cpu")
    w13 = torch.randn(num_experts, 2 * inter, hidden).to(torch.bfloat16)
    w2 = torch.randn(num_experts, hidden, inter).to(torch.bfloat16)
    layer = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=0, path="torch")
    x = torch.randn(3, hidden)  # float32
    weights = torch.full((3, 2), 0.5)
    ids = torch.tensor([[0, 1], [1, 2], [2, 3]], dtype=torch.int32)
    with pytest.raises(TypeError) as raised:
        layer(x, weights, ids)
    assert str(raised.value) == ("x's dtype (float32) differs from the layer's expert weights' dtype "
                                 "(bfloat16): cast x first, x.to(torch.bfloat16)")
    assert layer(x.to(torch.bfloat16), weights, ids).dtype == torch.bfloat16
    pool.close()


def test_core_imports_without_transformers_or_peft():
    code = ("import sys, moelora, moelora.pool, moelora.layer, moelora.peft_loader; "
            "print(sorted(m for m in ('transformers', 'peft') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip() == "[]", (result.stdout, result.stderr)


def test_demo_outside_a_checkout_says_so_in_one_line(tmp_path):
    # A `pip install .` copy of the packages has no adapters/ folder beside it: the demo (and serve --demo)
    # say in one line that they need a checkout, or --model and --adapter.
    for package in ("moelora", "triton_ops"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for args in (["demo", "--device", "cpu"], ["serve", "--demo", "--device", "cpu"]):
        result = _run_cli(*args, cwd=tmp_path, env=env)
        _assert_usage_error(result, args[0], "adapters/ folder", "git checkout", "--model DIR")


def test_wheel_holds_the_packages_and_requires_no_transformers(tmp_path):
    # Built offline from a copy of the sources (no torch or any other package installed).
    source = tmp_path / "src"
    source.mkdir()
    for name in ("moelora", "triton_ops"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         str(source), "-w", str(tmp_path / "wheel")], capture_output=True, text=True, timeout=300)
    if built.returncode != 0 and "No module named" in built.stderr:
        pytest.skip(f"cannot build a wheel offline here: {built.stderr.strip().splitlines()[-1]}")
    assert built.returncode == 0, built.stderr
    with zipfile.ZipFile(glob.glob(str(tmp_path / "wheel" / "*.whl"))[0]) as wheel:
        names = wheel.namelist()
        metadata = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    wanted = {"moelora/cli.py", "moelora/demo.py", "moelora/serve/server.py", "triton_ops/fused_moe.py"}
    assert wanted <= set(names)
    assert any(n.startswith("triton_ops/configs/") and n.endswith(".json") for n in names)
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    core = [line for line in requires if "extra ==" not in line]
    assert not any("transformers" in line or "peft" in line for line in core), core
    assert 'Requires-Dist: pytest-xdist; extra == "test"' in metadata
    assert 'Requires-Dist: moelora[test]; extra == "dev"' in metadata
