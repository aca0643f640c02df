"""The ``moelora`` command line (also ``python -m moelora``).

Without a CUDA GPU the Triton kernels run in Triton's interpreter; the switch has to be set before any
kernel module is imported, which is why the kernel imports below happen inside the commands.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def _select_device(requested: str) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for, but torch sees no CUDA GPU")
    if requested == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return torch.device(requested)


def cmd_smoke(args: argparse.Namespace) -> int:
    """Base fused MoE on a small embedded shape, checked against the fp32 reference."""
    device = _select_device(args.device)
    from moelora.reference import reference_moe, softmax_topk
    from triton_ops import fused_experts

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    if device.type == "cpu" and dtype == torch.bfloat16:
        raise SystemExit("bf16 needs the GPU: Triton's interpreter computes bf16 dot products wrongly")
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    failed = False
    print(f"moelora smoke: base fused MoE (Triton) vs fp32 reference on {device} ({args.dtype})")
    print(f"| {'E':>3} | {'top_k':>5} | {'H':>4} | {'I':>4} | {'M':>4} | {'max |Δ|':>9} | {'rel':>8} | "
          f"{'ms':>8} | ok |")
    print("|" + "|".join("-" * w for w in (5, 7, 6, 6, 6, 11, 10, 10, 4)) + "|")
    shapes = ((8, 2, 64, 48, 6), (16, 4, 96, 80, 13), (6, 1, 48, 40, 3))  # (E, top_k, H, I, M)
    for num_experts, top_k, hidden, inter, tokens in shapes:
        x = torch.randn(tokens, hidden, generator=gen)
        w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
        w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
        weights, ids = softmax_topk(torch.randn(tokens, num_experts, generator=gen), top_k)
        expected = reference_moe(x, w13, w2, weights, ids)
        args_dev = [t.to(device) for t in (x, w13, w2)]
        args_dev = [t.to(dtype) for t in args_dev] + [weights.to(device), ids.to(device)]
        start = time.perf_counter()
        out = fused_experts(*args_dev)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed_ms = (time.perf_counter() - start) * 1e3
        err = (out.float().cpu() - expected).abs().max().item()
        rel = err / max(expected.abs().max().item(), 1e-12)
        ok = bool(torch.isfinite(out).all()) and rel <= (1e-4 if dtype == torch.float32 else 2e-2)
        failed |= not ok
        rows.append((num_experts, top_k, hidden, inter, tokens, err, rel, elapsed_ms, ok))
        print(f"| {num_experts:>3} | {top_k:>5} | {hidden:>4} | {inter:>4} | {tokens:>4} | {err:9.2e} | "
              f"{rel:8.1e} | {elapsed_ms:8.1f} | {'✓' if ok else '✗'}  |")
    print("all outputs match the reference" if not failed else "MISMATCH against the reference")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moelora", description="Serve many LoRA adapters of one MoE model.")
    sub = parser.add_subparsers(dest="command", required=True)
    smoke = sub.add_parser("smoke", help="run the base fused MoE on small shapes and check it")
    smoke.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    smoke.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default=None)
    smoke.add_argument("--seed", type=int, default=0)
    smoke.set_defaults(func=cmd_smoke)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "dtype", "") is None:
        args.dtype = "bf16" if args.device != "cpu" and torch.cuda.is_available() else "fp32"
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
