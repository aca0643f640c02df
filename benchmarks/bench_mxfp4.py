"""MXFP4 base experts against bf16 ones of the same values, with and without bf16 LoRA, in CUDA graphs.

    python benchmarks/bench_mxfp4.py --models gpt-oss-20b gpt-oss-120b --M 1 8 64 256 1024 4096 \\
        --out benchmarks/results/bench_mxfp4_NVIDIA_H200.json

Per model shape and token count M, each ``fused_experts`` call is captured in a CUDA graph and the graphs
are timed interleaved, each replay after an L2 flush (``moelora.bench.graph_times_us``, the method of
``moelora bench``): the bf16 base, the MXFP4 base (packed E2M1 blocks and E8M0 scales, one per 32 values,
decoded in the GEMMs' K-loops; ``triton_ops.mxfp4``), and each of them with ``--adapters`` adapters of rank
``--ranks`` on the split path. Every call runs the shape's activation and expert biases (gpt-oss: the
clamped SwiGLU, biases on both GEMMs).

Weights: random MXFP4 codes (every byte drawn uniformly) and scales (2^-9 .. 2^-1); the bf16 experts are
their decoded copy (``dequantize_mxfp4_torch``, exact in bf16), so both bases compute the same function
(their outputs' relative difference is recorded). Routing, activations and adapters are ``moelora bench``'s
(same seeds). gpt-oss-120b (E=128, top-4, H=I=2880) is described here, beside ``moelora.bench.MODELS``.

Reported per (model, M): µs, the MXFP4 speedup over bf16 (base) against the targets (>= 1.8x at M <= 64,
>= 0.9x at M >= 1024), the MXFP4 base's weight bandwidth (bytes of the routed experts' blocks and scales
over its time) and its fraction of the device's HBM peak, and each base's LoRA overhead; per model, the
experts' bytes on the device, packed against bf16.

Writes a markdown table to stdout and, with ``--out``, JSON plus the table as .md beside it. ``--dry-run``
(with TRITON_INTERPRET=1 set before starting) runs a tiny shape on the CPU through Triton's interpreter,
float32 standing in for bf16 and each call timed once on the wall clock: it checks the pipeline, its numbers
mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moelora.activations import as_gated_activation  # noqa: E402
from moelora.bench import (  # noqa: E402
    MODELS,
    ModelShape,
    device_peaks,
    graph_times_us,
    lora_inputs,
    make_biases,
    make_lora_buffers,
    make_routing,
    token_slots_for,
)
from triton_ops.fused_experts import fused_experts  # noqa: E402
from triton_ops.mxfp4 import MXFP4_GROUP, Mxfp4Weights, dequantize_mxfp4_torch  # noqa: E402

SLOTS = 8
SHAPES: dict[str, ModelShape] = {**MODELS, "gpt-oss-120b": replace(MODELS["gpt-oss-20b"], name="gpt-oss-120b",
                                                                    E=128)}
DEFAULT_MODELS = ["gpt-oss-20b", "gpt-oss-120b"]
SCALE_RANGE = (118, 127)  # E8M0 scales drawn in [118, 127): 2^-9 .. 2^-1, values 2^-10 .. 3
BF16_BYTES = 2
# The targets, MXFP4 base speedup over bf16: (first M, last M, at least)
TARGETS = ((1, 64, 1.8), (1024, None, 0.9))
FULL = dict(M=[1, 8, 64, 256, 1024, 4096], ranks=[16], adapters=[4])
DRY_RUN = dict(M=[1, 5], ranks=[4], adapters=[2])
DRY_RUN_MODEL = ModelShape("tiny", 4, 2, 64, 32)  # silu, no biases
DRY_RUN_DEVICE = "cpu (TRITON_INTERPRET=1)"


def routed_expert_count(ids: torch.Tensor, num_experts: int) -> int:
    return int(torch.unique(ids[(ids >= 0) & (ids < num_experts)]).numel())


def target_for(m: int) -> float | None:
    """The speedup the MXFP4 base should reach at M tokens, None where there is no target."""
    for first, last, at_least in TARGETS:
        if m >= first and (last is None or m <= last):
            return at_least
    return None


def make_mxfp4_experts(shape: ModelShape, device: torch.device, seed: int
                       ) -> tuple[torch.Tensor, torch.Tensor, Mxfp4Weights]:
    """Random MXFP4 experts: ``w13`` blocks (E, 2I, H/2) and ``w2`` blocks (E, H, I/2), uint8 (every byte,
    so every pair of E2M1 codes, equally likely), and their E8M0 scales in ``SCALE_RANGE``."""
    for name, k in (("H", shape.H), ("I", shape.I)):
        if k % MXFP4_GROUP:
            raise ValueError(f"{shape.name}: MXFP4 needs {name} a multiple of {MXFP4_GROUP}, got {k}")
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(low: int, high: int, *dims: int) -> torch.Tensor:
        return torch.randint(low, high, dims, generator=gen, device=device, dtype=torch.uint8)

    e, h, i = shape.E, shape.H, shape.I
    w13 = draw(0, 256, e, 2 * i, h // 2)
    w2 = draw(0, 256, e, h, i // 2)
    scales = Mxfp4Weights(w13_scale=draw(*SCALE_RANGE, e, 2 * i, h // MXFP4_GROUP),
                          w2_scale=draw(*SCALE_RANGE, e, h, i // MXFP4_GROUP))
    return w13, w2, scales


def decode_experts(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dense (E, N, K) ``dtype`` experts of (E, N, K/2) blocks, one expert at a time (the PyTorch
    decode's temporaries of a whole gpt-oss-120b would take tens of GB)."""
    e, n, half_k = blocks.shape
    out = torch.empty(e, n, 2 * half_k, dtype=dtype, device=blocks.device)
    for expert in range(e):
        out[expert] = dequantize_mxfp4_torch(blocks[expert], scales[expert], dtype)
    return out


