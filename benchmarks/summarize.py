"""Summary of the performance targets from the ``moelora bench`` JSON files of one device run.

    python benchmarks/summarize.py --device NVIDIA_H200 > benchmarks/results/summary_NVIDIA_H200.md

Reads benchmarks/results/bench_{lora,mixed,pool64,pool8}_<device>.json (written by the commands in
docs/performance.md, "Reproduce") and prints markdown: LoRA overhead of the auto path (worst of the adapter
counts) per model and M for each rank, base bandwidth/throughput, 8 mixed adapters vs 1, and a small adapter
in a big pool; with the byte floor (overhead) or ceiling (mixed ratio) that streaming the LoRA weights
alone sets.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def load(kind: str, device: str) -> list[dict]:
    path = RESULTS / f"bench_{kind}_{device}.json"
    return json.loads(path.read_text())["records"] if path.exists() else []


def mark(ok: bool) -> str:
    return "✓" if ok else "✗"


def overhead_table(records: list[dict], limits: dict[int, float]) -> list[str]:
    models = list(dict.fromkeys(r["model"] for r in records))
    ms = sorted({r["M"] for r in records})
    out = []
    for rank, limit in limits.items():
        out += [f"**rank {rank}** (target ≤ {limit:.0%}; auto path, worst of "
                f"{sorted({r['n_adapters'] for r in records if r['n_adapters']})} adapters; in parentheses "
                "the byte floor: LoRA weight bytes touched / base expert bytes touched, the overhead if they "
                "streamed at the base's own rate)", "",
                "| model | " + " | ".join(f"M={m}" for m in ms) + " |", "|---|" + "---:|" * len(ms)]
        for model in models:
            cells = []
            for m in ms:
                worst = [r["overhead"] for r in records if r["model"] == model and r["M"] == m
                         and r["path"] == "auto" and r["rank"] == rank]
                if not worst:
                    cells.append("-")
                    continue
                w = max(worst)
                floor = max(r["lora_bytes"] / r["expert_bytes"] for r in records if r["model"] == model
                            and r["M"] == m and r["path"] == "auto" and r["rank"] == rank)
                cells.append(f"{w:+.1%} {mark(w <= limit)} ({floor:.1%})")
            out.append(f"| {model} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def base_table(records: list[dict]) -> list[str]:
    targets = {"deepseek-v2-lite": 2.0, "qwen3-30b-a3b": 2.0, "deepseek-v3": 2.8, "mixtral-8x7b": 2.8}
    out = ["| model | M=1 µs | M=1 TB/s (target) | M=4096 µs | M=4096 TFLOP/s |", "|---|---:|---:|---:|---:|"]
    for model in dict.fromkeys(r["model"] for r in records):
        base = {r["M"]: r for r in records if r["model"] == model and r["path"] == "base"}
        if 1 not in base:
            continue
        t = targets.get(model)
        tb = base[1]["tbps"]
        target = f" ({t} {mark(tb >= t)})" if t else ""
        big = base.get(4096)
        head = f"| {model} | {base[1]['base_us']:.1f} | {tb:.2f}{target} | "
        if big is None:
            out.append(head + "- | - |")
            continue
        flops = f"{big['tflops']:.0f}"
        if model == "mixtral-8x7b":
            flops += f" (450 {mark(big['tflops'] >= 450)})"
        out.append(head + f"{big['base_us']:.0f} | {flops} |")
    return out


def mixed_table(records: list[dict]) -> list[str]:
    ms = sorted({r["M"] for r in records})
    out = ["| model | popularity | " + " | ".join(f"M={m}" for m in ms) + " |",
           "|---|---|" + "---:|" * len(ms)]
    for model in dict.fromkeys(r["model"] for r in records):
        for pop in ("uniform", "zipf"):
            cells = []
            for m in ms:
                one = [r for r in records if r["model"] == model and r["M"] == m and r["path"] == "auto"
                       and r["n_adapters"] == 1]
                many = [r for r in records if r["model"] == model and r["M"] == m and r["path"] == "auto"
                        and r["n_adapters"] > 1 and r["popularity"] == pop]
                if not one or not many:
                    cells.append("-")
                    continue
                ratio = (1 + one[0]["overhead"]) / (1 + many[0]["overhead"])
                ceiling = ((1 + one[0]["lora_bytes"] / one[0]["expert_bytes"])
                           / (1 + many[0]["lora_bytes"] / many[0]["expert_bytes"]))
                cells.append(f"{ratio:.2f} {mark(ratio >= 0.9)} ({ceiling:.2f})")
            out.append(f"| {model} | {pop} | " + " | ".join(cells) + " |")
    return out


def pool_table(big: list[dict], small: list[dict]) -> list[str]:
    ms = sorted({r["M"] for r in big})
    out = ["| model | " + " | ".join(f"M={m}" for m in ms) + " |", "|---|" + "---:|" * len(ms)]
    for model in dict.fromkeys(r["model"] for r in big):
        cells = []
        for m in ms:
            a = [r for r in big if r["model"] == model and r["M"] == m and r["path"] == "auto"]
            b = [r for r in small if r["model"] == model and r["M"] == m and r["path"] == "auto"]
            if not a or not b:
                cells.append("-")
                continue
            ratio = (1 + a[0]["overhead"]) / (1 + b[0]["overhead"])
            cells.append(f"{ratio:.2f} {mark(ratio <= 1.1)}")
        out.append(f"| {model} | " + " | ".join(cells) + " |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="NVIDIA_H200")
    args = parser.parse_args()
    lora, mixed = load("lora", args.device), load("mixed", args.device)
    pool64, pool8 = load("pool64", args.device), load("pool8", args.device)
    device = lora[0]["device"] if lora else args.device
    lines = [f"# Performance targets on {device}", ""]
    if lora:
        lines += ["## LoRA overhead t(base+LoRA)/t(base) - 1", ""]
        lines += overhead_table(lora, {16: 0.10, 64: 0.20})
        lines += ["## Base fused MoE (bytes of the experts touched; dense bf16 FLOPs)", ""] + base_table(lora)
        lines.append("")
    if mixed:
        lines += ["## 8 adapters mixed: throughput relative to 1 adapter (target ≥ 0.9, rank 16)", "",
                  "In parentheses the byte ceiling: (1 + f1) / (1 + f8), f = LoRA weight bytes touched / "
                  "base expert bytes touched with 1 and with 8 adapters, the ratio if the LoRA bytes "
                  "streamed at the base's own rate and cost nothing else (a bound only where the base is "
                  "memory-bound: at M=4096 they can hide behind its math). Each time is taken relative to "
                  "the base timed interleaved with it (ratio = (1 + overhead with 1) / (1 + overhead with "
                  "8)), so the two compare under the same clocks.", ""]
        lines += mixed_table(mixed) + [""]
    if pool64 and pool8:
        lines += ["## Rank-8 adapter in a max-rank-64 pool vs a max-rank-8 pool (time ratio, target ≤ 1.1)",
                  "", "The two pools are timed in separate runs; each time is taken relative to the base "
                  "timed interleaved with it (ratio = (1 + overhead in the rank-64 pool) / (1 + overhead in "
                  "the rank-8 pool)).", ""]
        lines += pool_table(pool64, pool8) + [""]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
