"""Per-kernel times inside one MoE layer call, base and with adapters, from a kernel trace.

    python benchmarks/trace_layer.py --models qwen3-30b-a3b --M 1024 4096 --ranks 16 --adapters 1 4

Each call is captured in a CUDA graph (as ``moelora bench`` times it, the path ``auto`` would take) and
replayed ``--replays`` times under ``torch.profiler``, L2 emptied by a 256 MB read before each replay as
in ``moelora.bench.cold_l2_time_ms``. Reported per kernel: its mean duration per replay and its share of
the replay's span (first kernel start to last kernel end), so the time between launches shows too. The
kernels run as the layer runs them, back to back: ``benchmarks/micro_lora.py`` times them one at a time.
Adapters and routing are those of ``moelora bench`` (same seeds). Beside each trace, the time ``moelora
bench`` reports: a LoRA point timed interleaved with the base (``moelora.bench.graph_times_us``), as the
bench times it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moelora.bench import (  # noqa: E402
    MODELS,
    graph_time_us,
    graph_times_us,
    lora_inputs,
    make_lora_buffers,
    make_routing,
    make_weights,
    token_slots_for,
    warm_up_on_side_stream,
)
from triton_ops.fused_experts import fused_experts  # noqa: E402
from triton_ops.plan import auto_lora_path, launch_adapter_count  # noqa: E402

_FLUSH_KERNEL_HINTS = ("reduce_kernel", "amax")


def trace_call(fn, replays: int) -> dict[str, Any]:
    """Kernels (launch position:name) -> mean µs per replay, plus the mean span of a replay (µs)."""
    warm_up_on_side_stream(fn)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.zeros(256 * 1024**2 // 4, dtype=torch.int32, device="cuda")
    sink = torch.empty((), dtype=torch.int32, device="cuda")
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(replays):
            torch.amax(flush, dim=0, out=sink)
            graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.time_range.start)
    # Replays are separated by the flush kernel; group the layer's kernels between two flushes.
    spans, current, per_kernel = [], [], collections.defaultdict(float)
    leads, flush_end = [], None
    for event in events:
        if any(hint in event.name for hint in _FLUSH_KERNEL_HINTS):
            if current:
                spans.append(current)
            current = []
            flush_end = event.time_range.end
            continue
        if not current and flush_end is not None and event.name != "Memset":
            leads.append(event.time_range.start - flush_end)
        current.append(event)
    if current:
        spans.append(current)
    for span in spans:
        for position, event in enumerate(span):
            per_kernel[f"{position}:{_short(event.name)}"] += event.time_range.elapsed_us()
    span_us = sum(s[-1].time_range.end - s[0].time_range.start for s in spans) / max(1, len(spans))
    # From the flush's end to the layer's first kernel: the graph launch the timer also counts.
    lead_us = sum(leads) / max(1, len(leads))
    return {"span_us": span_us, "lead_us": lead_us, "replays": len(spans),
            "kernels": {name: total / max(1, len(spans)) for name, total in per_kernel.items()}}


def _short(name: str) -> str:
    return name.split("(")[0][:48]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen3-30b-a3b"], choices=list(MODELS))
    parser.add_argument("--M", nargs="+", type=int, default=[1024])
    parser.add_argument("--ranks", nargs="+", type=int, default=[16])
    parser.add_argument("--adapters", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--paths", nargs="+", default=["auto"], choices=["auto", "fused", "split", "staged"],
                        help="LoRA paths to trace (auto: the one triton_ops.plan.auto_lora_path picks)")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the traces as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("needs a CUDA GPU with compiled Triton (TRITON_INTERPRET unset)")
    device, dtype = torch.device("cuda"), torch.bfloat16
    records = []
    for name in args.models:
        shape = MODELS[name]
        w13, w2 = make_weights(shape, dtype, device, args.seed)
        for m in args.M:
            topk_weights, topk_ids = make_routing(m, shape, args.seed + m, device)
            x = torch.randn(m, shape.H, generator=torch.Generator().manual_seed(args.seed + 7 * m + 1))
            x = x.to(device, dtype)
            points: list[tuple[str, Any, str]] = [("base", None, "fused")]
            for rank in args.ranks:
                buf = make_lora_buffers(shape, rank, 8, dtype, device, args.seed + rank)
                for n_adapters in args.adapters:
                    slots = token_slots_for(m, n_adapters, "uniform", args.seed + 13 * m + n_adapters)
                    lora = lora_inputs(buf, slots, 8, n_adapters, rank, device)
                    auto = auto_lora_path(m, launch_adapter_count(n_adapters))
                    for path in dict.fromkeys(auto if p == "auto" else p for p in args.paths):
                        points.append((f"r{rank} x{n_adapters} {path}", lora, path))
            base_span = None
            for label, lora, path in points:
                def layer(lora=lora, path=path):
                    return fused_experts(x, w13, w2, topk_weights, topk_ids, lora=lora, lora_path=path)

                trace = trace_call(layer, args.replays)
                if base_span is None:
                    base_layer = layer
                    trace["timed_us"], _ = graph_time_us(layer, 10, 40)
                    base_span, base_timed = trace["span_us"], trace["timed_us"]
                else:  # interleaved with the base, as moelora bench times a LoRA path
                    (base_timed, _), (trace["timed_us"], _) = graph_times_us([base_layer, layer], 10, 40)
                trace["timed_base_us"] = base_timed
                print(f"{name} M={m} {label}: span {trace['span_us']:.1f} us "
                      f"({100 * (trace['span_us'] / base_span - 1):+.1f}% over base), "
                      f"lead {trace['lead_us']:.1f} us; moelora bench's timer {trace['timed_us']:.1f} us "
                      f"({100 * (trace['timed_us'] / base_timed - 1):+.1f}% over the base timed beside it)")
                busy = 0.0
                for kernel, us in trace["kernels"].items():
                    busy += us
                    print(f"    {kernel:48s} {us:9.1f} us")
                print(f"    {'(gaps)':48s} {trace['span_us'] - busy:9.1f} us")
                records.append(dict(model=name, M=m, point=label, **trace))
        w13 = w2 = None  # noqa: F841 (frees one model's weights before the next is made)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "records": records},
                                       indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