def expert_bytes(shape: ModelShape, w13: torch.Tensor, w2: torch.Tensor, mx: Mxfp4Weights) -> dict[str, Any]:
    """The experts' bytes on the device: packed (blocks + scales of w13 and w2, every expert) and bf16."""
    packed = sum(t.numel() * t.element_size() for t in (w13, w2, mx.w13_scale, mx.w2_scale))
    bf16 = shape.E * 3 * shape.H * shape.I * BF16_BYTES
    return dict(model=shape.name, E=shape.E, top_k=shape.top_k, H=shape.H, I=shape.I,
                activation=str(as_gated_activation(shape.activation)), biases=shape.biases,
                packed_gb=packed / 1e9, bf16_gb=bf16 / 1e9, bf16_over_packed=bf16 / packed)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def time_calls(calls: dict[str, Callable[[], Any]], on_gpu: bool, warmup: float, rep: float
               ) -> tuple[dict[str, float], dict[str, bool], dict[str, torch.Tensor]]:
    """(µs, CUDA graph used, output) of each call. Every call runs once first (on the GPU: compiling it),
    keeping its output; then the GPU's are captured and timed interleaved (``graph_times_us``), while the
    dry run keeps the wall-clock time of that one call."""
    outs, wall_us = {}, {}
    for label, fn in calls.items():
        t0 = time.perf_counter()
        outs[label] = fn()
        wall_us[label] = (time.perf_counter() - t0) * 1e6
    if not on_gpu:
        return wall_us, dict.fromkeys(calls, False), outs
    timed = graph_times_us(list(calls.values()), warmup, rep)
    return ({label: us for label, (us, _) in zip(calls, timed, strict=True)},
            {label: used for label, (_, used) in zip(calls, timed, strict=True)}, outs)


