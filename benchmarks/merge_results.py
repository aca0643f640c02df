"""Merge runs of ``moelora bench`` over different models into one table (JSON + markdown + PNG).

    python benchmarks/merge_results.py --out benchmarks/results/bench_lora_NVIDIA_H100.json \
        run_small_models.json run_big_models.json --note "two runs on one machine"

One call of the device tool runs at most 10 minutes, so a full table is taken in several runs on one
machine, each over some of the models with the same settings. The runs must be of one device and one set of
settings (ranks, adapters, popularity, paths, M, dtype) and must not repeat a model. Records are put in
``moelora.bench.MODELS`` order; the metadata is the first run's, its date replaced by every run's date
range and ``--note`` (and each run's date) kept under ``args.note``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moelora.bench import MODELS, markdown_table, plot_overhead  # noqa: E402

# Settings that must agree between the runs merged into one table.
_SAME_SETTINGS = ("ranks", "adapters", "popularity", "paths", "M", "dtype", "warmup_ms", "rep_ms")


def merge_runs(runs: list[dict[str, Any]], note: str = "") -> dict[str, Any]:
    """One table from several runs (each a ``moelora bench`` JSON as loaded); raises ValueError where they
    differ in device or settings, or measure a model twice."""
    if not runs:
        raise ValueError("nothing to merge: give at least one run")
    first = runs[0]
    seen: dict[str, str] = {}
    for run in runs:
        if run["device"] != first["device"]:
            raise ValueError(f"runs of different devices: {first['device']!r} and {run['device']!r}")
        for key in _SAME_SETTINGS:
            if run["resolved"].get(key) != first["resolved"].get(key):
                raise ValueError(f"runs with different {key}: {first['resolved'].get(key)!r} and "
                                 f"{run['resolved'].get(key)!r} ({first['date']} / {run['date']})")
        for model in {r["model"] for r in run["records"]}:
            if model in seen:
                raise ValueError(f"model {model} is in two runs ({seen[model]} and {run['date']})")
            seen[model] = run["date"]
    order = {name: i for i, name in enumerate(MODELS)}

    def place(name: str) -> int:  # MODELS order; a model of a --config file after them
        return order.get(name, len(order))

    records = [r for run in runs for r in run["records"]]
    records.sort(key=lambda r: place(r["model"]))  # stable: each run's order within a model
    dates = sorted(run["date"] for run in runs)
    merged = {k: v for k, v in first.items() if k != "records"}
    merged["date"] = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    runs_note = "; ".join(f"{', '.join(sorted({r['model'] for r in run['records']}, key=place))} "
                          f"{run['date']}" for run in runs)
    merged["args"] = dict(first["args"], note=f"{note}: {runs_note}" if note else runs_note)
    merged["resolved"] = dict(first["resolved"],
                              models=[m for run in runs for m in run["resolved"]["models"]])
    merged["resolved"]["models"].sort(key=lambda m: place(m["name"]))
    return dict(merged, records=records)


def write_table(table: dict[str, Any], out: Path) -> None:
    """The JSON, and beside it the markdown and the PNG ``moelora bench`` writes for one run."""
    out.write_text(json.dumps(table, indent=1) + "\n")
    note = table["args"].get("note")
    header = f"# moelora bench on {table['device']} ({note or table['date']})"
    out.with_suffix(".md").write_text(f"{header}\n\n{table['timing']}.\n\n{markdown_table(table['records'])}\n")
    resolved = table["resolved"]
    title = (f"LoRA overhead t(base+LoRA)/t(base) - 1 vs M; {table['device']}, {resolved['dtype']}\n"
             f"worst over n_adapters {resolved['adapters']}, popularity {resolved['popularity']}")
    plot_overhead(table["records"], out.with_suffix(".png"), title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="moelora bench JSON files, one per run")
    parser.add_argument("--out", type=Path, required=True, help="merged JSON (markdown and PNG beside it)")
    parser.add_argument("--note", default="", help="provenance kept in the table (commit, machine)")
    args = parser.parse_args()
    try:
        table = merge_runs([json.loads(path.read_text()) for path in args.runs], args.note)
    except (ValueError, KeyError, json.JSONDecodeError) as exc:
        raise SystemExit(f"merge_results: {exc}") from None
    write_table(table, args.out)
    print(f"wrote {args.out} ({len(table['records'])} records) and its .md / .png")


if __name__ == "__main__":
    main()
