"""The ``moelora`` command line (also ``python -m moelora``).

Without a CUDA GPU the Triton kernels run in Triton's interpreter; the switch has to be set before any
kernel module is imported, which is why the kernel imports below happen inside the commands.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

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


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job: serve a MoE model with several adapters at once and check it against PEFT."""
    from pathlib import Path

    from moelora.demo import DEFAULT_ADAPTERS, DEFAULT_MODEL, run_demo

    adapters = dict(DEFAULT_ADAPTERS)
    if args.adapter:
        adapters = {}
        for spec in args.adapter:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                print(f"moelora demo: --adapter expects NAME=DIR, got {spec!r}", file=sys.stderr)
                return 2
            adapters[name] = Path(path)
    if args.model and not args.adapter:
        print("moelora demo: with --model give the adapters too (--adapter NAME=DIR, at least two)",
              file=sys.stderr)
        return 2
    return run_demo(Path(args.model) if args.model else DEFAULT_MODEL, adapters, device=args.device,
                    new_tokens=args.new_tokens, check=not args.no_check)


def cmd_inspect(args: argparse.Namespace) -> int:
    """Reads and validates a PEFT adapter against a model's MoE shape and prints what it holds."""
    from moelora.model_config import MoEShape, moe_shape_from_dir
    from moelora.peft_loader import read_peft_adapter
    from moelora.pool import AdapterLoadError

    if args.model:
        shape = moe_shape_from_dir(args.model)
    elif None not in (args.experts, args.hidden, args.intermediate, args.layers):
        layer_ids = tuple(int(n) for n in args.layers.split(","))
        shape = MoEShape(args.experts, args.hidden, args.intermediate, layer_ids, 0, "given")
    else:
        print("moelora inspect: give --model DIR (a Hugging Face model directory) or all of --experts, "
              "--hidden, --intermediate and --layers", file=sys.stderr)
        return 2
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    try:
        _, report = read_peft_adapter(
            args.path, num_experts=shape.num_experts, hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size, layer_ids=shape.layer_ids, max_rank=args.max_rank,
            dtype=torch.float32, pool_dtype=dtype,
        )
    except AdapterLoadError as err:
        print(f"moelora inspect: cannot serve this adapter: {err}", file=sys.stderr)
        return 1
    ranks = sorted(set(report.ranks.values()))
    scalings = sorted({round(s, 6) for s in report.scalings.values()})
    experts = {lid: len(e) for lid, e in report.experts_per_layer.items()}
    print(f"adapter      {report.path}")
    print(f"model        {shape.model_type}: E={shape.num_experts} H={shape.hidden_size} "
          f"I={shape.intermediate_size}, MoE layers {list(shape.layer_ids)}")
    print(f"format       {report.format}" + (f" (PEFT {report.peft_version})" if report.peft_version else ""))
    print(f"ranks        {ranks} (slot rank {report.max_rank}; {len(report.ranks)} expert modules)")
    print(f"scalings     {scalings}")
    print(f"layers       {report.layers} (experts covered per layer: {experts})")
    print(f"pool bytes   {report.pool_bytes:,} per slot at max_rank={args.max_rank}, {args.dtype}")
    print(f"ignored keys {len(report.ignored_keys)}")
    for key, why in list(report.ignored_keys.items())[: args.show_ignored]:
        print(f"  {key}: {why}")
    if len(report.ignored_keys) > args.show_ignored:
        print(f"  ... {len(report.ignored_keys) - args.show_ignored} more")
    for note in report.notes:
        print(f"note         {note}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Times the MoE LoRA layer per path against the base fused MoE (moelora/bench.py says how)."""
    if args.dry_run and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton_ops
    from moelora.bench import BenchError, run_bench

    try:
        return run_bench(args)
    except BenchError as err:
        print(f"moelora bench: {err}", file=sys.stderr)
        return 2


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _add_bench_parser(sub) -> None:
    bench = sub.add_parser(
        "bench", help="time the LoRA overhead of the MoE layer per path (markdown, JSON, PNG)",
        description="LoRA overhead t(base+LoRA)/t(base) - 1 of the MoE layer, per path, in one run: CUDA "
        "graphs, median of replays after an L2 flush each. Writes a markdown table to stdout and JSON, "
        "markdown and a PNG plot to benchmarks/results/.",
    )
    bench.add_argument("--models", "--model", nargs="+", metavar="NAME",
                       help="deepseek-v2-lite, deepseek-v2, deepseek-v3, qwen3-30b-a3b, mixtral-8x7b "
                       "(default: all; with --config only the config's model)")
    bench.add_argument("--config", action="append", metavar="FILE.json",
                       help='a model shape {"name": .., "E": .., "top_k": .., "H": .., "I": ..} (repeatable)')
    ints = dict(nargs="+", type=_positive_int)
    bench.add_argument("--M", **ints, help="token counts (default 1 16 64 256 1024 4096)")
    bench.add_argument("--ranks", **ints, help="LoRA ranks (default 16 64)")
    bench.add_argument("--adapters", **ints, help="adapters in the batch (default 1 4)")
    bench.add_argument("--popularity", nargs="+", choices=["uniform", "zipf"],
                       help="how tokens (M <= 64) or sequences pick adapters: uniform (default) or zipf, "
                       "s=1.1")
    bench.add_argument("--dtype", choices=["bf16", "fp16"], help="default bf16 (fp16 in the CPU dry run)")
    bench.add_argument("--paths", nargs="+",
                       choices=["naive", "base", "fused", "split", "staged", "auto"],
                       help="default: base fused split staged auto (naive: a PyTorch loop, eager)")
    bench.add_argument("--quick", action="store_true",
                       help="deepseek-v2-lite, qwen3-30b-a3b and deepseek-v3, M 1 64 1024, rank 16, paths "
                       "base split auto, shorter do_bench (about a minute on an H100); explicit flags win")
    bench.add_argument("--dry-run", action="store_true",
                       help="tiny shapes (CPU: Triton interpreter, fp16, perf_counter timing): checks the "
                       "pipeline, writes JSON + PNG")
    bench.add_argument("--out", type=Path, metavar="FILE.json",
                       help="JSON path; the .md and .png go beside it (default "
                       "benchmarks/results/bench_<device>_<UTC time>.json)")
    bench.add_argument("--warmup", type=float, help="timer warm-up in ms (default 25; 10 with --quick)")
    bench.add_argument("--rep", type=float,
                       help="measurement time in ms (default 100; 30 with --quick)")
    bench.add_argument("--l2-flush", choices=["read", "write"], default="read",
                       help="how L2 is emptied before each timed call: read a 256 MB buffer (default; L2 "
                       "then holds clean lines) or write it as triton.testing.do_bench does (its ~50 MB of "
                       "dirty lines are written back inside the timed call: +9-10 us per decode layer on an "
                       "H100)")
    bench.add_argument("--naive-max-s", type=float, default=0.5,
                       help="skip the naive path when one call is estimated slower (GPU; default 0.5 s)")
    bench.add_argument("--rounds", type=int, default=1,
                       help="interleaved (base, LoRA) timing rounds per point; a row is the round of median "
                            "overhead, each round's overhead in its JSON (default 1)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--pool-rank", type=int, default=None,
                       help="size the LoRA buffers for this max rank (adapters keep --ranks): the cost of a "
                            "small adapter in a big pool")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    bench.set_defaults(func=cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moelora", description="Serve many LoRA adapters of one MoE model.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="serve a MoE model with several adapters, checked against PEFT")
    demo.add_argument("--model", help="Hugging Face MoE model dir (default: the tiny Qwen3-MoE in adapters/)")
    demo.add_argument("--adapter", action="append", metavar="NAME=DIR", help="PEFT adapter (repeat; >= 2)")
    demo.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    demo.add_argument("--new-tokens", type=int, default=8)
    demo.add_argument("--no-check", action="store_true", help="skip the comparison with PEFT")
    demo.set_defaults(func=cmd_demo)
    smoke = sub.add_parser("smoke", help="run the base fused MoE on small shapes and check it")
    smoke.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    smoke.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default=None)
    smoke.add_argument("--seed", type=int, default=0)
    smoke.set_defaults(func=cmd_smoke)

    inspect = sub.add_parser("inspect", help="validate a PEFT MoE adapter and show what it holds")
    inspect.add_argument("path", help="PEFT adapter dir (adapter_config.json + adapter_model.safetensors)")
    inspect.add_argument("--model", help="Hugging Face model directory whose config.json gives the MoE shape")
    inspect.add_argument("--experts", type=int)
    inspect.add_argument("--hidden", type=int)
    inspect.add_argument("--intermediate", type=int)
    inspect.add_argument("--layers", help="comma-separated MoE layer ids, e.g. 1,2,3")
    inspect.add_argument("--max-rank", type=int, default=64, help="pool max_rank to check against")
    inspect.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="bf16")
    inspect.add_argument("--show-ignored", type=int, default=10, help="ignored keys to list (default 10)")
    inspect.set_defaults(func=cmd_inspect)

    _add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "smoke" and args.dtype is None:
        args.dtype = "bf16" if args.device != "cpu" and torch.cuda.is_available() else "fp32"
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