def bench_model(shape: ModelShape, ms: list[int], ranks: list[int], adapters: list[int], warmup: float,
                rep: float, seed: int, device: torch.device, dtype: torch.dtype
                ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the model's expert bytes, a record per M)."""
    on_gpu = device.type == "cuda"
    w13_q, w2_q, mx = make_mxfp4_experts(shape, device, seed)
    w13, w2 = decode_experts(w13_q, mx.w13_scale, dtype), decode_experts(w2_q, mx.w2_scale, dtype)
    b13, b2 = make_biases(shape, dtype, device, seed)
    act = shape.activation
    sizes = expert_bytes(shape, w13_q, w2_q, mx)
    per_expert = sum(t[0].numel() for t in (w13_q, w2_q, mx.w13_scale, mx.w2_scale))  # uint8: bytes
    peak = device_peaks(torch.cuda.get_device_name())["hbm_tbps"] if on_gpu else None
    buffers = {rank: make_lora_buffers(shape, rank, SLOTS, dtype, device, seed + rank) for rank in ranks}
    records = []
    for m in ms:
        weights, ids = make_routing(m, shape, seed + m, device)
        gen = torch.Generator().manual_seed(seed + 7 * m + 1)
        x = torch.randn(m, shape.H, generator=gen).to(device, dtype)
        calls = {
            "bf16": lambda: fused_experts(x, w13, w2, weights, ids, activation=act, w13_bias=b13,
                                          w2_bias=b2),
            "mxfp4": lambda: fused_experts(x, w13_q, w2_q, weights, ids, mxfp4=mx, activation=act,
                                           w13_bias=b13, w2_bias=b2),
        }
        for rank, buf in buffers.items():
            for n in adapters:
                slots = token_slots_for(m, n, "uniform", seed + 13 * m + n)
                lora = lora_inputs(buf, slots, SLOTS, n, rank, device)
                calls[f"bf16 r{rank} x{n}"] = (lambda lora=lora: fused_experts(
                    x, w13, w2, weights, ids, lora=lora, lora_path="split", activation=act, w13_bias=b13,
                    w2_bias=b2))
                calls[f"mxfp4 r{rank} x{n}"] = (lambda lora=lora: fused_experts(
                    x, w13_q, w2_q, weights, ids, mxfp4=mx, lora=lora, lora_path="split", activation=act,
                    w13_bias=b13, w2_bias=b2))
        times, graphed, outs = time_calls(calls, on_gpu, warmup, rep)
        # each MXFP4 call against the bf16 call of the same LoRA: the same values, so the same output
        errors = {label: rel_err(outs[label], outs["bf16" + label[len("mxfp4"):]]) for label in calls
                  if label.startswith("mxfp4")}
        del outs
        experts = routed_expert_count(ids, shape.E)
        tbps = experts * per_expert / times["mxfp4"] / 1e6
        target = target_for(m)
        speedup = times["bf16"] / times["mxfp4"]
        record: dict[str, Any] = dict(
            model=shape.name, M=m, E=shape.E, top_k=shape.top_k, H=shape.H, I=shape.I,
            routed_experts=experts, times_us=times, cuda_graphs=graphed, mxfp4_speedup=speedup,
            target_speedup=target, target_met=None if target is None else speedup >= target,
            mxfp4_weight_tbps=tbps, mxfp4_roofline=tbps / peak if peak else None,
            mxfp4_rel_err_vs_bf16=errors, overheads={})
        for label in calls:
            if " r" in label:
                record["overheads"][label] = times[label] / times[label.split()[0]] - 1
        records.append(record)
        overheads = ", ".join(f"{k} {100 * v:+.1f} %" for k, v in record["overheads"].items())
        print(f"{shape.name} M={m}: bf16 {times['bf16']:.1f} µs, mxfp4 {times['mxfp4']:.1f} µs "
              f"({speedup:.2f}x), {overheads}", file=sys.stderr, flush=True)
    return sizes, records


def _target_cell(r: dict[str, Any]) -> str:
    if r["target_speedup"] is None:
        return "-"
    return f"≥ {r['target_speedup']:g}x {'✓' if r['target_met'] else '✗'}"


def markdown(models: list[dict[str, Any]], records: list[dict[str, Any]], title: str) -> str:
    lora_labels = sorted({k.split(" ", 1)[1] for r in records for k in r["overheads"]},
                         key=lambda s: (int(s.split()[0][1:]), int(s.split()[1][1:])))
    head = ("| model | M | bf16 base µs | MXFP4 base µs | MXFP4 speedup | target | "
            "MXFP4 weight TB/s (roofline) | "
            + " | ".join(f"LoRA {label}: bf16 / MXFP4 overhead" for label in lora_labels) + " |")
    lines = [title, "", head, "|---|---:|---:|---:|---:|:---:|---:|" + "---:|" * len(lora_labels)]
    for r in records:
        t = r["times_us"]
        roof = f"{r['mxfp4_weight_tbps']:.2f}" + (f" ({r['mxfp4_roofline']:.2f})" if r["mxfp4_roofline"]
                                                   else "")
        over = r["overheads"]
        cells = [f"{100 * over[f'bf16 {label}']:+.1f} / {100 * over[f'mxfp4 {label}']:+.1f} %"
                 for label in lora_labels]
        lines.append(f"| {r['model']} | {r['M']} | {t['bf16']:.1f} | {t['mxfp4']:.1f} | "
                     f"{r['mxfp4_speedup']:.2f} | {_target_cell(r)} | {roof} | " + " | ".join(cells) + " |")
    lines += ["", "Expert weights on the device (every expert's w13 and w2; packed: E2M1 blocks + E8M0 "
              "scales, bf16: 2 bytes a value):", "",
              "| model | E | top-k | H | I | activation | biases | MXFP4 packed GB | bf16 GB | "
              "bf16 / packed |", "|---|---:|---:|---:|---:|---|:---:|---:|---:|---:|"]
    for s in models:
        lines.append(f"| {s['model']} | {s['E']} | {s['top_k']} | {s['H']} | {s['I']} | {s['activation']} | "
                     f"{'yes' if s['biases'] else 'no'} | {s['packed_gb']:.3g} | {s['bf16_gb']:.3g} | "
                     f"{s['bf16_over_packed']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(SHAPES),
                        help=f"model shapes (default: {' '.join(DEFAULT_MODELS)}; ignored by --dry-run)")
    parser.add_argument("--M", nargs="+", type=int,
                        help=f"token counts (default: {' '.join(map(str, FULL['M']))}; dry run: "
                             f"{' '.join(map(str, DRY_RUN['M']))})")
    parser.add_argument("--ranks", nargs="+", type=int,
                        help=f"LoRA ranks (default {FULL['ranks']}; dry run {DRY_RUN['ranks']})")
    parser.add_argument("--adapters", nargs="+", type=int,
                        help=f"adapters in a batch (default {FULL['adapters']}; dry run "
                             f"{DRY_RUN['adapters']})")
    parser.add_argument("--warmup", type=float, default=10.0, help="ms of warm-up per call")
    parser.add_argument("--rep", type=float, default=40.0, help="ms of timed replays per call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, metavar="FILE.json")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shape on the CPU through the Triton interpreter (needs TRITON_INTERPRET=1 "
                             "set before starting); float32, each call timed once: checks the pipeline, "
                             "its numbers mean nothing")
    args = parser.parse_args(argv)
    mode = DRY_RUN if args.dry_run else FULL
    ms, ranks, adapters = args.M or mode["M"], args.ranks or mode["ranks"], args.adapters or mode["adapters"]
    if min(ms) < 1 or not all(1 <= n <= SLOTS for n in adapters) or min(ranks) < 1:
        parser.error(f"--M and --ranks must be >= 1, --adapters in [1, {SLOTS}]")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if args.dry_run:
        if not interpret:
            parser.error("--dry-run runs the kernels on the CPU through Triton's interpreter: start it with "
                         "TRITON_INTERPRET=1 set (before triton is imported)")
        # float32: the interpreter computes bf16 dot products wrongly
        device, dtype, shapes, name = torch.device("cpu"), torch.float32, [DRY_RUN_MODEL], DRY_RUN_DEVICE
    else:
        if not torch.cuda.is_available() or interpret:
            parser.error("needs a CUDA GPU with compiled Triton (TRITON_INTERPRET unset); see --dry-run")
        device, dtype = torch.device("cuda"), torch.bfloat16
        shapes, name = [SHAPES[m] for m in args.models], torch.cuda.get_device_name()
    models, records = [], []
    for shape in shapes:
        sizes, model_records = bench_model(shape, ms, ranks, adapters, args.warmup, args.rep, args.seed,
                                           device, dtype)
        models.append(sizes)
        records += model_records
        if device.type == "cuda":
            torch.cuda.empty_cache()
    title = (f"MXFP4 (E2M1, an E8M0 scale per 32 values) against bf16 base experts of the same values on "
             f"{name}, bf16 LoRA on the split path; CUDA graphs, L2 flushed, interleaved; torch "
             f"{torch.__version__}")
    if args.dry_run:
        title = (f"DRY RUN (float32 for bf16, one wall-clock call each: the numbers mean nothing): MXFP4 "
                 f"against dense base experts on {name}; torch {torch.__version__}")
    table = markdown(models, records, title)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = dict(device=name, torch=torch.__version__, dry_run=args.dry_run, M=ms, ranks=ranks,
                       adapters=adapters, seed=args.seed, warmup_ms=args.warmup, rep_ms=args.rep,
                       models=models, records=records)
        args.out.write_text(json.dumps(payload, indent=1))
        args.out.with_suffix(".md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
