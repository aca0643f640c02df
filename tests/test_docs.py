"""The documentation follows the code: the generated tables, the README's first lines, links and wording.

- The supported-models section of docs/models.md is exactly what ``benchmarks/supported_table.py`` prints
  (``python benchmarks/supported_table.py --write`` regenerates it).
- The README's performance table holds the committed H100 results (``benchmarks/results/``).
- README.md starts with the two commands a newcomer runs, then how to get a CPU build of PyTorch.
- README.md and docs/ link only files that exist, document every CLI subcommand and never use the word
  the project keeps out of its docs (``test_docs_never_say_issue``).
- ``tests/test_readme.py`` runs the README's code."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from moelora.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MODELS = ROOT / "docs" / "models.md"
DOCS = sorted((ROOT / "docs").rglob("*.md"))
H100_LORA = ROOT / "benchmarks" / "results" / "bench_lora_NVIDIA_H100.json"

QUICKSTART = "\n".join([
    "```bash",
    "pip install -e \".[transformers]\" && moelora demo  "
    "# install, serve the embedded tiny MoE with 4 adapters, check vs PEFT",
    'pip install -e ".[test]" && pytest -q -n 2 tests  '
    "# install the test extra and run the tests (CPU: Triton interpreter)",
    "```",
    "",
    "On a machine without a GPU, install a CPU build of PyTorch first",
    "(`pip install torch --index-url https://download.pytorch.org/whl/cpu`), then the two lines above.",
])


def _supported_table():
    path = ROOT / "benchmarks" / "supported_table.py"
    spec = importlib.util.spec_from_file_location("supported_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_models_doc_supported_section_matches_the_code():
    table = _supported_table()
    assert table.MODELS_DOC == MODELS
    assert table.doc_section(MODELS.read_text()) == table.section(), (
        "docs/models.md's supported-models section is out of date: run "
        "python benchmarks/supported_table.py --write"
    )
    assert table.START not in README.read_text(), "the generated table lives in docs/models.md"


def test_supported_section_names_what_the_code_knows():
    from moelora import bench, peft_loader
    from moelora.integrations import KNOWN_EXPERTS_CLASSES

    section = _supported_table().section()
    for name in (*KNOWN_EXPERTS_CLASSES, *bench.MODELS, peft_loader.FORMAT_F1, peft_loader.FORMAT_F2,
                 peft_loader.FORMAT_F2_SWAPPED):
        assert name in section


def test_supported_table_write_is_idempotent(tmp_path):
    table = _supported_table()
    copy = tmp_path / "models.md"
    copy.write_text(MODELS.read_text().replace(table.section(), f"{table.START}\nstale\n{table.END}"))
    assert table.write(copy) is True
    assert copy.read_text() == MODELS.read_text()
    assert table.write(copy) is False
    fresh = tmp_path / "new.md"
    assert table.write(fresh) is True
    assert fresh.read_text().startswith(table.INTRO)
    assert table.doc_section(fresh.read_text()) == table.section()


def test_readme_starts_with_the_quickstart_commands():
    assert README.read_text().startswith(QUICKSTART)


def test_readme_performance_table_matches_the_committed_h100_results():
    """The headline table: LoRA overhead, rank 16, 4 adapters, auto path, per model and M."""
    data = json.loads(H100_LORA.read_text())
    rows: dict[str, dict[int, float]] = {}
    for r in data["records"]:
        if r["path"] == "auto" and r["rank"] == 16 and r["n_adapters"] == 4:
            rows.setdefault(r["model"], {})[r["M"]] = r["overhead"]
    assert rows, f"{H100_LORA} has no auto-path rank-16 records with 4 adapters"
    text = README.read_text()
    ms = sorted(next(iter(rows.values())))
    assert "| model | " + " | ".join(f"M={m}" for m in ms) + " |" in text
    for model, by_m in rows.items():
        line = f"| {model} | " + " | ".join(f"{by_m[m] * 100:+.1f}%" for m in ms) + " |"
        assert line in text, f"README.md lacks the row {line!r} of {H100_LORA.name}"
    assert data["device"] in text and data["date"][:10] in text


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_never_say_issue(path):
    hits = [f"{path.name}:{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
            if re.search(r"\bissues?\b", line, re.IGNORECASE)]
    assert not hits, "\n".join(hits)


# History is git's: a commit hash in a doc goes stale (a hex word of 7-40 characters, letters and digits).
@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_carry_no_commit_hashes(path):
    commit = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
    hits = [f"{path.name}:{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
            if commit.search(line)]
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_links_resolve(path):
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (path.parent / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"{path.name} links missing files: {missing}"


def test_readme_documents_every_cli_command():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    text = README.read_text()
    assert [c for c in sub.choices if f"`moelora {c}" not in text] == []


def test_kernel_map_lists_every_triton_kernel():
    kernels = set()
    for source in (ROOT / "triton_ops").glob("*.py"):
        kernels |= set(re.findall(r"@triton\.jit\s*\ndef (_\w+_kernel)\(", source.read_text()))
    assert kernels, "no Triton kernels found"
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert sorted(k for k in kernels if f"`{k}`" not in text) == []
