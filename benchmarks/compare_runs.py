"""Two ``moelora bench`` runs of the same points on one device, cell by cell: B's time over A's.

    python benchmarks/compare_runs.py A.json B.json --labels before after --out benchmarks/results/NAME

For each (model, M, rank, adapters, popularity, path) in both runs: A's and B's base and base+LoRA µs,
B/A of base+LoRA, and B/A of base+LoRA each normalised by its own run's base timed beside it (what the
LoRA side changed, with the clock drift between the runs taken out). Writes ``OUT.json``, ``OUT.md`` and
``OUT.png``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _records(path: Path) -> dict[tuple, dict]:
    data = json.loads(path.read_text())
    rows = data["records"] if isinstance(data, dict) else data
    return {(r["model"], r["M"], r["rank"], r["n_adapters"], r["popularity"], r["path"]): r for r in rows}


def compare(a: dict[tuple, dict], b: dict[tuple, dict]) -> list[dict]:
    rows = []
    for key in sorted(set(a) & set(b), key=lambda k: tuple(str(v) for v in k)):
        ra, rb = a[key], b[key]
        if ra["base_lora_us"] is None or rb["base_lora_us"] is None:
            continue
        ratio = rb["base_lora_us"] / ra["base_lora_us"]
        normalised = (rb["base_lora_us"] / rb["base_us"]) / (ra["base_lora_us"] / ra["base_us"])
        rows.append(dict(zip(("model", "M", "rank", "n_adapters", "popularity", "path"), key, strict=True),
                         a_base_us=ra["base_us"], a_us=ra["base_lora_us"], b_base_us=rb["base_us"],
                         b_us=rb["base_lora_us"], ratio=ratio, normalised_ratio=normalised))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--labels", nargs=2, default=["A", "B"])
    parser.add_argument("--out", type=Path, required=True, help="output path without extension")
    args = parser.parse_args()
    rows = compare(_records(args.a), _records(args.b))
    if not rows:
        raise SystemExit("the runs have no point in common")
    la, lb = args.labels
    device = json.loads(args.a.read_text()).get("device", "") if args.a.suffix == ".json" else ""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"labels": [la, lb], "device": device, "rows": rows}
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    worst = max(rows, key=lambda r: r["ratio"])
    worst_n = max(rows, key=lambda r: r["normalised_ratio"])
    lines = [f"# {lb} against {la}, cell by cell", "",
             f"Largest {lb}/{la} of base+LoRA: {worst['ratio']:.3f} ({worst['model']} M={worst['M']} "
             f"{worst['n_adapters']} adapters {worst['path']}); normalised by each run's base: "
             f"{worst_n['normalised_ratio']:.3f} ({worst_n['model']} M={worst_n['M']} "
             f"{worst_n['n_adapters']} adapters {worst_n['path']}).", "",
             f"| model | M | rank | adapters | path | {la} base µs | {la} µs | {lb} base µs | {lb} µs | "
             f"{lb}/{la} | normalised |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['M']} | {r['rank'] or '-'} | {r['n_adapters'] or '-'} | "
                     f"{r['path']} | "
                     f"{r['a_base_us']:.1f} | {r['a_us']:.1f} | {r['b_base_us']:.1f} | {r['b_us']:.1f} | "
                     f"{r['ratio']:.3f} | {r['normalised_ratio']:.3f} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:3]))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    labels = [f"{r['model'][:8]} {r['M']} {r['n_adapters'] or 'base'}" for r in rows]
    ax.plot(range(len(rows)), [r["ratio"] for r in rows], "o", label=f"{lb}/{la}")
    ax.plot(range(len(rows)), [r["normalised_ratio"] for r in rows], "x",
            label="normalised by each run's base")
    for level in (0.97, 1.03):
        ax.axhline(level, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("time ratio")
    ax.set_title(f"{lb} / {la} {device}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
