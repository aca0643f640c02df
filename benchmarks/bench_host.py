"""Host (CPU) time of one eager call of the MoE LoRA layer, beside the GPU time of the same call.

    python benchmarks/bench_host.py --models qwen3-30b-a3b deepseek-v3 --M 1 8 64 256 1024 4096

What a forward costs the host before its kernels are queued (Python, argument checks, launch decisions,
Triton's launcher) is hidden behind the GPU when the queue is deep, and is the whole step time of an
eager decode step when it is not. For each model shape and token count M this times

* ``base``: ``FusedMoEWithLoRA(x, topk_weights, topk_ids, None)``, the layer without adapters (its launch
  decisions cached per token count in ``layer.launch_cache``),
* ``lora``: the same layer with a batch of ``--adapters`` adapters of rank ``--rank`` (path "auto"),
* ``base_uncached``: ``triton_ops.fused_experts.fused_experts`` called directly, no launch cache,
* ``lora_graphed``: the same LoRA call on a second layer with ``cuda_graphs=True`` (replayed from the
  graph it captured on its second call; inputs copied in, a fresh output),
* ``prepare_batch``: ``pool.prepare_batch(names, seq_lens, out=batch)``, the per-step token -> adapter
  mapping (host work and one host->device copy); every other call gives each sequence the next adapter,
  so the mapping changes every call (with unchanged names the pool returns the batch at once).

Host method: ``--warmup-calls`` calls first (Triton compiles, caches fill), then for each of ``--calls``
calls: ``torch.cuda.synchronize()``, ``t0 = time.perf_counter()``, the call, ``t1 = time.perf_counter()``.
With the GPU idle at t0, the call never waits for room in the launch queue, so t1 - t0 is the host's own
time to issue the call (until it returns, kernels queued, not finished). Reported: the median (the JSON
also holds the 10th and 90th percentiles). ``--order rounds`` (default) times the five calls in turn, one
call of each per round, so a drift of the host's speed (clocks, other processes: seen at 1.5x between
blocks of calls on an H200 host) falls on all five alike and the columns compare; each call then finds
the CPU caches holding the other calls' data, as a layer inside a model step would, which costs it some
µs (prepare_batch: ~80 instead of ~30). ``--order blocks`` times all calls of one, then the next's: hot-loop
numbers.

GPU method (base and lora only): the eager call timed on CUDA events, L2 flushed (read) before each call,
median (``moelora.bench.cold_l2_time_ms``; no CUDA graph, so launch gaps between the call's kernels count).
CUDA-graph replay times are ``moelora bench``'s.

Setup: bf16 base weights (``moelora.bench.make_weights``) and routing (``make_routing``), one pool layer
(id 0) with ``max_loras`` 8 and ``max_rank`` 64, the adapters random (a CPU generator, one A/B per
projection shape and adapter, every expert a different scaling of it: content does not matter for timing).
Adapters per token: M <= 64 (decode) every token is its own sequence, adapters round-robin; larger M
(prefill) ``--adapters`` contiguous sequences of about M / adapters tokens each.

Writes a markdown table to stdout and, with ``--out``, JSON (device, versions, settings, records).
``--dry-run`` runs a tiny shape on the CPU through the Triton interpreter (set TRITON_INTERPRET=1 before
starting it; float32, 3 calls, no GPU times) to check the script; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moelora.adapter_weights import LoRAProjection, ReferenceLoRA  # noqa: E402
from moelora.bench import (  # noqa: E402
    DECODE_MAX_TOKENS,
    DRY_RUN_MODEL,
    MODELS,
    ModelShape,
    cold_l2_time_ms,
    make_routing,
    make_weights,
)
from moelora.layer import FusedMoEWithLoRA  # noqa: E402
from moelora.parallel import MoEShard  # noqa: E402
from moelora.pool import MoELoRAMemoryPool  # noqa: E402
from triton_ops.fused_experts import fused_experts  # noqa: E402

DEFAULT_MODELS = ["qwen3-30b-a3b", "deepseek-v3"]
DEFAULT_M = [1, 8, 64, 256, 1024, 4096]
MAX_LORAS = 8
LAYER_ID = 0
SCALING = 2.0
# Full runs / --dry-run: defaults of the options left out, and the pool's max_rank.
FULL = dict(M=[*DEFAULT_M], adapters=4, rank=16, max_rank=64, calls=200, warmup_calls=20)
DRY_RUN = dict(M=[1, 5], adapters=2, rank=4, max_rank=8, calls=3, warmup_calls=1)


# --------------------------------------------------------------------------------------------------
# Setup
# --------------------------------------------------------------------------------------------------


def make_pool(shape: ModelShape, n_adapters: int, rank: int, max_rank: int, dtype: torch.dtype,
              device: torch.device, seed: int, *, max_loras: int = MAX_LORAS,
              shard: MoEShard | None = None) -> MoELoRAMemoryPool:
    """A one-layer pool (layer id 0) holding adapters ``a0 .. a{n-1}`` of rank ``rank`` on every expert
    (with ``shard``: a tensor- or expert-parallel rank's part of each).

    Each adapter draws one A and one B per projection shape; expert e uses them with its own scaling
    (``SCALING * (1 + e / E)``), which the pool folds into that expert's B, so experts differ without
    E x 6 random tensors per adapter."""
    pool = MoELoRAMemoryPool(shape.E, shape.H, shape.I, [LAYER_ID], max_loras=max_loras, max_rank=max_rank,
                             dtype=dtype, device=device, shard=shard)
    gen = torch.Generator().manual_seed(seed)

    def rnd(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=gen).mul_(0.01)

    for index in range(n_adapters):
        gate = (rnd(rank, shape.H), rnd(shape.I, rank))
        up = (rnd(rank, shape.H), rnd(shape.I, rank))
        down = (rnd(rank, shape.I), rnd(shape.H, rank))
        ref = ReferenceLoRA()
        for e in range(shape.E):
            s = SCALING * (1.0 + e / shape.E)
            ref.gate[e] = LoRAProjection(*gate, s)
            ref.up[e] = LoRAProjection(*up, s)
            ref.down[e] = LoRAProjection(*down, s)
        pool.add_adapter_weights(adapter_name(index), {LAYER_ID: ref})
    return pool


def adapter_name(index: int) -> str:
    return f"a{index}"


def batch_layout(m: int, n_adapters: int) -> tuple[list[str], list[int] | None]:
    """(adapter name per sequence, seq_lens) of M tokens: decode (M <= 64) one token per sequence, the
    adapters round-robin (seq_lens None); prefill ``n_adapters`` contiguous sequences of about M / n."""
    if m <= DECODE_MAX_TOKENS:
        return [adapter_name(t % n_adapters) for t in range(m)], None
    lens = [m // n_adapters + (1 if i < m % n_adapters else 0) for i in range(n_adapters)]
    return [adapter_name(i) for i in range(n_adapters)], lens


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of ``values``, linear between the closest ranks."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


ORDERS = ("rounds", "blocks")
WAITS = ("sync", "spin")


def gpu_wait(wait: str, on_gpu: bool) -> Callable[[], None]:
    """How the host waits for the GPU before a timed call: ``"sync"``, ``torch.cuda.synchronize()``;
    ``"spin"``, polling an event recorded on the current stream until it completes, so the thread keeps
    running on its core the whole time (a host issuing the next layer's work never sleeps in the driver)."""
    if wait not in WAITS:
        raise ValueError(f"wait must be one of {WAITS}, got {wait!r}")
    if not on_gpu:
        return lambda: None
    if wait == "sync":
        return torch.cuda.synchronize

    def spin() -> None:
        event = torch.cuda.Event()
        event.record()
        while not event.query():
            pass

    return spin


def host_times_us(fns: dict[str, Callable[[], Any]], calls: int, warmup_calls: int, on_gpu: bool,
                  order: str = "rounds", busy_us: float = 0.0, wait: str = "sync") -> dict[str, list[float]]:
    """Host µs of each of ``calls`` calls of every function in ``fns``, after ``warmup_calls`` untimed
    calls of each: the GPU is synchronized before every call, and a call is timed from its start until
    it returns.

    ``order="rounds"``: round i times one call of each function in turn (the order rotating by one each
    round), so a drift of the host's speed (clocks, other processes) falls on all of them alike;
    ``"blocks"``: all calls of one function, then the next's.
    ``busy_us``: after each synchronize, the host spins this long before the timed call, as a host running a
    model step is busy right before a layer call (a thread that waited in the synchronize may find its core
    clocked down: the first microseconds of the call then run slower).
    ``wait``: how the host waits for the GPU before each call (:func:`gpu_wait`).
"""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    sync = gpu_wait(wait, on_gpu)
    for fn in fns.values():
        for _ in range(warmup_calls):
            fn()
    sync()
    gc.collect()
    names = list(fns)
    if order == "rounds":
        schedule = [names[(i + j) % len(names)] for i in range(calls) for j in range(len(names))]
    else:
        schedule = [name for name in names for _ in range(calls)]
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in schedule:
        fn = fns[name]
        sync()
        t0 = time.perf_counter()
        if busy_us:
            deadline = t0 + busy_us * 1e-6
            while time.perf_counter() < deadline:
                pass
            t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        times[name].append((t1 - t0) * 1e6)
    sync()
    return times


def summarize(times_us: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(times_us), "p10": percentile(times_us, 10),
            "p90": percentile(times_us, 90)}


# --------------------------------------------------------------------------------------------------
# Benchmark
# --------------------------------------------------------------------------------------------------


def bench_point(shape: ModelShape, m: int, layer: FusedMoEWithLoRA, graphed: FusedMoEWithLoRA,
                n_adapters: int, *, calls: int,
                warmup_calls: int, on_gpu: bool, warmup_ms: float, rep_ms: float, seed: int,
                order: str = "rounds", busy_us: float = 0.0, wait: str = "sync") -> dict[str, Any]:
    """One (model, M) record: host µs of the five calls, GPU µs of base and lora (None off the GPU)."""
    pool, device, dtype = layer.pool, layer.w13.device, layer.w13.dtype
    w13, w2 = layer.w13, layer.w2
    x = torch.randn(m, shape.H, generator=torch.Generator().manual_seed(seed + 7 * m + 1)).to(device, dtype)
    topk_weights, topk_ids = make_routing(m, shape, seed + m, device)
    names, seq_lens = batch_layout(m, n_adapters)
    batch = pool.prepare_batch(names, seq_lens)
    shifted = [adapter_name((int(name[1:]) + 1) % n_adapters) for name in names]
    name_layouts = itertools.cycle([shifted, names])

    fns: dict[str, Callable[[], Any]] = {
        "base": lambda: layer(x, topk_weights, topk_ids, None),
        "lora": lambda: layer(x, topk_weights, topk_ids, batch),
        "lora_graphed": lambda: graphed(x, topk_weights, topk_ids, batch),
        "base_uncached": lambda: fused_experts(x, w13, w2, topk_weights, topk_ids),
        "prepare_batch": lambda: pool.prepare_batch(next(name_layouts), seq_lens, out=batch),
    }
    record: dict[str, Any] = dict(
        model=shape.name, M=m, E=shape.E, top_k=shape.top_k, H=shape.H, I=shape.I,
        dtype=str(dtype).removeprefix("torch."), n_adapters=n_adapters,
        rank=int(pool.slot_rank_host[pool.slot_of(adapter_name(0))]), max_rank=pool.max_rank,
        layout="decode" if seq_lens is None else "prefill", seq_lens=seq_lens,
        lora_path=layer.resolve_path(x, batch), calls=calls, warmup_calls=warmup_calls, order=order,
        busy_us=busy_us, wait=wait,
    )
    for name, times in host_times_us(fns, calls, warmup_calls, on_gpu, order, busy_us, wait).items():
        stats = summarize(times)
        record[f"{name}_host_us"] = stats["median"]
        record[f"{name}_host_p10_us"] = stats["p10"]
        record[f"{name}_host_p90_us"] = stats["p90"]
    for name in ("base", "lora"):
        record[f"{name}_gpu_us"] = cold_l2_time_ms(fns[name], warmup_ms, rep_ms) * 1e3 if on_gpu else None
    return record


def environment_info(on_gpu: bool) -> dict[str, str]:
    return {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu (TRITON_INTERPRET=1)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
    }


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


_WAIT_WORDS = {"sync": ", torch.cuda.synchronize() before each",
               "spin": ", a spin on a CUDA event before each"}


def markdown(records: list[dict[str, Any]], info: dict[str, str], settings: dict[str, Any]) -> str:
    lines = [
        f"Host time of one eager call (median of {settings['calls']} calls"
        f"{'' if settings['dry_run'] else _WAIT_WORDS[settings.get('wait', 'sync')]}) on {info['device']}; "
        f"torch {info['torch']}, triton {info['triton']}, python {info['python']}; "
        f"{settings['dtype']}, {settings['adapters']} adapters of rank {settings['rank']} "
        f"(max_rank {settings['max_rank']})",
        "",
        "| model | M | base host µs | base GPU µs | LoRA host µs | LoRA GPU µs | base uncached host µs "
        "| LoRA graphed host µs | prepare_batch µs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        lines.append(
            f"| {r['model']} | {r['M']} | {_us(r['base_host_us'])} | {_us(r['base_gpu_us'])} | "
            f"{_us(r['lora_host_us'])} | {_us(r['lora_gpu_us'])} | {_us(r['base_uncached_host_us'])} | "
            f"{_us(r['lora_graphed_host_us'])} | {_us(r['prepare_batch_host_us'])} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(MODELS),
                        help=f"model shapes (default: {' '.join(DEFAULT_MODELS)}; ignored by --dry-run)")
    parser.add_argument("--M", nargs="+", type=int,
                        help=f"token counts (default: {' '.join(map(str, FULL['M']))}; dry run: "
                             f"{' '.join(map(str, DRY_RUN['M']))})")
    parser.add_argument("--adapters", type=int,
                        help=f"adapters in the pool and the batch, at most {MAX_LORAS} "
                             f"(default {FULL['adapters']}; dry run {DRY_RUN['adapters']})")
    parser.add_argument("--rank", type=int,
                        help=f"adapter rank, at most the pool's max_rank {FULL['max_rank']} "
                             f"(default {FULL['rank']}; dry run {DRY_RUN['rank']}, max_rank "
                             f"{DRY_RUN['max_rank']})")
    parser.add_argument("--calls", type=int,
                        help=f"timed calls per measurement (default {FULL['calls']}; "
                             f"dry run {DRY_RUN['calls']})")
    parser.add_argument("--warmup-calls", type=int,
                        help=f"untimed calls before them (default {FULL['warmup_calls']}; "
                             f"dry run {DRY_RUN['warmup_calls']})")
    parser.add_argument("--order", choices=ORDERS, default="rounds",
                        help="rounds (default): each round times one call of each of the five in turn, so "
                             "drift falls on all alike; blocks: all calls of one, then the next's")
    parser.add_argument("--busy-us", type=float, default=0.0,
                        help="spin the host this many µs after each synchronize, before the timed call "
                             "(default 0: a host that just waited for the GPU)")
    parser.add_argument("--wait", choices=WAITS, default="sync",
                        help="how the host waits for the GPU before each timed call: sync (default), "
                             "torch.cuda.synchronize(); spin, polling a CUDA event (the thread never sleeps)")
    parser.add_argument("--warmup", type=float, default=25.0, help="GPU timing: warm-up, ms (default 25)")
    parser.add_argument("--rep", type=float, default=100.0,
                        help="GPU timing: measured time, ms (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, routing, inputs and adapters")
    parser.add_argument("--out", type=Path, metavar="FILE.json", help="also write the records as JSON")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shape on CPU through the Triton interpreter (needs TRITON_INTERPRET=1 "
                             "set before starting); float32, no GPU times; checks the script, its numbers "
                             "mean nothing")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mode = DRY_RUN if args.dry_run else FULL
    ms = args.M or mode["M"]
    n_adapters = args.adapters if args.adapters is not None else mode["adapters"]
    rank = args.rank if args.rank is not None else mode["rank"]
    calls = args.calls if args.calls is not None else mode["calls"]
    warmup_calls = args.warmup_calls if args.warmup_calls is not None else mode["warmup_calls"]
    max_rank = mode["max_rank"]
    if min(ms) < 1 or calls < 1 or warmup_calls < 0:
        raise SystemExit("--M and --calls must be >= 1, --warmup-calls >= 0")
    if not 1 <= n_adapters <= MAX_LORAS:
        raise SystemExit(f"--adapters must be in [1, {MAX_LORAS}] (the pool's max_loras), got {n_adapters}")
    if not 1 <= rank <= max_rank:
        raise SystemExit(f"--rank must be in [1, {max_rank}] (the pool's max_rank), got {rank}")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if args.dry_run:
        if not interpret:
            raise SystemExit("--dry-run runs the kernels on CPU through Triton's interpreter: start it with "
                             "TRITON_INTERPRET=1 set (it must be set before triton is imported)")
        # float32: the interpreter computes bf16 dot products wrongly.
        device, dtype, models, on_gpu = torch.device("cpu"), torch.float32, [DRY_RUN_MODEL], False
    else:
        if not torch.cuda.is_available() or interpret:
            raise SystemExit("needs a CUDA GPU with compiled Triton (TRITON_INTERPRET unset); see --dry-run")
        device, dtype, on_gpu = torch.device("cuda"), torch.bfloat16, True
        models = [MODELS[name] for name in args.models]
        for m in ms:
            if m > DECODE_MAX_TOKENS and m < n_adapters:
                raise SystemExit(f"M={m}: fewer tokens than the {n_adapters} prefill sequences")

    info = environment_info(on_gpu)
    settings = dict(dtype=str(dtype).removeprefix("torch."), adapters=n_adapters, rank=rank,
                    max_rank=max_rank, max_loras=MAX_LORAS, calls=calls, warmup_calls=warmup_calls,
                    order=args.order, busy_us=args.busy_us, wait=args.wait, warmup_ms=args.warmup,
                    rep_ms=args.rep,
                    seed=args.seed, dry_run=args.dry_run, M=ms, models=[shape.name for shape in models])
    print(f"[bench_host] {info['device']}, torch {info['torch']}, triton {info['triton']}"
          + ("; DRY RUN (timings are meaningless)" if args.dry_run else ""), file=sys.stderr, flush=True)
    records = []
    for shape in models:
        w13, w2 = make_weights(shape, dtype, device, args.seed)
        pool = make_pool(shape, n_adapters, rank, max_rank, dtype, device, args.seed + 1)
        layer = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=LAYER_ID)
        graphed = FusedMoEWithLoRA(w13, w2, pool=pool, layer_id=LAYER_ID, cuda_graphs=True,
                                   graph_max_tokens=max(ms))
        for m in ms:
            record = bench_point(shape, m, layer, graphed, n_adapters, calls=calls, warmup_calls=warmup_calls,
                                 on_gpu=on_gpu, warmup_ms=args.warmup, rep_ms=args.rep, seed=args.seed,
                                 order=args.order, busy_us=args.busy_us, wait=args.wait)
            records.append(record)
            print(f"{shape.name} M={m}: host base {record['base_host_us']:.1f} µs, "
                  f"lora {record['lora_host_us']:.1f} µs, uncached {record['base_uncached_host_us']:.1f} µs, "
                  f"prepare_batch {record['prepare_batch_host_us']:.1f} µs; GPU base "
                  f"{_us(record['base_gpu_us'])} µs, lora {_us(record['lora_gpu_us'])} µs",
                  file=sys.stderr, flush=True)
        del layer, graphed, pool, w13, w2
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
    print(markdown(records, info, settings))
    if args.out:
        args.out.write_text(json.dumps({**info, "settings": settings, "records": records}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
