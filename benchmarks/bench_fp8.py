"""Block-scaled FP8 base experts against bf16 ones, with and without bf16 LoRA, in CUDA graphs.

    python benchmarks/bench_fp8.py --models qwen3-30b-a3b deepseek-v3 --M 1 8 64 256 1024 4096 \\
        --out benchmarks/results/bench_fp8_NVIDIA_H100.json

Per model shape and token count M, each ``fused_experts`` call is captured in a CUDA graph and the graphs
are timed interleaved, each replay after an L2 flush (``moelora.bench.graph_times_us``, the method of
``moelora bench``): the bf16 base, the FP8 base (weights quantized per 128 x 128 block, x and h per token and
128-column group inside the call), and each of them with ``--adapters`` adapters of rank ``--ranks`` on the
split path. Reported: µs, the FP8 speedup over bf16 (base), each base's LoRA overhead, and the FP8 base's
weight bandwidth (bytes of the routed experts' FP8 weights and scales over its time) as a fraction of the
device's HBM peak. Weights, routing and adapters are ``moelora bench``'s (same seeds).

``--ab-env NAME=VALUE`` also times every FP8 call with that switch set (captured with it, timed in the same
interleaved rounds) and reports the ratio, for levers smaller than the drift between two runs.

Writes a markdown table to stdout and, with ``--out``, JSON plus the table as .md beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moelora.bench import (  # noqa: E402
    MODELS,
    device_peaks,
    graph_times_us,
    lora_inputs,
    make_biases,
    make_lora_buffers,
    make_routing,
    make_weights,
    token_slots_for,
)
from moelora.torch_path import quantize_fp8_blocks  # noqa: E402
from triton_ops import overrides  # noqa: E402
from triton_ops.fp8 import BlockFp8Weights  # noqa: E402
from triton_ops.fused_experts import fused_experts  # noqa: E402

SLOTS = 8
BLOCK = (128, 128)


def routed_expert_count(ids: torch.Tensor, num_experts: int) -> int:
    return int(torch.unique(ids[(ids >= 0) & (ids < num_experts)]).numel())


def with_env(assignment: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` called with ``assignment`` (``NAME=VALUE``: a launch override of ``triton_ops.overrides`` or
    an environment variable) in effect: the launch switches are read as a call launches its kernels, so a
    graph captured from it keeps that variant's."""
    name, _, value = assignment.partition("=")

    def call() -> Any:
        if name in overrides.CHOICES:
            with overrides.applied({name: value}):
                return fn()
        before = os.environ.get(name)
        os.environ[name] = value
        try:
            return fn()
        finally:
            if before is None:
                del os.environ[name]
            else:
                os.environ[name] = before
    return call


def bench_model(name: str, ms: list[int], ranks: list[int], adapters: list[int], warmup: float, rep: float,
                seed: int, ab_env: str | None = None) -> list[dict[str, Any]]:
    shape = MODELS[name]
    device, dtype = torch.device("cuda"), torch.bfloat16
    w13, w2 = make_weights(shape, dtype, device, seed)
    w13_q, w13_s = quantize_fp8_blocks(w13, BLOCK)
    w2_q, w2_s = quantize_fp8_blocks(w2, BLOCK)
    fp8 = BlockFp8Weights(w13_s, w2_s, BLOCK)
    # The shape's own math (gpt-oss: the clamped SwiGLU and expert biases) in every call.
    math = dict(activation=shape.activation, w13_bias=None, w2_bias=None)
    math["w13_bias"], math["w2_bias"] = make_biases(shape, dtype, device, seed)
    peak = device_peaks(torch.cuda.get_device_name())["hbm_tbps"]
    records = []
    for m in ms:
        weights, ids = make_routing(m, shape, seed + m, device)
        gen = torch.Generator().manual_seed(seed + 7 * m + 1)
        x = torch.randn(m, shape.H, generator=gen).to(device, dtype)
        calls = {
            "bf16": lambda: fused_experts(x, w13, w2, weights, ids, **math),
            "fp8": lambda: fused_experts(x, w13_q, w2_q, weights, ids, fp8=fp8, **math),
        }
        for rank in ranks:
            buf = make_lora_buffers(shape, rank, SLOTS, dtype, device, seed + rank)
            for n in adapters:
                slots = token_slots_for(m, n, "uniform", seed + 13 * m + n)
                lora = lora_inputs(buf, slots, SLOTS, n, rank, device)
                calls[f"bf16 r{rank} x{n}"] = (lambda lora=lora: fused_experts(
                    x, w13, w2, weights, ids, lora=lora, lora_path="split", **math))
                calls[f"fp8 r{rank} x{n}"] = (lambda lora=lora: fused_experts(
                    x, w13_q, w2_q, weights, ids, fp8=fp8, lora=lora, lora_path="split", **math))
        if ab_env:  # every FP8 call again with the switch set, timed in the same rounds
            calls |= {f"{label} [B]": with_env(ab_env, fn) for label, fn in calls.items()
                      if label.startswith("fp8")}
        timed = graph_times_us(list(calls.values()), warmup, rep)
        times = dict(zip(calls, (us for us, _ in timed), strict=True))
        experts = routed_expert_count(ids, shape.E)
        fp8_bytes = experts * (3 * shape.H * shape.I + 4 * (w13_s[0].numel() + w2_s[0].numel()))
        record: dict[str, Any] = dict(model=name, M=m, E=shape.E, top_k=shape.top_k, H=shape.H, I=shape.I,
                                      routed_experts=experts, times_us=times,
                                      fp8_speedup=times["bf16"] / times["fp8"],
                                      fp8_weight_tbps=fp8_bytes / times["fp8"] / 1e6,
                                      overheads={})
        record["fp8_roofline"] = record["fp8_weight_tbps"] / peak if peak else None
        for label in calls:
            if " r" in label and not label.endswith("[B]"):
                base = label.split()[0]
                record["overheads"][label] = times[label] / times[base] - 1
        if ab_env:
            record["ab_env"] = ab_env
            record["b_over_a"] = {label[:-4]: times[label] / times[label[:-4]] for label in calls
                                  if label.endswith(" [B]")}
        records.append(record)
        overheads = ", ".join(f"{k} {100 * v:+.1f} %" for k, v in record["overheads"].items())
        ab = "".join(f", {ab_env} {k}: {v:.3f}x" for k, v in record.get("b_over_a", {}).items())
        print(f"{name} M={m}: bf16 {times['bf16']:.1f} µs, fp8 {times['fp8']:.1f} µs "
              f"({record['fp8_speedup']:.2f}x), {overheads}{ab}", file=sys.stderr, flush=True)
    return records


