"""Tensor- and expert-parallel MoE LoRA layers against one GPU: layer time with and without LoRA, the
all-reduce's share, adapter bytes per GPU.

    torchrun --nproc-per-node 2 benchmarks/bench_parallel.py --tp 2 --out results/bench_parallel_tp2.json
    torchrun --nproc-per-node 2 benchmarks/bench_parallel.py --ep 2
    torchrun --nproc-per-node 2 benchmarks/bench_parallel.py --dry-run --ep 2   # CPU, gloo: checks the script

Per model shape and token count M, with 4 rank-16 adapters mixed in the batch (decode, M <= 64: one token
per sequence, adapters round-robin; larger M: 4 sequences):

* one GPU (rank 0 alone, the others wait): the layer without adapters (``base``) and with them (``lora``);
* all ranks, each holding its shard (``moelora.parallel.MoEShard``; ``--tp``, ``--ep``, their product the
  world size): the layer with ``reduce_results=True`` over the world group, base and LoRA, and the
  all-reduce of the (M, H) output alone (``allreduce``).

Timing: each call captured in a CUDA graph (warmed up on a side stream first), then ``--replays`` replays of
base and LoRA interleaved, each after reading a 256 MB buffer (L2 cold, as ``moelora bench``), on CUDA
events; the median. Every rank replays the same number of times (the all-reduce in the graph keeps them in
step); the reported time is rank 0's. LoRA overhead = lora / base - 1, on one GPU and sharded; the ratio
of the two is the target (at most 1.2). Bytes: the pool's LoRA buffers on each GPU (one slot per adapter,
``max_loras`` 4 at ``max_rank`` 16), against one GPU's.

Writes a markdown table to stdout and, with ``--out``, JSON plus the table as .md beside it (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_host  # noqa: E402

from moelora.bench import DRY_RUN_MODEL, MODELS, ModelShape, make_routing  # noqa: E402
from moelora.layer import FusedMoEWithLoRA  # noqa: E402
from moelora.parallel import MoEShard  # noqa: E402
from moelora.pool import MoELoRAMemoryPool  # noqa: E402

ADAPTERS, RANK, MAX_LORAS, MAX_RANK = 4, 16, 4, 16
FLUSH_BYTES = 256 * 1024**2


def make_pool(shape: ModelShape, shard: MoEShard | None, dtype: torch.dtype,
              device: torch.device) -> MoELoRAMemoryPool:
    return bench_host.make_pool(shape, ADAPTERS, RANK, MAX_RANK, dtype, device, seed=0, max_loras=MAX_LORAS,
                                shard=shard)


def pool_bytes(pool: MoELoRAMemoryPool) -> int:
    """Device bytes the resident adapters take in the pool's arena."""
    return pool.memory_report().used_bytes


def timed_us(fns: list[Any], replays: int, on_gpu: bool) -> list[float]:
    """Median µs of each function, interleaved, each call after an L2 flush; a CUDA graph of each on GPU."""
    if not on_gpu:
        out = []
        for fn in fns:
            fn()
            times = []
            for _ in range(replays):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            out.append(statistics.median(times))
        return out
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for fn in fns:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graphs.append(graph)
    flush = torch.zeros(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    sink = torch.empty((), dtype=torch.int32, device="cuda")
    for graph in graphs:
        for _ in range(3):
            graph.replay()
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in graphs]
              for _ in range(replays)]
    for i in range(replays):
        for j in (range(len(graphs)) if i % 2 == 0 else reversed(range(len(graphs)))):
            torch.amax(flush, dim=0, out=sink)
            events[i][j][0].record()
            graphs[j].replay()
            events[i][j][1].record()
    torch.cuda.synchronize()
    return [statistics.median(events[i][j][0].elapsed_time(events[i][j][1]) * 1e3 for i in range(replays))
            for j in range(len(graphs))]


