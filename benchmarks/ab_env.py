"""Interleaved A/B of a launch override (``triton_ops.overrides``) or an environment variable on the MoE
LoRA layer, for effects smaller than the drift between two ``moelora bench`` runs (a few % of the base time
on an H100/H200).

    python benchmarks/ab_env.py --env lora_prefetch=0 --models mixtral-8x7b --M 16 64

For each (model, M, rank, adapters) three CUDA graphs are captured: the base layer, the LoRA layer as the
rules launch it (A) and the LoRA layer with ``--env`` set while it is captured (B; overrides are read when
the kernels are launched, so the graph keeps B's kernels). Then ``--rounds`` rounds time
base, A and B one after the other (``moelora.bench.cold_l2_time_ms`` median each, L2 flushed by a read),
in a rotating order, so clock or thermal drift falls on all three alike. Reported per point: the median
over rounds of each overhead t/t(base) - 1 and of t(B)/t(A), with the rounds' range of t(B)/t(A); a
markdown table on stdout and, with ``--out``, JSON. Adapters and routing are those of ``moelora bench``
(same seeds).

A config edit is A/B'd the same way: ``--env MOELORA_MOE_CONFIG_DIR=DIR`` with DIR a copy of
``triton_ops/configs/`` whose entry was changed (the tuned files are read per path, so A keeps the
committed ones).

``--layer base`` times the base layer (no adapters) as A and B instead, for switches that change the base
path too (e.g. ``decode_direct=0``); the overheads are then B's and A's time over the base's. ``--layer
staged`` times the LoRA layer on the staged path (for the staged path's own rules, e.g.
``lora_by_adapter=1``).

``--dry-run`` runs a tiny shape on the CPU through the Triton interpreter (set TRITON_INTERPRET=1 before
starting it; eager calls, the numbers mean nothing) to check the script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moelora.bench import (  # noqa: E402
    DRY_RUN_MODEL,
    MODELS,
    ModelShape,
    eager_time_us,
    lora_inputs,
    make_lora_buffers,
    make_routing,
    make_weights,
    token_slots_for,
    warm_up_on_side_stream,
)
from triton_ops import overrides  # noqa: E402
from triton_ops.fused_experts import fused_experts  # noqa: E402


def parse_env(assignments: list[str]) -> dict[str, str]:
    """``NAME=VALUE`` strings as a dict; a clear error for anything else."""
    env = {}
    for item in assignments:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--env takes NAME=VALUE, got {item!r}")
        if name in overrides.CHOICES:
            try:
                overrides.parse([item])
            except ValueError as err:
                raise SystemExit(f"--env: {err}") from None
        env[name] = value
    return env


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` in effect inside the block: launch overrides (``triton_ops.overrides``, lower-case names)
    and environment variables (``MOELORA_MOE_CONFIG_DIR``, ...)."""
    launch = {name: value for name, value in env.items() if name in overrides.CHOICES}
    variables = {name: value for name, value in env.items() if name not in launch}
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        with overrides.applied(launch):
            yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def captured(fn: Callable[[], Any], on_gpu: bool) -> Callable[[], Any]:
    """A replay of one call of ``fn`` captured in a CUDA graph; ``fn`` itself off the GPU."""
    if not on_gpu:
        return fn
    warm_up_on_side_stream(fn)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def ab_point(shape: ModelShape, m: int, rank: int, n_adapters: int, env: dict[str, str], *, rounds: int,
             device: torch.device, dtype: torch.dtype, weights: tuple[torch.Tensor, torch.Tensor],
             seed: int, warmup_ms: float, rep_ms: float, base_layer: bool = False,
             lora_path: str = "split") -> dict[str, Any]:
    """Times base, A and B of one point in ``rounds`` interleaved rounds (see the module docstring);
    ``lora_path``: the LoRA layer's path (the split path, which "auto" runs, unless a rule is the staged
    path's)."""
    on_gpu = device.type == "cuda"
    w13, w2 = weights
    slots = max(8, n_adapters)
    buf = make_lora_buffers(shape, rank, slots, dtype, device, seed + rank)
    topk_weights, topk_ids = make_routing(m, shape, seed + m, device)
    x = torch.randn(m, shape.H, generator=torch.Generator().manual_seed(seed + 7 * m + 1)).to(device, dtype)
    slots_host = token_slots_for(m, n_adapters, "uniform", seed + 13 * m + n_adapters)
    lora = lora_inputs(buf, slots_host, slots, n_adapters, rank, device)

    def layer(with_lora: bool) -> torch.Tensor:
        return fused_experts(x, w13, w2, topk_weights, topk_ids, lora=lora if with_lora else None,
                             lora_path=lora_path)

    timed_lora = not base_layer
    calls = {"base": captured(lambda: layer(False), on_gpu), "A": captured(lambda: layer(timed_lora), on_gpu)}
    with environment(env):
        calls["B"] = captured(lambda: layer(timed_lora), on_gpu)
        if not on_gpu:  # eager: B's switches must hold while it runs, not only while it is captured
            b_call = calls["B"]

            def run_b() -> Any:
                with environment(env):
                    return b_call()

            calls["B"] = run_b
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for round_index in range(rounds):
        for name in order[round_index % 3:] + order[:round_index % 3]:
            times[name].append(eager_time_us(calls[name], on_gpu, warmup_ms, rep_ms, cpu_reps=2))
    ratios = [b / a for a, b in zip(times["A"], times["B"], strict=True)]
    base = statistics.median(times["base"])
    return dict(
        model=shape.name, M=m, rank=rank, n_adapters=n_adapters, env=env, rounds=rounds,
        layer="base" if base_layer else ("staged" if lora_path == "staged" else "lora"),
        base_us=base, a_us=statistics.median(times["A"]), b_us=statistics.median(times["B"]),
        a_overhead=statistics.median(a / b - 1 for a, b in zip(times["A"], times["base"], strict=True)),
        b_overhead=statistics.median(a / b - 1 for a, b in zip(times["B"], times["base"], strict=True)),
        b_over_a=statistics.median(ratios), b_over_a_min=min(ratios), b_over_a_max=max(ratios),
        times_us=times,
    )


