"""The supported-models section of docs/models.md, built from what the code itself knows.

Sources (nothing here is typed in by hand but the column headings and short notes):

* model families: ``benchmarks/results/family_coverage.json`` (``benchmarks/family_coverage.py --json``:
  every transformers MoE family, its expert storage and verdict), the expert dtypes the integration and the
  pool accept, and the activations of the layer (``moelora.activations``);
* benchmarked shapes: ``moelora.bench.MODELS`` and, per shape, the tuned launch-config files in
  ``triton_ops/configs/`` (``triton_ops.configs.config_file_name``);
* adapter formats: the format names, projection names, fused-parameter order, LoRA dtypes and refused
  LoraConfig features of ``moelora.peft_loader``.

Usage::

    python benchmarks/supported_table.py           # print the section (markdown)
    python benchmarks/supported_table.py --write   # rewrite it in docs/models.md, between the markers
    python benchmarks/supported_table.py --check   # exit 1 if docs/models.md differs from the output

``tests/test_docs.py`` runs the check, so docs/models.md follows the code. ``--write`` creates the file
(``INTRO``, then the section) when it does not exist, and otherwise replaces only the text between the
markers.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from moelora import activations, bench, peft_loader  # noqa: E402
from moelora import pool as pool_module  # noqa: E402
from moelora.integrations import transformers as hf  # noqa: E402

MODELS_DOC = ROOT / "docs" / "models.md"
CONFIG_DIR = ROOT / "triton_ops" / "configs"
COVERAGE = ROOT / "benchmarks" / "results" / "family_coverage.json"
START = "<!-- supported-table:start -->"
END = "<!-- supported-table:end -->"
INTRO = (
    "# Models and adapter formats\n\n"
    "Which transformers MoE families `moelora.integrations.attach` serves, the layer shapes `moelora bench` "
    "times and the PEFT adapter formats the loader reads. The section between the markers is generated from "
    "the code by `python benchmarks/supported_table.py --write`; `tests/test_docs.py` checks that it is "
    "current.\n\n"
)

_CONFIG_FILE = re.compile(
    r"^E=(?P<E>\d+),N=(?P<N>\d+),device_name=(?P<device>.+),dtype=(?P<dtype>\w+)\.json$"
)


def _code(items) -> str:
    return ", ".join(f"`{i}`" for i in items)


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def _tuned_configs() -> dict[tuple[int, int], list[str]]:
    """(E, I) -> "device (dtype)" for every tuned launch-config file in triton_ops/configs/."""
    found: dict[tuple[int, int], list[str]] = {}
    for path in sorted(CONFIG_DIR.glob("*.json")):
        m = _CONFIG_FILE.match(path.name)
        if m is None:
            raise ValueError(f"{path}: not a tuned config file name (E=..,N=..,device_name=..,dtype=...json)")
        label = f"{m['device'].replace('_', ' ')} ({m['dtype']})"
        found.setdefault((int(m["E"]), int(m["N"])), []).append(label)
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def families_table(coverage: Path = COVERAGE) -> list[str]:
    """Every transformers MoE family with its expert storage and verdict, from the committed output of
    ``benchmarks/family_coverage.py --json`` (``tests/test_family_coverage.py`` holds each verdict)."""
    dtypes = [d for d in hf._POOL_DTYPES if d in pool_module._POOL_DTYPES]
    results = json.loads(coverage.read_text())
    served = [r for r in results if r["category"] == "served"]
    rows = [
        f"**Model families** (transformers {_coverage_versions(results)}, `moelora.integrations.attach`): "
        f"{len(served)} of {len(results)} served and equal to PEFT",
        "",
        "| family | experts | storage | result |",
        "|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: r["family"]):
        verdict = "served" if r["category"] == "served" else f"{r['category']}: {_cell(r['detail'])}"
        rows.append(f"| {r['family']} | `{r['experts_class']}` | {_cell(r['storage'])} | {verdict} |")
    rows += [
        "",
        "Served means: a tiny random model of the family, two PEFT adapters on its routed experts (one "
        "rsLoRA with a rank pattern) and a batch mixing them with a row of no adapter give PEFT's logits and "
        "greedy tokens (`python benchmarks/family_coverage.py`; `tests/test_family_coverage.py`). Expert "
        f"weights: {_dtype_names(dtypes)}; activations: {', '.join(activations.ACTIVATION_KINDS)} "
        "(`moelora.activations`). Anything else is refused at attach time, with the reason.",
    ]
    return rows


def _coverage_versions(results: list[dict]) -> str:
    versions = sorted({r.get("transformers", "") for r in results} - {""})
    return ", ".join(versions) if versions else "5"


def shapes_table() -> list[str]:
    tuned = _tuned_configs()
    rows = [
        "**Benchmarked shapes** (`moelora bench --models NAME`; tuned launch configs in "
        "`triton_ops/configs/`)",
        "",
        "| name | E | top-k | H | I | tuned launch configs |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for shape in bench.MODELS.values():
        devices = ", ".join(tuned.get((shape.E, shape.I), [])) or "none (heuristic)"
        rows.append(f"| {shape.name} | {shape.E} | {shape.top_k} | {shape.H} | {shape.I} | {devices} |")
    return rows


def formats_table() -> list[str]:
    by_target: dict[str, list[str]] = {}
    for module, target in peft_loader._F1_PROJ.items():
        by_target.setdefault(target, []).append(f"`{module}`")
    f1_names = ", ".join(f"{target} {' or '.join(mods)}" for target, mods in by_target.items())
    params = peft_loader._F2_PARAMS
    # PEFT nests one wrapper per fused parameter, the first registered innermost (peft_loader's docstring).
    f2_keys = "; ".join(
        f"{p} `...experts{'.base_layer' * (len(params) - 1 - i)}.lora_{{A,B}}.weight`"
        for i, p in enumerate(params)
    )
    refused = _code(peft_loader._REFUSED_FEATURES)
    inits = _code(peft_loader._RESIDUAL_INITS)
    return [
        "**Adapter formats** (`pool.load_adapter`, `handle.load_adapter`, `moelora inspect`: PEFT "
        f"`{peft_loader.CONFIG_NAME}` + `{peft_loader.WEIGHTS_NAME}`)",
        "",
        "| format | LoRA keys | notes |",
        "|---|---|---|",
        f"| {peft_loader.FORMAT_F1} | `...layers.{{L}}...experts.{{e}}.{{p}}.lora_{{A,B}}.weight`, `{{p}}`: "
        f"{f1_names} | transformers-4 style and most published MoE adapters; `rank_pattern` / "
        "`alpha_pattern` per expert |",
        f"| {peft_loader.FORMAT_F2} | {f2_keys} (one target: `...experts.lora_{{A,B}}.weight`) | PEFT "
        "`target_parameters` on transformers-5 fused experts; A `(E·r, in)` expert-major, B `(out, E·r)` "
        "rank-major, one A shared by gate and up |",
        f"| {peft_loader.FORMAT_F2_SWAPPED} | as F2, A and B transposed | the layout PEFT 0.17.0-0.19.0 "
        "wrote; told apart by the shapes, else by `peft_version` |",
        "",
        f"LoRA factor dtypes: {', '.join(peft_loader._LORA_DTYPES)} (safetensors names). Refused with "
        f"`AdapterLoadError`: {refused}; `init_lora_weights` {inits} (a modified base weight); "
        f"`{peft_loader.BIN_NAME}`-only adapters.",
    ]


def section() -> str:
    """The whole generated section, markers included."""
    lines = [START, "<!-- generated by `python benchmarks/supported_table.py --write`; do not edit by "
             "hand -->", ""]
    lines += families_table() + [""] + shapes_table() + [""] + formats_table()
    lines += ["", END]
    return "\n".join(lines)


def doc_section(text: str) -> str:
    """The section of ``text`` between the markers (markers included); ValueError when they are missing."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the document lacks the markers {START} ... {END}")
    return text[start:end + len(END)]


def write(doc: Path = MODELS_DOC) -> bool:
    """Rewrites the section in ``doc`` (creates ``doc`` with ``INTRO`` when missing); True when it changed."""
    if not doc.exists():
        doc.write_text(INTRO + section() + "\n")
        return True
    text = doc.read_text()
    new = text.replace(doc_section(text), section())
    if new != text:
        doc.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the section in docs/models.md")
    mode.add_argument("--check", action="store_true",
                      help="exit 1 when docs/models.md's section is out of date")
    args = parser.parse_args(argv)
    if args.write:
        print(f"{MODELS_DOC}: {'updated' if write() else 'already up to date'}")
        return 0
    if args.check:
        if not MODELS_DOC.exists() or doc_section(MODELS_DOC.read_text()) != section():
            print("docs/models.md's supported-table section is out of date: run "
                  "python benchmarks/supported_table.py --write", file=sys.stderr)
            return 1
        return 0
    print(section())
    return 0


if __name__ == "__main__":
    sys.exit(main())