def bench_shape(shape: ModelShape, ms: list[int], tp: int, ep: int, replays: int, dtype: torch.dtype,
                device: torch.device, on_gpu: bool) -> list[dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(shape.E, 2 * shape.I, shape.H, generator=gen, device=device, dtype=torch.float32)
           .mul_(shape.H**-0.5).to(dtype))
    w2 = (torch.randn(shape.E, shape.H, shape.I, generator=gen, device=device, dtype=torch.float32)
          .mul_(shape.I**-0.5).to(dtype))
    shard = MoEShard(shape.E, shape.I, tp_rank=rank // ep, tp_size=tp, ep_rank=rank % ep, ep_size=ep)
    local13, local2 = shard.split_weights(w13, w2)
    sharded_pool = make_pool(shape, shard, dtype, device)
    sharded = FusedMoEWithLoRA(local13, local2, pool=sharded_pool, layer_id=0, process_group=group,
                               reduce_results=True)
    single_pool = single = None
    if rank == 0:
        single_pool = make_pool(shape, None, dtype, device)
        single = FusedMoEWithLoRA(w13, w2, pool=single_pool, layer_id=0)
    records = []
    for m in ms:
        x = torch.randn(m, shape.H, generator=gen, device=device, dtype=torch.float32).to(dtype)
        weights, ids = make_routing(m, shape, seed=m, device=device)
        names, lens = bench_host.batch_layout(m, ADAPTERS)
        record: dict[str, Any] = dict(model=shape.name, M=m, E=shape.E, top_k=shape.top_k, H=shape.H,
                                      I=shape.I, tp=tp, ep=ep, rank=RANK, adapters=ADAPTERS, replays=replays)
        if rank == 0:
            batch = single_pool.prepare_batch(names, lens)
            record["single_base_us"], record["single_lora_us"] = timed_us(
                [lambda: single(x, weights, ids, None), lambda: single(x, weights, ids, batch)], replays,
                on_gpu)
            record["single_lora_bytes"] = pool_bytes(single_pool)
        dist.barrier(group=group)
        batch = sharded_pool.prepare_batch(names, lens)
        out = torch.empty(m, shape.H, device=device, dtype=dtype)
        base_us, lora_us, reduce_us = timed_us(
            [lambda: sharded(x, weights, ids, None), lambda: sharded(x, weights, ids, batch),
             lambda: dist.all_reduce(out, group=group)], replays, on_gpu)
        record.update(sharded_base_us=base_us, sharded_lora_us=lora_us, allreduce_us=reduce_us,
                      sharded_lora_bytes=pool_bytes(sharded_pool))
        if rank == 0:
            record["single_overhead"] = record["single_lora_us"] / record["single_base_us"] - 1
            record["sharded_overhead"] = lora_us / base_us - 1
            record["overhead_ratio"] = (record["sharded_overhead"] / record["single_overhead"]
                                        if record["single_overhead"] > 0 else float("nan"))
            record["speedup_base"] = record["single_base_us"] / base_us
            record["speedup_lora"] = record["single_lora_us"] / lora_us
            record["bytes_ratio"] = record["sharded_lora_bytes"] / record["single_lora_bytes"]
            records.append(record)
            print(f"{shape.name} M={m}: 1 GPU base {record['single_base_us']:.1f} lora "
                  f"{record['single_lora_us']:.1f} µs (+{100 * record['single_overhead']:.1f} %); "
                  f"{world} GPUs base {base_us:.1f} lora {lora_us:.1f} µs "
                  f"(+{100 * record['sharded_overhead']:.1f} %), "
                  f"all-reduce {reduce_us:.1f} µs", file=sys.stderr, flush=True)
    return records


def markdown(records: list[dict[str, Any]], title: str) -> str:
    lines = [title, "", "| model | M | 1 GPU base µs | 1 GPU LoRA µs | 1 GPU overhead | sharded base µs "
             "| sharded LoRA µs | sharded overhead | overhead ratio | all-reduce µs | speedup base / LoRA "
             "| LoRA bytes per GPU |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        lines.append(
            f"| {r['model']} | {r['M']} | {r['single_base_us']:.1f} | {r['single_lora_us']:.1f} | "
            f"{100 * r['single_overhead']:+.1f} % | {r['sharded_base_us']:.1f} | "
            f"{r['sharded_lora_us']:.1f} | {100 * r['sharded_overhead']:+.1f} % | "
            f"{r['overhead_ratio']:.2f} | "
            f"{r['allreduce_us']:.1f} | {r['speedup_base']:.2f} / {r['speedup_lora']:.2f} | "
            f"{r['sharded_lora_bytes'] / 2**20:.1f} MiB ({r['bytes_ratio']:.2f}) |")
    return "\n".join(lines) + "\n"


def plot(records: list[dict[str, Any]], out: Path, title: str) -> bool:
    """Per model: LoRA overhead against M on one GPU and sharded, and the sharded layer's speedup over one
    GPU (base, LoRA). False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[warn] matplotlib is not installed: no plot written", file=sys.stderr)
        return False
    models = list(dict.fromkeys(r["model"] for r in records))
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.2 * len(models)), squeeze=False)
    for row, model in zip(axes, models, strict=True):
        rs = [r for r in records if r["model"] == model]
        ms = [r["M"] for r in rs]
        row[0].plot(ms, [100 * r["single_overhead"] for r in rs], "o-", label="1 GPU")
        row[0].plot(ms, [100 * r["sharded_overhead"] for r in rs], "s-", label="sharded")
        row[0].set_ylabel("LoRA overhead %")
        row[1].plot(ms, [r["speedup_base"] for r in rs], "o-", label="base")
        row[1].plot(ms, [r["speedup_lora"] for r in rs], "s-", label="with LoRA")
        row[1].axhline(1.0, color="grey", lw=0.8)
        row[1].set_ylabel("speedup over 1 GPU")
        for ax in row:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens M")
            ax.set_title(model, fontsize=9)
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def rank_setup(dry_run: bool, model_names: list[str], ms: list[int]
               ) -> tuple[torch.device, torch.dtype, list[ModelShape], list[int]]:
    """This torchrun rank's device (its LOCAL_RANK GPU, made current), dtype, model shapes and token
    counts: bf16 on the GPU; the dry run's tiny fp32 shape and M on the CPU."""
    if dry_run:
        return torch.device("cpu"), torch.float32, [DRY_RUN_MODEL], [1, 8, 80]
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return device, torch.bfloat16, [MODELS[name] for name in model_names], ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    parser.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "deepseek-v3"],
                        choices=list(MODELS))
    parser.add_argument("--M", nargs="+", type=int, default=[1, 64, 1024, 4096])
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--out", type=Path, metavar="FILE.json")
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, a tiny shape: checks the script")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("run it under torchrun: torchrun --nproc-per-node N benchmarks/bench_parallel.py ...")
    on_gpu = not args.dry_run
    if on_gpu and not torch.cuda.is_available():
        parser.error("needs CUDA GPUs (or --dry-run)")
    dist.init_process_group("nccl" if on_gpu else "gloo")
    try:
        world = dist.get_world_size()
        if args.tp * args.ep != world:
            raise SystemExit(f"--tp {args.tp} x --ep {args.ep} must equal the world size {world}")
        device, dtype, models, ms = rank_setup(args.dry_run, args.models, args.M)
        replays = 3 if args.dry_run else args.replays
        records = []
        for shape in models:
            records += bench_shape(shape, ms, args.tp, args.ep, replays, dtype, device, on_gpu)
            torch.cuda.empty_cache() if on_gpu else None
        if dist.get_rank() == 0:
            name = torch.cuda.get_device_name(device) if on_gpu else "cpu (dry run)"
            title = (f"MoE LoRA layer, TP={args.tp} x EP={args.ep} on {world} x {name} against one: "
                     f"{ADAPTERS} adapters of rank {RANK}, bf16, CUDA graphs, L2 flushed, "
                     f"median of {replays}")
            table = markdown(records, title)
            print(table)
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(dict(device=name, world=world, tp=args.tp, ep=args.ep,
                                                    torch=torch.__version__, records=records), indent=1))
                args.out.with_suffix(".md").write_text(table)
                plot(records, args.out.with_suffix(".png"), title.split(":")[0])
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
