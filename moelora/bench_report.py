"""``moelora bench``'s outputs: the Markdown table and the overhead plot of its records."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _rank_cell(r: dict[str, Any]) -> str:
    if r.get("pool_rank") and r["rank"] is not None and r["pool_rank"] > r["rank"]:
        return f"{r['rank']} (pool {r['pool_rank']})"
    return _fmt(r["rank"], "d")


def markdown_table(records: list[dict[str, Any]]) -> str:
    lines = [
        "| model | M | rank | n_adapters | popularity | path | base µs | base+LoRA µs | overhead | TB/s | "
        "%HBM peak | TFLOP/s | %TC peak |",
        "|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        path = r["path"] if r.get("resolved_path") is None else f"{r['path']} ({r['resolved_path']})"
        lora_us = _fmt(r["base_lora_us"], ".1f") if r["base_lora_us"] is not None else "skipped"
        lines.append(
            f"| {r['model']} | {r['M']} | {_rank_cell(r)} | {_fmt(r['n_adapters'], 'd')} | "
            f"{r['popularity'] or '-'} | {path} | {r['base_us']:.1f} | {lora_us} | "
            f"{_fmt(r['overhead'], '+.1%')} | {_fmt(r['tbps'], '.3f')} | {_fmt(r['pct_hbm_peak'], '.1f')} | "
            f"{_fmt(r['tflops'], '.2f')} | {_fmt(r['pct_tc_peak'], '.1f')} |"
        )
    return "\n".join(lines)


def plot_overhead(records: list[dict[str, Any]], out: Path, title: str) -> bool:
    """Overhead vs M (log x), a panel per (model, rank), a line per path (worst over adapters/popularity).
    Returns False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[warn] matplotlib is not installed (pip install matplotlib): no plot written", file=sys.stderr)
        return False
    rows = [r for r in records if r["path"] != "base" and r["overhead"] is not None]
    models = list(dict.fromkeys(r["model"] for r in records))
    ranks = sorted({r["rank"] for r in rows}) or [None]
    paths = list(dict.fromkeys(r["path"] for r in rows))
    all_ms = sorted({r["M"] for r in records})
    fig, axes = plt.subplots(len(models), len(ranks), figsize=(max(7.0, 5.5 * len(ranks)), 3.6 * len(models)),
                             squeeze=False)
    colors = {"fused": "C0", "split": "C1", "staged": "C2", "auto": "C3", "naive": "C7"}
    for i, model in enumerate(models):
        for j, rank in enumerate(ranks):
            ax = axes[i][j]
            lowest = 0.0
            big = False
            for path in paths:
                worst: dict[int, float] = {}
                for r in rows:
                    if r["model"] == model and r["rank"] == rank and r["path"] == path:
                        worst[r["M"]] = max(worst.get(r["M"], -math.inf), 100 * r["overhead"])
                if not worst:
                    continue
                xs = sorted(worst)
                big |= max(worst.values()) > 500
                lowest = min(lowest, *worst.values())
                ax.plot(xs, [worst[x] for x in xs], marker="o", label=path, color=colors.get(path),
                        linestyle="--" if path == "auto" else "-")
            ax.axhline(0, color="black", linewidth=0.8)
            ax.axhline(10, color="gray", linewidth=0.8, linestyle=":", label="10% target")
            ax.set_xscale("log", base=2)
            ax.set_xticks(all_ms, [str(v) for v in all_ms])
            ax.minorticks_off()
            if big:
                ax.set_yscale("symlog", linthresh=100)
                ax.set_ylim(bottom=min(-10.0, 1.2 * lowest))
            ax.set_title(f"{model}, rank {rank}", fontsize=10)
            ax.set_xlabel("M (tokens)")
            ax.set_ylabel("LoRA overhead, %")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True
