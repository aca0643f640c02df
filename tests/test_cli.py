"""The command line: ``moelora smoke`` and ``moelora inspect`` (also as ``python -m moelora``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moelora.cli import main
from moelora.peft_loader import describe_peft_adapter, read_peft_adapter

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
    assert main(["demo", "--device", "cpu", "--new-tokens", "2"]) == 0  # a prefill and a decode step
    out = capsys.readouterr().out
    assert "all requests match PEFT" in out and "gate-up-only" in out and "(none)" in out


def test_demo_argument_errors(capsys):
    assert main(["demo", "--model", "somewhere"]) == 2
    assert main(["demo", "--adapter", "noequals"]) == 2


# --------------------------------------------------------------------------------------------------
# inspect on the adapter alone (no model shape given)
# --------------------------------------------------------------------------------------------------

# Each committed fixture with what its files hold (adapters/README.md; F1 sizes: F1_SPECS in
# adapters/make_adapters.py): path, format, MoE layers, experts line, H, I, ranks line, other expected text.
FIXTURES = [
    ("sql", "F2 fused expert parameters", [1, 2], "experts      8 (fused", 64, 32, "max 8; r=8: 4 modules",
     ["gate_up_proj, down_proj", "12 x attention module", "alpha / r: 16/8 = 2"]),
    ("chat", "F2 fused expert parameters", [1, 2], "experts      8 (fused", 64, 32, "max 4; r=4: 4 modules",
     ["alpha / sqrt(r) (rsLoRA): 8/sqrt(4) = 4", "use_rslora=true", "0 keys outside"]),
    ("math", "F2 fused expert parameters", [1, 2], "experts      8 (fused", 64, 32,
     "max 8; r=8: 2 modules, r=4: 2 modules", ["rank_pattern {'down_proj': 4}", "16/8 = 2 (2 modules)"]),
    ("gate-up-only", "F2 fused expert parameters", [1, 2], "experts      8 (fused", 64, 32,
     "max 8; r=8: 2 modules", ["projections  gate, up\n", "peft_version '0.21.2'"]),
    ("down-only", "F2 fused expert parameters", [1, 2], "experts      8 (fused", 64, 32,
     "max 8; r=8: 2 modules", ["projections  down\n", "also fit H=32 I=64"]),
    ("v4-style", "F2 fused expert parameters", [1, 2], "experts      8 (fused", 64, 32,
     "max 8; r=8: 2 modules, r=4: 2 modules", [r"'.*\\.gate_up_proj': 8"]),
    ("f1-qwen/adapter", "F1 per-expert modules", [1, 2], "experts      at least 4", 32, 16,
     "max 4; r=4: 23 modules, r=2: 1 module",
     ["experts.{e}.{down_proj,gate_proj,up_proj}", "2 x shared expert", "6/2 = 3 (1 module)"]),
    ("f1-mixtral/adapter", "F1 per-expert modules", [0, 1], "experts      at least 4", 32, 16,
     "max 4; r=4: 24 modules", ["Mixtral naming: w1 = gate, w3 = up, w2 = down", "block_sparse_moe"]),
]


@pytest.mark.parametrize("name, fmt, layers, experts, hid, inter, ranks, extra", FIXTURES,
                         ids=[f[0].split("/")[0] for f in FIXTURES])
def test_inspect_fixture_adapter_alone(name, fmt, layers, experts, hid, inter, ranks, extra, capsys,
                                       monkeypatch, tmp_path):
    # The point of the change: every layout the loader reads is summarised from the adapter alone, with
    # H, I, E, layers and ranks inferred from the tensor shapes. Run from an empty folder so that the
    # fixtures' relative base_model_name_or_path ("adapters/tiny-qwen3-moe") resolves to nothing and no
    # model is used at all.
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", str(ROOT / "adapters" / name)]) == 0
    out = capsys.readouterr().out
    assert f"format       {fmt} (PEFT 0.21.2)" in out
    assert f"MoE layers   {layers}" in out
    assert experts in out
    assert f"sizes        H={hid} I={inter} (from the tensor shapes" in out
    assert f"ranks        {ranks}\n" in out
    for text in extra:
        assert text in out, text
    assert "compatibility check against" not in out and "the compatibility check needs --model" in out


@pytest.mark.parametrize("name", [f[0] for f in FIXTURES], ids=[f[0].split("/")[0] for f in FIXTURES])
def test_describe_agrees_with_the_loader(name):
    # describe_peft_adapter classifies keys with its own copy of the loader's loop (built from the same
    # regexes and predicates): here both must agree on every fixture, and the sizes it infers must be
    # ones the loader accepts (read_peft_adapter with exactly those sizes loads the adapter).
    path = ROOT / "adapters" / name
    s = describe_peft_adapter(path)
    _, report = read_peft_adapter(
        path, num_experts=s.num_experts or s.min_experts, hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size, layer_ids=s.layers, max_rank=s.max_rank,
    )
    assert (s.format, s.layers) == (report.format, report.layers)
    assert s.experts_per_layer == report.experts_per_layer
    assert (s.ranks, s.scalings, s.ignored_keys) == (report.ranks, report.scalings, report.ignored_keys)
    assert s.peft_version == report.peft_version and s.size_candidates == []


def _tmp_adapter(tmp_path: Path, src: str, **config) -> Path:
    """A copy of a fixture adapter with some config fields replaced."""
    out = tmp_path / src.replace("/", "-")
    shutil.copytree(ROOT / "adapters" / src, out)
    cfg_file = out / "adapter_config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), **config}))
    return out


def test_inspect_checks_against_a_local_base_model(tmp_path, capsys):
    # base_model_name_or_path naming a local model folder runs the full check by itself, and says which
    # folder it used.
    model = tmp_path / "my-base"
    shutil.copytree(ROOT / "adapters" / "tiny-qwen3-moe", model)
    adapter = _tmp_adapter(tmp_path, "chat", base_model_name_or_path=str(model))
    assert main(["inspect", str(adapter)]) == 0
    out = capsys.readouterr().out
    assert f"-> local folder {model.resolve()}" in out
    assert f"compatibility check against {model.resolve()} (base_model_name_or_path)" in out
    assert "model        qwen3_moe: E=8 H=64 I=32, MoE layers [1, 2]" in out
    assert "result       OK" in out


def test_inspect_resolves_a_relative_base_model(monkeypatch, capsys):
    # The committed fixtures name their base as PEFT saved it, relative to the working directory (the
    # repo root): found from there, as PEFT and transformers would find it.
    monkeypatch.chdir(ROOT)
    assert main(["inspect", "adapters/gate-up-only"]) == 0
    out = capsys.readouterr().out
    assert f"compatibility check against {ROOT / 'adapters' / 'tiny-qwen3-moe'}" in out
    assert "result       OK" in out


def test_inspect_local_base_model_that_does_not_fit(tmp_path, capsys):
    # The automatic check reports a mismatch exactly as --model does: exit code 1, the loader's reason
    # on stderr naming the model folder (here a Mixtral-style adapter on layers 0-1, H=32, vs the base
    # whose MoE layers are 1-2, H=64).
    adapter = _tmp_adapter(tmp_path, "f1-mixtral/adapter",
                           base_model_name_or_path=str(ROOT / "adapters" / "tiny-qwen3-moe"))
    assert main(["inspect", str(adapter)]) == 1
    captured = capsys.readouterr()
    assert "result       FAILED" in captured.out
    assert captured.err.startswith("moelora inspect: cannot serve this adapter on ")
    assert "tiny-qwen3-moe" in captured.err and "layer 0 is not an MoE layer" in captured.err
    assert captured.err.count("\n") == 1


def test_inspect_hub_id_prints_the_name_and_the_hint(tmp_path, capsys):
    # A hub id cannot be read here (no network, no download): printed, with what to do for the check.
    adapter = _tmp_adapter(tmp_path, "sql", base_model_name_or_path="Qwen/Qwen3-30B-A3B")
    assert main(["inspect", str(adapter)]) == 0
    out = capsys.readouterr().out
    assert "base model   Qwen/Qwen3-30B-A3B (base_model_name_or_path; no local folder" in out
    assert "the compatibility check needs --model DIR" in out and "compatibility check against" not in out


def test_inspect_model_flag_wins_over_the_base_model(tmp_path, capsys):
    # --model (and the shape flags) still run today's check, and take precedence over the config's name.
    adapter = _tmp_adapter(tmp_path, "chat", base_model_name_or_path="Qwen/Qwen3-30B-A3B")
    assert main(["inspect", str(adapter), *TINY]) == 0
    out = capsys.readouterr().out
    assert f"compatibility check against --model {TINY[1]}" in out and "is used instead" in out
    assert "scalings     [4.0]" in out and "result       OK" in out
    shape = ["--experts", "8", "--hidden", "64", "--intermediate", "32", "--layers", "1,2"]
    assert main(["inspect", str(adapter), *shape]) == 0
    assert "model        given: E=8 H=64 I=32, MoE layers [1, 2]" in capsys.readouterr().out
    # a shape that does not fit: the loader's reason, exit code 1
    assert main(["inspect", str(adapter), "--experts", "8", "--hidden", "64", "--intermediate", "32",
                 "--layers", "2,3"]) == 1
    assert "layer 1 is not an MoE layer of this model" in capsys.readouterr().err


def _bad_inputs(tmp_path: Path) -> dict[str, list[str]]:
    broken = _tmp_adapter(tmp_path, "chat")
    (broken / "adapter_config.json").write_text('{"r": 4, "lora_alpha": ')
    array = _tmp_adapter(tmp_path, "sql")
    (array / "adapter_config.json").write_text("[1, 2]")
    (tmp_path / "empty").mkdir()
    return {
        "missing dir": [str(tmp_path / "nowhere")],
        "dir without adapter files": [str(tmp_path / "empty")],
        "adapter one level down": [str(ROOT / "adapters" / "f1-qwen")],
        "a file, not a dir": [str(ROOT / "adapters" / "chat" / "adapter_config.json")],
        "broken config JSON": [str(broken)],
        "config not an object": [str(array)],
        "--model without config.json": [str(ROOT / "adapters" / "chat"), "--model", str(tmp_path / "empty")],
        "part of the shape flags": [str(ROOT / "adapters" / "chat"), "--experts", "8"],
        "bad --layers": [str(ROOT / "adapters" / "chat"), "--experts", "8", "--hidden", "64",
                         "--intermediate", "32", "--layers", "1,x"],
    }


BAD_INPUT_CASES = [
    "missing dir", "dir without adapter files", "adapter one level down", "a file, not a dir",
    "broken config JSON", "config not an object", "--model without config.json", "part of the shape flags",
    "bad --layers",
]


@pytest.mark.parametrize("case", BAD_INPUT_CASES)
def test_inspect_bad_input_is_a_usage_error(case, tmp_path, capsys):
    # Input that names no readable adapter (or bad options) is a usage error, as the CLI's other
    # argument errors are: exit code 2, one line on stderr, nothing on stdout, no traceback.
    cases = _bad_inputs(tmp_path)
    assert sorted(cases) == sorted(BAD_INPUT_CASES)
    assert main(["inspect", *cases[case]]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("moelora inspect: ") and captured.err.count("\n") == 1
    if case == "adapter one level down":  # the hint points at the folder that holds the adapter
        assert "its subfolder 'adapter' holds one" in captured.err


def test_inspect_unservable_adapter_exits_1_without_a_model(tmp_path, capsys):
    # An adapter that no model could serve is refused from the adapter alone with the loader's reason
    # (exit code 1, as for a model mismatch), not described as if it were fine.
    dora = _tmp_adapter(tmp_path, "chat", use_dora=True)
    assert main(["inspect", str(dora)]) == 1
    err = capsys.readouterr().err
    assert "cannot serve this adapter" in err and "use_dora" in err and err.count("\n") == 1
    truncated = _tmp_adapter(tmp_path, "sql")
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert main(["inspect", str(truncated)]) == 1
    assert "truncated, corrupt or unreadable" in capsys.readouterr().err


def _write_adapter(folder: Path, config: dict, shapes: dict[str, tuple[int, ...]]) -> Path:
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    save_file({k: torch.randn(*s) for k, s in shapes.items()}, str(folder / "adapter_model.safetensors"))
    return folder


def test_inspect_says_what_the_adapter_alone_cannot_tell(tmp_path, capsys):
    # Sizes the adapter cannot give are reported as such, not guessed.
    key = "base_model.model.model.layers.{}.mlp.experts.{}"
    # 1) per-expert modules skipping experts: only a lower bound on the expert count
    shapes = {}
    for lid in (0, 2):
        for e in range(6):
            if lid == 0 and e in (1, 5):
                continue
            shapes[key.format(lid, e) + ".gate_proj.lora_A.weight"] = (4, 32)
            shapes[key.format(lid, e) + ".gate_proj.lora_B.weight"] = (16, 4)
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["gate_proj"]}
    skip = _write_adapter(tmp_path / "skip", config, shapes)
    assert main(["inspect", str(skip)]) == 0
    out = capsys.readouterr().out
    assert "experts      at least 6" in out and "covered per layer {0: 4, 2: 6}" in out
    assert "layer 0: [1, 5]" in out and "base model   not named" in out
    # 2) a fused down_proj LoRA with H != I and no peft_version: its orientation (PEFT >= 0.19.1 or the
    # swapped 0.17-0.19.0 layout) decides which of the two sizes is H, so only the model can tell
    amb = _write_adapter(
        tmp_path / "amb", {"r": 4, "lora_alpha": 8, "target_parameters": ["mlp.experts.down_proj"]},
        {key.format(3, "").rstrip(".") + ".lora_A.weight": (24, 16),
         key.format(3, "").rstrip(".") + ".lora_B.weight": (48, 24)},
    )
    assert main(["inspect", str(amb)]) == 0
    out = capsys.readouterr().out
    assert "experts      6 (fused" in out
    assert "sizes        undecided from the adapter alone: H=48 I=16" in out and "H=16 I=48" in out
    # ... and the model's sizes do decide it
    assert main(["inspect", str(amb), "--experts", "6", "--hidden", "48", "--intermediate", "16",
                 "--layers", "3"]) == 0
    assert "result       OK" in capsys.readouterr().out