def markdown(records: list[dict[str, Any]]) -> str:
    env = " ".join(f"{k}={v}" for k, v in records[0]["env"].items()) if records else ""
    lines = [f"A: environment as is; B: {env}", "",
             "| model | M | rank | adapters | base µs | A µs (overhead) | B µs (overhead) "
             "| B/A median [range] |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        lines.append(
            f"| {r['model']} | {r['M']} | {r['rank']} | {r['n_adapters']} | {r['base_us']:.1f} | "
            f"{r['a_us']:.1f} ({100 * r['a_overhead']:+.1f}%) | "
            f"{r['b_us']:.1f} ({100 * r['b_overhead']:+.1f}%) | "
            f"{r['b_over_a']:.3f} [{r['b_over_a_min']:.3f}, {r['b_over_a_max']:.3f}] |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", nargs="+", required=True, metavar="NAME=VALUE", help="B's switches")
    parser.add_argument("--models", nargs="+", default=["qwen3-30b-a3b"], choices=list(MODELS))
    parser.add_argument("--M", nargs="+", type=int, default=[256, 1024])
    parser.add_argument("--ranks", nargs="+", type=int, default=[16])
    parser.add_argument("--adapters", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=float, default=10.0, help="warm-up per timing, ms")
    parser.add_argument("--rep", type=float, default=40.0, help="measured time per timing, ms")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layer", choices=("lora", "base", "staged"), default="lora",
                        help="time A and B with adapters (default: the split path), the base layer, or the "
                             "LoRA layer on the staged path")
    parser.add_argument("--out", type=Path, help="also write the records as JSON")
    parser.add_argument("--dry-run", action="store_true", help="tiny shape on CPU (TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    env = parse_env(args.env)
    if args.rounds < 1 or min(args.M + args.ranks + args.adapters) < 1:
        raise SystemExit("--rounds, --M, --ranks and --adapters must be >= 1")
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--dry-run runs on CPU through the interpreter: set TRITON_INTERPRET=1")
        device, dtype, models = torch.device("cpu"), torch.float16, [DRY_RUN_MODEL]
        ms = [m for m in args.M if m <= 80] or [8]
    else:
        if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
            raise SystemExit("needs a CUDA GPU with compiled Triton (TRITON_INTERPRET unset); see --dry-run")
        device, dtype, ms = torch.device("cuda"), torch.bfloat16, args.M
        models = [MODELS[name] for name in args.models]
    records = []
    for shape in models:
        weights = make_weights(shape, dtype, device, args.seed)
        for m in ms:
            for rank in args.ranks:
                for n_adapters in args.adapters:
                    record = ab_point(shape, m, rank, n_adapters, env, rounds=args.rounds, device=device,
                                      dtype=dtype, weights=weights, seed=args.seed, warmup_ms=args.warmup,
                                      rep_ms=args.rep, base_layer=args.layer == "base",
                                      lora_path="staged" if args.layer == "staged" else "split")
                    records.append(record)
                    print(f"{shape.name} M={m} r={rank} x{n_adapters}: B/A {record['b_over_a']:.3f} "
                          f"[{record['b_over_a_min']:.3f}, {record['b_over_a_max']:.3f}]", file=sys.stderr,
                          flush=True)
        del weights
    print(markdown(records))
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda"
                                        else "cpu", "records": records}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
