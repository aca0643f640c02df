"""Hot-load: GB/s from a PEFT safetensors file to a GPU slot, and the serving step time while an
asynchronous load is in flight.

    python benchmarks/bench_hotload.py   # DeepSeek-V2-Lite-sized: 26 MoE layers, 64 experts, rank 16

The adapter is written once as a per-expert (F1) PEFT checkpoint in float32 (as training usually saves
it) into a temporary directory. Reported:
  - load_adapter (read + validate + stage + copy into the slot): seconds (the median of ``--loads``) and
    GB/s of file bytes; and the same for a re-load served from the host tier (no disk);
  - a decode loop of one MoE layer with LoRA (M tokens, CUDA graph replays): step time alone and while
    ``load_adapter_async`` runs (median, mean, p99), with the relative impact (target <= 2 % in mean
    and p99).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moelora import FusedMoEWithLoRA, MoELoRAMemoryPool  # noqa: E402


def write_f1_adapter(
    path: Path,
    layer_ids: list[int],
    experts: int,
    hidden: int,
    inter: int,
    rank: int,
    dtype: torch.dtype,
    seed: int,
) -> int:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for lid in layer_ids:
        for e in range(experts):
            prefix = f"base_model.model.model.layers.{lid}.mlp.experts.{e}"
            for proj, (n_in, n_out) in (
                ("gate_proj", (hidden, inter)),
                ("up_proj", (hidden, inter)),
                ("down_proj", (inter, hidden)),
            ):
                tensors[f"{prefix}.{proj}.lora_A.weight"] = (
                    torch.randn(rank, n_in, generator=gen) / n_in**0.5
                ).to(dtype)
                tensors[f"{prefix}.{proj}.lora_B.weight"] = (
                    torch.randn(n_out, rank, generator=gen) / rank**0.5
                ).to(dtype)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": ["gate_proj", "up_proj", "down_proj"],
        "bias": "none",
        "use_dora": False,
        "use_rslora": False,
        "lora_dropout": 0.0,
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "deepseek-v2-lite-sized",
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return (path / "adapter_model.safetensors").stat().st_size


def _p99(times: list[float]) -> float:
    """The 99th percentile (nearest rank) of ``times``."""
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=26)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=1408)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=16, help="decode batch of the serving loop")
    parser.add_argument("--loads", type=int, default=5, help="disk loads timed (their median is reported)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-pin", action="store_true",
                        help="copy from pageable host memory, without the pool's pinned staging buffer")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_hotload.py needs a CUDA GPU")
    layer_ids = list(range(1, args.layers + 1))  # DeepSeek: layer 0 is dense
    e, h, i, r = args.experts, args.hidden, args.inter, args.rank
    tmp = Path(tempfile.mkdtemp(prefix="moelora-hotload-"))
    sizes = {
        n: write_f1_adapter(tmp / n, layer_ids, e, h, i, r, torch.float32, seed)
        for seed, n in enumerate(("serving", "hot1", "hot2"))
    }
    pool = MoELoRAMemoryPool(
        num_experts=e,
        hidden_size=h,
        intermediate_size=i,
        layer_ids=layer_ids,
        max_loras=4,
        max_rank=r,
        dtype=torch.bfloat16,
        device="cuda",
        max_cpu_loras=args.loads + 4,
        pin_host_memory=not args.no_pin,
    )
    results: dict = {
        "device": torch.cuda.get_device_name(),
        "adapter_file_bytes": sizes["hot1"],
        "layers": args.layers,
        "experts": e,
        "hidden": h,
        "intermediate": i,
        "rank": r,
    }

    t0 = time.perf_counter()
    pool.load_adapter("serving", tmp / "serving")
    torch.cuda.synchronize()
    t_first = time.perf_counter() - t0  # includes one-off import/warm-up costs
    # Disk loads under new names (a name the host tier holds would be served from there); the median.
    load_times = []
    for k in range(args.loads):
        t0 = time.perf_counter()
        pool.load_adapter(f"hot1-{k}", tmp / "hot1")
        torch.cuda.synchronize()
        load_times.append(time.perf_counter() - t0)
        pool.unload_adapter(f"hot1-{k}")
    t_load = statistics.median(load_times)
    pool.load_adapter("hot1", tmp / "hot1")
    pool.unload_adapter("hot1")
    t0 = time.perf_counter()
    pool.load_adapter("hot1", tmp / "hot1")  # from the host tier
    torch.cuda.synchronize()
    t_host = time.perf_counter() - t0
    slot_bytes = next(a.bytes for a in pool.memory_report().adapters if a.name == "hot1")  # its arena bytes
    pool.unload_adapter("hot1")
    results.update(
        first_load_s=t_first,
        load_s=t_load,
        load_s_all=load_times,
        load_gbps_file=sizes["hot1"] / t_load / 1e9,
        host_tier_load_s=t_host,
        host_tier_gbps_slot=slot_bytes / t_host / 1e9,
        slot_bytes=slot_bytes,
    )

    # Serving loop: one MoE layer with LoRA at decode, CUDA graph replays.
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=gen) / h**0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=gen) / i**0.5
    layer = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=layer_ids[0])
    x = torch.randn(args.tokens, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    weights, ids = torch.topk(
        torch.softmax(torch.randn(args.tokens, e, device="cuda", generator=gen), -1), args.top_k, -1
    )
    ids = ids.to(torch.int32)
    batch = pool.prepare_batch(["serving"] * args.tokens)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            layer(x, weights, ids, batch)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(x, weights, ids, batch)

    def step_times(n: int, until=None) -> list[float]:
        times = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        while len(times) < n or (until is not None and not until.done()):
            start.record()
            for _ in range(10):  # a "step": ten layers' worth of replays
                graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000 / 10)
        return times

    step_times(50)
    base = step_times(300)
    future = pool.load_adapter_async("hot2", tmp / "hot2")
    t0 = time.perf_counter()
    during = step_times(1, until=future)
    t_async = time.perf_counter() - t0
    future.result()
    after = step_times(300)
    base_us = statistics.median(base + after)
    base_mean, base_p99 = statistics.fmean(base + after), _p99(base + after)
    results.update(
        step_us_alone=base_us,
        step_us_alone_mean=base_mean,
        step_us_alone_p99=base_p99,
        step_us_during_load_median=statistics.median(during),
        step_us_during_load_mean=statistics.fmean(during),
        step_us_during_load_p99=_p99(during),
        steps_during_load=len(during),
        async_load_s=t_async,
        impact_median=statistics.median(during) / base_us - 1,
        impact_mean=statistics.fmean(during) / base_mean - 1,
        impact_p99=_p99(during) / base_p99 - 1,
    )
    assert pool.is_resident("hot2")
    pool.close()
    for key, value in results.items():
        print(f"{key:28s} {value:.4g}" if isinstance(value, float) else f"{key:28s} {value}")
    out = (
        args.out
        or Path(__file__).parent / "results" / f"bench_hotload_{results['device'].replace(' ', '_')}.json"
    )
    out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
