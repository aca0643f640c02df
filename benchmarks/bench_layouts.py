"""The layer reading a family's own expert storage against the `[gate; up]`, `(E, 2I, H)` copy of it.

The kernels can read every layout in place, through views: transposed storage (Aria, Llama-4, gpt-oss),
gpt-oss' interleaved gate/up columns (a ``(E, 2, I, H)`` halves view with stride 2 along I) and an ungated
up projection read as both halves (Nemotron-H). This times the base MoE and base + one rank-16 adapter on
both forms of the same weights, interleaved in one run on one device (CUDA graphs, L2 flushed before each
replay, the median of ``--rounds`` rounds), so the cost of reading in place is a same-run ratio. ``attach``
follows what this measures: views where they are as fast as the copy, one copy of gpt-oss' interleaved
gate/up (docs/performance.md, "Expert layouts").

    python benchmarks/bench_layouts.py --out benchmarks/results/bench_layouts_NVIDIA_H100.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from moelora import bench  # noqa: E402

# name -> (shape, layout): gpt-oss-20b-shaped layers in gpt-oss' storage and in Aria's / Llama-4's
# (transposed only); a Nemotron-3-Nano-shaped ungated layer (E=128, top-6, H=2688, I=1856).
CASES = {
    "gpt-oss-20b interleaved+transposed": (bench.MODELS["gpt-oss-20b"], "interleaved_transposed"),
    "gpt-oss-20b transposed": (bench.MODELS["gpt-oss-20b"], "transposed"),
    "nemotron-h ungated": (bench.ModelShape("nemotron-3-nano", 128, 6, 2688, 1856, activation="relu"),
                           "ungated"),
}


def _transposed(w: torch.Tensor) -> torch.Tensor:
    return w.transpose(1, 2).contiguous().transpose(1, 2)


def stored_views(layout: str, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same weights stored as the family stores them, returned as the views the layer reads."""
    e, two_i, h = w13.shape
    i = two_i // 2
    if layout == "transposed":
        return w13.transpose(1, 2).contiguous().transpose(1, 2), _transposed(w2)
    if layout == "interleaved_transposed":
        raw = w13.view(e, 2, i, h).permute(0, 3, 2, 1).reshape(e, h, two_i).contiguous()
        return raw.transpose(1, 2).unflatten(1, (i, 2)).transpose(1, 2), _transposed(w2)
    if layout == "ungated":
        return w13[:, i:].contiguous().unsqueeze(1).expand(-1, 2, -1, -1), w2
    raise ValueError(layout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--M", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from triton_ops.fused_experts import fused_experts

    device, dtype = torch.device("cuda"), torch.bfloat16
    records = []
    for case, (shape, layout) in CASES.items():
        w13, w2 = bench.make_weights(shape, dtype, device, seed=0)
        if layout == "ungated":
            w13[:, : shape.I] = w13[:, shape.I :]
        views = stored_views(layout, w13, w2)
        biases = bench.make_biases(shape, dtype, device, seed=0)
        activation = shape.activation
        buf = bench.make_lora_buffers(shape, args.rank, 8, dtype, device, seed=1)
        for m in args.M:
            weights, ids = bench.make_routing(m, shape, seed=m, device=device)
            x = torch.randn(m, shape.H, device=device, dtype=dtype)
            lora = bench.lora_inputs(buf, bench.token_slots_for(m, 1, "uniform", seed=m), 8, 1, args.rank,
                                     device)

            def call(a, b, with_lora, x=x, weights=weights, ids=ids, lora=lora):
                return lambda: fused_experts(x, a, b, weights, ids, activation=activation,
                                             lora=lora if with_lora else None, lora_path="split",
                                             w13_bias=biases[0], w2_bias=biases[1])

            fns = [call(w13, w2, False), call(*views, False), call(w13, w2, True), call(*views, True)]
            same = float((fns[2]().float() - fns[3]().float()).norm() / fns[2]().float().norm())
            times, _ = bench.graph_rounds_us(fns, 25.0, 100.0, "read", rounds=args.rounds)
            med = [statistics.median(t) for t in times]
            records.append(dict(case=case, layout=layout, M=m, E=shape.E, top_k=shape.top_k, H=shape.H,
                                I=shape.I, rank=args.rank, device=torch.cuda.get_device_name(),
                                base_copy_us=med[0], base_stored_us=med[1], lora_copy_us=med[2],
                                lora_stored_us=med[3], rel_diff=same, rounds=times))
            print(f"{case:40s} M={m:5d} base {med[0]:8.1f} -> {med[1]:8.1f} µs ({med[1] / med[0]:.3f}x)   "
                  f"+LoRA {med[2]:8.1f} -> {med[3]:8.1f} µs ({med[3] / med[2]:.3f}x)   rel diff {same:.1e}",
                  flush=True)
    if args.out:
        args.out.write_text(json.dumps(records, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
