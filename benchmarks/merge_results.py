"""Merge runs of ``moelora bench`` over different models or M into one table (JSON + markdown + PNG).

    python benchmarks/merge_results.py --out benchmarks/results/bench_lora_NVIDIA_H100.json \
        run_small_models.json run_big_models.json --note "two runs on one machine"

One call of the device tool runs at most 10 minutes, so a full table is taken in several runs on one
machine, each over some of the models or some of the M with the same settings. The runs must be of one
device and one set of settings (ranks, adapters, popularity, paths, dtype, timer, rounds) and must not
repeat a (model, M) point, unless ``--replace``: then a later run's points replace those points' records in
the runs before it (a merged table given first, refreshed where a change moved it: ``merge_results.py
--replace --out T.json T.json new_points.json``). The table's M are every run's, and every model must have
all of them: a table has no holes. Records are put in ``moelora.bench.MODELS`` order, then M; the metadata
is the first run's, its date replaced by every run's date range and ``--note`` (and each run's date, with
the M it gave where not all) kept under ``args.note``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moelora.bench import MODELS, markdown_table, plot_overhead  # noqa: E402

# Settings that must agree between the runs merged into one table.
_SAME_SETTINGS = ("ranks", "adapters", "popularity", "paths", "dtype", "warmup_ms", "rep_ms", "rounds")
# A setting older runs did not record, and the value they ran with.
_SETTING_DEFAULTS = {"rounds": 1}


def merge_runs(runs: list[dict[str, Any]], note: str = "", replace: bool = False) -> dict[str, Any]:
    """One table from several runs (each a ``moelora bench`` JSON as loaded); raises ValueError where they
    differ in device or settings, measure a (model, M) point twice (with ``replace``, the last run's
    records of it are kept) or leave a model without one of the table's M."""
    if not runs:
        raise ValueError("nothing to merge: give at least one run")
    first = runs[0]
    all_m = sorted({m for run in runs for m in run["resolved"].get("M") or []}) or None
    if replace:
        runs = _latest_run_per_point(runs)
    seen: dict[tuple[str, int], str] = {}
    for run in runs:
        if run["device"] != first["device"]:
            raise ValueError(f"runs of different devices: {first['device']!r} and {run['device']!r}")
        for key in _SAME_SETTINGS:
            default = _SETTING_DEFAULTS.get(key)
            ours, theirs = run["resolved"].get(key, default), first["resolved"].get(key, default)
            if ours != theirs:
                raise ValueError(f"runs with different {key}: {theirs!r} and {ours!r} "
                                 f"({first['date']} / {run['date']})")
        for point in sorted({(r["model"], r["M"]) for r in run["records"]}):  # the message names the first
            if point in seen:
                raise ValueError(f"{point[0]} M={point[1]} is in two runs ({seen[point]} and {run['date']})")
            seen[point] = run["date"]
    for model in sorted({model for model, _ in seen}):
        missing = [m for m in all_m or [] if (model, m) not in seen]
        if missing:
            raise ValueError(f"{model} has no M={'/'.join(map(str, missing))} in any run, which the table's "
                             f"other runs have: run it there too (a table has no holes)")
    order = {name: i for i, name in enumerate(MODELS)}

    def place(name: str) -> int:  # MODELS order; a model of a --config file after them
        return order.get(name, len(order))

    runs = [run for run in runs if run["records"]]  # a run whose every point was replaced
    records = [r for run in runs for r in run["records"]]
    records.sort(key=lambda r: (place(r["model"]), r["M"]))  # stable: each run's order within a point
    dates = sorted(part for run in runs for part in run["date"].split(" to "))  # a merged table's range
    merged = {k: v for k, v in first.items() if k != "records"}
    merged["date"] = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    runs_note = "; ".join(f"{_run_points(run, all_m, place)} {run['date']}" for run in runs)
    merged["args"] = dict(first["args"], note=f"{note}: {runs_note}" if note else runs_note)
    models = {m["name"]: m for run in runs for m in run["resolved"]["models"]}
    merged["resolved"] = dict(first["resolved"], M=all_m,
                              models=sorted(models.values(), key=lambda m: place(m["name"])))
    return dict(merged, records=records)


def _latest_run_per_point(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs with each (model, M) point's records kept in the last run that has it, and each run's
    ``resolved`` models cut to those it keeps records of."""
    last = {(r["model"], r["M"]): i for i, run in enumerate(runs) for r in run["records"]}
    kept = []
    for i, run in enumerate(runs):
        records = [r for r in run["records"] if last[(r["model"], r["M"])] == i]
        names = {r["model"] for r in records}
        models = [m for m in run["resolved"]["models"] if m["name"] in names]
        kept.append(dict(run, records=records, resolved=dict(run["resolved"], models=models)))
    return kept


def _run_points(run: dict[str, Any], all_m: list[int] | None, place: Callable[[str], int]) -> str:
    """"model, model" for a run's models, models of the same M together, each group followed by "M=a/b"
    where the run gave it fewer than all M."""
    by_model: dict[str, set[int]] = {}
    for r in run["records"]:
        by_model.setdefault(r["model"], set()).add(r["M"])
    groups: dict[tuple[int, ...], list[str]] = {}
    for model in sorted(by_model, key=place):
        groups.setdefault(tuple(sorted(by_model[model])), []).append(model)
    parts = []
    for m_values, models in groups.items():
        partial = all_m is not None and set(m_values) != set(all_m)
        parts.append(", ".join(models) + (f" M={'/'.join(map(str, m_values))}" if partial else ""))
    return ", ".join(parts)


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
    parser.add_argument("--replace", action="store_true",
                        help="a (model, M) point in several runs: keep the last run's records of it "
                             "(refresh a table)")
    args = parser.parse_args()
    try:
        table = merge_runs([json.loads(path.read_text()) for path in args.runs], args.note, args.replace)
    except (ValueError, KeyError, json.JSONDecodeError) as exc:
        raise SystemExit(f"merge_results: {exc}") from None
    write_table(table, args.out)
    print(f"wrote {args.out} ({len(table['records'])} records) and its .md / .png")


if __name__ == "__main__":
    main()