def markdown(records: list[dict[str, Any]], title: str) -> str:
    lora_labels = sorted({k.split(" ", 1)[1] for r in records for k in r["overheads"]},
                         key=lambda s: (int(s.split()[0][1:]), int(s.split()[1][1:])))
    head = ("| model | M | bf16 base µs | FP8 base µs | FP8 speedup | FP8 weight TB/s (roofline) | "
            + " | ".join(f"LoRA {label}: bf16 / FP8 overhead" for label in lora_labels) + " |")
    lines = [title, "", head, "|---|---:|---:|---:|---:|---:|" + "---:|" * len(lora_labels)]
    for r in records:
        t = r["times_us"]
        roof = f"{r['fp8_weight_tbps']:.2f}" + (f" ({r['fp8_roofline']:.2f})" if r["fp8_roofline"] else "")
        over = r["overheads"]
        cells = [f"{100 * over[f'bf16 {label}']:+.1f} / {100 * over[f'fp8 {label}']:+.1f} %"
                 for label in lora_labels]
        lines.append(f"| {r['model']} | {r['M']} | {t['bf16']:.1f} | {t['fp8']:.1f} | "
                     f"{r['fp8_speedup']:.2f} | {roof} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "deepseek-v3"], choices=list(MODELS))
    parser.add_argument("--M", nargs="+", type=int, default=[1, 8, 64, 256, 1024, 4096])
    parser.add_argument("--ranks", nargs="+", type=int, default=[16])
    parser.add_argument("--adapters", nargs="+", type=int, default=[4])
    parser.add_argument("--warmup", type=float, default=10.0, help="ms of warm-up per call")
    parser.add_argument("--rep", type=float, default=40.0, help="ms of timed replays per call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ab-env", metavar="NAME=VALUE", help="also time every FP8 call with this "
                        "environment switch set (captured with it, timed in the same rounds); reported as "
                        "b_over_a, time with it over time without")
    parser.add_argument("--out", type=Path, metavar="FILE.json")
    args = parser.parse_args(argv)
    if min(args.M) < 1 or not all(1 <= n <= SLOTS for n in args.adapters) or min(args.ranks) < 1:
        parser.error(f"--M and --ranks must be >= 1, --adapters in [1, {SLOTS}]")
    if args.ab_env is not None and ("=" not in args.ab_env or not args.ab_env.partition("=")[0]):
        parser.error(f"--ab-env must be NAME=VALUE, got {args.ab_env!r}")
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("needs a CUDA GPU with compiled Triton (TRITON_INTERPRET unset)")
    records = []
    for name in args.models:
        records += bench_model(name, args.M, args.ranks, args.adapters, args.warmup, args.rep, args.seed,
                               args.ab_env)
        torch.cuda.empty_cache()
    device = torch.cuda.get_device_name()
    title = (f"FP8 (128 x 128 block-scaled W8A8) against bf16 base experts on {device}, bf16 LoRA on the "
             f"split path; CUDA graphs, L2 flushed, interleaved; torch {torch.__version__}")
    table = markdown(records, title)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = dict(device=device, torch=torch.__version__, records=records)
        args.out.write_text(json.dumps(payload, indent=1))
        args.out.with_suffix(".md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
