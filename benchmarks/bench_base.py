"""Benchmark the base fused MoE kernel (``triton_ops.fused_experts``) against a naive PyTorch loop.

For each model shape (E experts, top-k, hidden H, intermediate I) and each token count M this times

* ``fused``: one ``fused_experts(x, w13, w2, topk_weights, topk_ids)`` call (alignment included),
  captured in a CUDA graph and timed over graph replays, and
* ``naive``: a PyTorch loop over the experts actually routed in the batch (gather, gate/up matmul,
  SiLU-and-mul, down matmul, weighted scatter-add). It synchronises, so it runs eagerly.

and reports µs per call, speedup, achieved HBM bandwidth over the bytes the call must touch
(distinct routed experts' weights + activations in/out), achieved TFLOP/s, and both as a fraction of
the device's peak.

Cache effects: the default timer (``cold``, ``moelora.bench.cold_l2_time_ms``) reads a 256 MB buffer
before every timed call, which evicts L2 (50 MB on H100) and leaves it clean; ``do_bench``
(``triton.testing.do_bench``) writes the buffer instead, and the write-back of its dirty lines then lands
in the timed call (+9-10 us on an H100 decode layer). On top of that, when the weights one call touches are
small (< 200 MB, e.g. DeepSeek-V2-Lite / Qwen3 at small M) the benchmark keeps several copies of the
weights, captures one graph per copy, and replays them in turn, so that ``--timer events`` (back-to-back
replays without a flush) does not measure L2-resident weights either.

GPU run:   python benchmarks/bench_base.py
CPU check: python benchmarks/bench_base.py --dry-run --out /tmp/bench_dry.json   (Triton interpreter)
"""

from __future__ import annotations

import os
import sys

# The Triton interpreter must be switched on before triton is imported anywhere.
if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from moelora.bench import ModelShape  # noqa: E402
from triton_ops import fused_experts  # noqa: E402

MODELS: dict[str, ModelShape] = {
    m.name.lower(): m
    for m in (
        ModelShape("DeepSeek-V2-Lite", 64, 6, 2048, 1408),
        ModelShape("Qwen3-30B-A3B", 128, 8, 2048, 768),
        ModelShape("DeepSeek-V3", 256, 8, 7168, 2048),
        ModelShape("Mixtral-8x7B", 8, 2, 4096, 14336),
    )
}
DRY_RUN_MODEL = ModelShape("tiny", 8, 2, 64, 48)
DEFAULT_M = [1, 16, 64, 256, 1024, 4096]
QUICK_M = [1, 64, 1024]
DRY_RUN_M = [1, 5]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# Dense bf16/fp16 tensor-core peak (no sparsity) and HBM bandwidth, from the vendor datasheets.
# "measured_tflops" is a practically reachable bf16 GEMM rate, printed as a second reference.
PEAKS: list[tuple[str, dict[str, float | None]]] = [
    # (regex on torch.cuda.get_device_name(), peaks); first match wins.
    (r"H100.*PCIe", {"hbm_tbps": 2.0, "tc_tflops": 756.0, "measured_tflops": None}),
    (r"H100.*NVL", {"hbm_tbps": 3.9, "tc_tflops": 835.0, "measured_tflops": None}),
    (r"H100", {"hbm_tbps": 3.35, "tc_tflops": 989.0, "measured_tflops": 790.0}),  # SXM5 / HBM3
    (r"H200", {"hbm_tbps": 4.8, "tc_tflops": 989.0, "measured_tflops": None}),
]

L2_BYTES_NOTE = "H100 L2 is 50 MB; H200 L2 is 50 MB"
ROTATE_BELOW_BYTES = 200 * 1024**2  # rotate weight copies when one call touches less than this
MAX_WEIGHT_COPIES = 4


def device_peaks(device_name: str) -> dict[str, float | None]:
    for pattern, peaks in PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return dict(peaks)
    return {"hbm_tbps": None, "tc_tflops": None, "measured_tflops": None}


def slugify(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


def make_routing(
    M: int, E: int, top_k: int, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random router logits -> softmax -> top-k -> renormalise. Deterministic on every device."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(M, E, generator=gen, dtype=torch.float32)
    probs = torch.softmax(logits, dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return (
        topk_weights.to(device=device, dtype=torch.float32).contiguous(),
        topk_ids.to(device=device, dtype=torch.int32).contiguous(),
    )


def make_weights(
    shape: ModelShape, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 (E, 2I, H) = [gate; up], w2 (E, H, I); generated directly in ``dtype`` on the device."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(shape.E, 2 * shape.I, shape.H, generator=gen, device=device, dtype=dtype)
    w13.mul_(shape.H**-0.5)
    w2 = torch.randn(shape.E, shape.H, shape.I, generator=gen, device=device, dtype=dtype)
    w2.mul_(shape.I**-0.5)
    return w13, w2


# --------------------------------------------------------------------------------------------------
# Naive baseline
# --------------------------------------------------------------------------------------------------


def naive_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Per-expert PyTorch loop over the experts actually routed (one host sync for the counts)."""
    M, H = x.shape
    E = w13.shape[0]
    inter = w2.shape[2]
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1).long()
    flat_w = topk_weights.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=E).tolist()  # syncs
    out = torch.zeros(M, H, dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        idx = order[start : start + n]
        start += n
        tok = idx // top_k
        h = x[tok] @ w13[e].t()  # (n, 2I)
        act = F.silu(h[:, :inter]) * h[:, inter:]
        y = act @ w2[e].t()  # (n, H)
        out.index_add_(0, tok, y.float() * flat_w[idx, None])
    return out.to(x.dtype)


def naive_estimate_s(shape: ModelShape, M: int, experts_touched: int) -> float:
    """Pessimistic guess of one naive call: ~150 TFLOP/s for the small GEMMs + ~100 µs per expert."""
    flops = 2 * M * shape.top_k * 3 * shape.H * shape.I
    return flops / 150e12 + experts_touched * 100e-6


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------


def cpu_time_ms(fn: Callable[[], Any], warmup: int = 1, reps: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def events_time_ms(fn: Callable[[], Any], warmup_ms: float, rep_ms: float, rounds: int = 5) -> float:
    """Back-to-back calls between two CUDA events (no L2 flush); median over ``rounds`` rounds."""
    fn()
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(5):
        fn()
    t1.record()
    torch.cuda.synchronize()
    est = max(t0.elapsed_time(t1) / 5, 1e-3)
    n_warm = max(1, int(warmup_ms / est))
    n_iter = max(1, int(rep_ms / rounds / est))
    for _ in range(n_warm):
        fn()
    results = []
    for _ in range(rounds):
        t0.record()
        for _ in range(n_iter):
            fn()
        t1.record()
        torch.cuda.synchronize()
        results.append(t0.elapsed_time(t1) / n_iter)
    return statistics.median(results)


def gpu_time_ms(fn: Callable[[], Any], timer: str, warmup_ms: float, rep_ms: float) -> float:
    if timer == "events":
        return events_time_ms(fn, warmup_ms, rep_ms)
    if timer == "cold":
        from moelora.bench import cold_l2_time_ms

        return cold_l2_time_ms(fn, warmup_ms, rep_ms, flush="read")
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def capture_graph(fn: Callable[[], torch.Tensor], n_warmup: int = 3) -> torch.cuda.CUDAGraph:
    """Eager warm-up on a side stream (compiles/autotunes), then capture one call."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(n_warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def cycler(fns: list[Callable[[], Any]]) -> Callable[[], Any]:
    """A callable that calls ``fns[0]``, ``fns[1]``, ... in turn."""
    state = [0]

    def call() -> Any:
        i = state[0]
        state[0] = (i + 1) % len(fns)
        return fns[i]()

    return call


# --------------------------------------------------------------------------------------------------
# Benchmark
# --------------------------------------------------------------------------------------------------


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a32, b32 = a.float(), b.float()
    return float((a32 - b32).norm() / b32.norm().clamp_min(1e-12))


def n_copies_for(touched_weight_bytes: int, model_bytes: int, free_bytes: int | None) -> int:
    if touched_weight_bytes >= ROTATE_BELOW_BYTES:
        return 1
    n = min(MAX_WEIGHT_COPIES, max(2, math.ceil(ROTATE_BELOW_BYTES / max(touched_weight_bytes, 1))))
    if free_bytes is not None:  # never let the copies take more than half the free memory
        n = max(1, min(n, int(0.5 * free_bytes // model_bytes)))
    return n


def bench_point(
    shape: ModelShape,
    x: torch.Tensor,
    weights: list[tuple[torch.Tensor, torch.Tensor]],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    touched: int,
    dtype_name: str,
    args: argparse.Namespace,
    peaks: dict[str, float | None],
) -> dict[str, Any]:
    """Time one (model, M) point; ``weights`` holds the copies to rotate over (graph per copy)."""
    M = x.shape[0]
    on_gpu = x.device.type == "cuda"
    elem = x.element_size()
    n_copies = len(weights)

    def fused_call(i: int) -> torch.Tensor:
        return fused_experts(x, weights[i][0], weights[i][1], topk_weights, topk_ids)

    def naive_call(i: int) -> torch.Tensor:
        return naive_experts(x, weights[i][0], weights[i][1], topk_weights, topk_ids)

    calls = [functools.partial(fused_call, i) for i in range(n_copies)]
    out_fused = fused_call(0)

    used_graph = False
    graphs: list[torch.cuda.CUDAGraph] = []
    note = None
    if on_gpu:
        if not args.no_graph:
            try:
                graphs = [capture_graph(c) for c in calls]
                used_graph = True
            except Exception as exc:  # e.g. a host sync inside fused_experts
                graphs = []
                note = f"CUDA graph capture failed ({type(exc).__name__}: {exc}); timed eagerly"
                print(f"  [warn] M={M}: {note}", flush=True)
                torch.cuda.synchronize()
        fns: list[Callable[[], Any]] = [g.replay for g in graphs] if used_graph else list(calls)
        fused_ms = gpu_time_ms(cycler(fns), args.timer, args.warmup, args.rep)
    else:
        fused_ms = cpu_time_ms(cycler(list(calls)))
    del graphs

    naive_ms = None
    err = None
    est_s = naive_estimate_s(shape, M, touched)
    if not args.no_naive and est_s <= args.naive_max_s:
        out_naive = naive_call(0)
        err = rel_err(out_fused, out_naive)
        if not math.isfinite(err) or err > 5e-2:
            print(f"  [warn] M={M}: fused vs naive relative error {err:.3e}", flush=True)
        del out_naive
        naive_fn = cycler([functools.partial(naive_call, i) for i in range(n_copies)])
        if on_gpu:
            naive_ms = gpu_time_ms(naive_fn, "do_bench", args.warmup, args.naive_rep)
        else:
            naive_ms = cpu_time_ms(naive_fn)
    elif not args.no_naive:
        print(f"  [skip naive] M={M}: estimated {est_s:.2f} s per call > --naive-max-s", flush=True)
    del out_fused

    act_bytes = 2 * M * shape.H * elem  # x in + out
    bytes_touched = touched * 3 * shape.H * shape.I * elem + act_bytes
    flops = 2 * M * shape.top_k * 3 * shape.H * shape.I
    fused_s = fused_ms * 1e-3
    tbps = bytes_touched / fused_s / 1e12
    tflops = flops / fused_s / 1e12
    hbm, tc, tc_meas = peaks["hbm_tbps"], peaks["tc_tflops"], peaks["measured_tflops"]
    rec: dict[str, Any] = {
        "model": shape.name,
        "E": shape.E,
        "top_k": shape.top_k,
        "H": shape.H,
        "I": shape.I,
        "M": M,
        "dtype": dtype_name,
        "fused_us": fused_ms * 1e3,
        "naive_us": None if naive_ms is None else naive_ms * 1e3,
        "speedup": None if naive_ms is None else naive_ms / fused_ms,
        "tbps": tbps,
        "tflops": tflops,
        "experts_touched": touched,
        "bytes_touched": bytes_touched,
        "flops": flops,
        "pct_hbm_peak": None if hbm is None else 100 * tbps / hbm,
        "pct_tc_peak": None if tc is None else 100 * tflops / tc,
        "pct_tc_measured_peak": None if tc_meas is None else 100 * tflops / tc_meas,
        "weight_copies": n_copies,
        "cuda_graph": used_graph,
        "rel_err_vs_naive": err,
        "note": note,
    }
    naive_txt = "-" if naive_ms is None else f"{naive_ms * 1e3:.1f} us"
    speed_txt = "-" if rec["speedup"] is None else f"{rec['speedup']:.1f}x"
    print(
        f"  M={M:>5}: fused {rec['fused_us']:.1f} us, naive {naive_txt}, speedup {speed_txt}, "
        f"{tbps:.3f} TB/s, {tflops:.2f} TFLOP/s, experts {touched}/{shape.E}, copies {n_copies}, "
        f"rel err vs naive {fmt(err, '.1e')}",
        flush=True,
    )
    return rec


def bench_model(
    shape: ModelShape,
    Ms: list[int],
    dtype_name: str,
    args: argparse.Namespace,
    device: torch.device,
    peaks: dict[str, float | None],
) -> list[dict[str, Any]]:
    dtype = DTYPES[dtype_name]
    elem = torch.empty((), dtype=dtype).element_size()
    expert_bytes = 3 * shape.H * shape.I * elem
    model_bytes = shape.E * expert_bytes
    on_gpu = device.type == "cuda"

    if on_gpu:
        free, _ = torch.cuda.mem_get_info()
        if model_bytes > 0.9 * free:
            print(
                f"[skip] {shape.name}: needs {model_bytes / 1e9:.1f} GB of weights, {free / 1e9:.1f} GB free"
            )
            return []
    else:
        free = None

    routings = {}
    for M in Ms:
        tw, ti = make_routing(M, shape.E, shape.top_k, args.seed + M, device)
        routings[M] = (tw, ti, int(torch.unique(ti).numel()))

    w13, w2 = make_weights(shape, dtype, device, args.seed)
    free_now = torch.cuda.mem_get_info()[0] if on_gpu else None
    copies_needed = {M: n_copies_for(routings[M][2] * expert_bytes, model_bytes, free_now) for M in Ms}
    weights = [(w13, w2)]
    for _ in range(max(copies_needed.values()) - 1):
        weights.append((w13.clone(), w2.clone()))
    print(
        f"[{shape.name}] E={shape.E} top_k={shape.top_k} H={shape.H} I={shape.I} {dtype_name}: "
        f"{model_bytes / 1e9:.2f} GB of expert weights, weight copies: {len(weights)}",
        flush=True,
    )

    records = []
    for M in Ms:
        topk_weights, topk_ids, touched = routings[M]
        gen = torch.Generator(device="cpu").manual_seed(args.seed + 7 * M + 1)
        x = torch.randn(M, shape.H, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
        rec = bench_point(
            shape, x, weights[: copies_needed[M]], topk_weights, topk_ids, touched, dtype_name, args, peaks
        )
        records.append(rec)
        del x

    del weights, w13, w2, routings
    gc.collect()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return records


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown_table(records: list[dict[str, Any]], peaks: dict[str, float | None]) -> str:
    tc_hdr = "%TC peak"
    if peaks["measured_tflops"] is not None:
        tc_hdr = f"%TC peak ({peaks['tc_tflops']:.0f} / meas. {peaks['measured_tflops']:.0f})"
    lines = [
        f"| model | M | fused µs | naive µs | speedup | TB/s | %HBM peak | TFLOP/s | {tc_hdr} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        tc = fmt(r["pct_tc_peak"], ".1f")
        if r["pct_tc_measured_peak"] is not None:
            tc = f"{tc} / {r['pct_tc_measured_peak']:.1f}"
        lines.append(
            f"| {r['model']} | {r['M']} | {r['fused_us']:.1f} | {fmt(r['naive_us'], '.1f')} | "
            f"{fmt(r['speedup'], '.1f')} | {r['tbps']:.3f} | {fmt(r['pct_hbm_peak'], '.1f')} | "
            f"{r['tflops']:.2f} | {tc} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models",
        nargs="+",
        default=None,
        help="subset of models by name, comma or space separated: "
        + ", ".join(m.name for m in MODELS.values()),
    )
    p.add_argument("--M", nargs="+", type=int, default=None, help=f"token counts (default {DEFAULT_M})")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="default bf16; fp16 with --dry-run (the Triton 3.9 interpreter's tl.dot is wrong on bf16)",
    )
    p.add_argument("--no-naive", action="store_true", help="skip the naive PyTorch baseline")
    p.add_argument(
        "--naive-max-s", type=float, default=1.0, help="skip naive when one call is estimated slower"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON output (default benchmarks/results/bench_base_<device>.json)",
    )
    p.add_argument("--quick", action="store_true", help=f"M in {QUICK_M} and shorter timing")
    p.add_argument(
        "--timer",
        choices=["cold", "do_bench", "events"],
        default="cold",
        help="cold: per call, L2 emptied by a 256 MB read before each (default); do_bench: by a 256 MB write "
        "(triton.testing.do_bench); events: back-to-back replays",
    )
    p.add_argument("--warmup", type=float, default=None, help="warm-up time per measurement in ms")
    p.add_argument("--rep", type=float, default=None, help="fused measurement time in ms")
    p.add_argument("--naive-rep", type=float, default=None, help="naive measurement time in ms")
    p.add_argument("--no-graph", action="store_true", help="time eager calls instead of CUDA graph replays")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny shapes on CPU through TRITON_INTERPRET=1 with perf_counter timing (checks the script)",
    )
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "fp16" if args.dry_run else "bf16"
    if args.warmup is None:
        args.warmup = 10.0 if args.quick else 25.0
    if args.rep is None:
        args.rep = 50.0 if args.quick else 200.0
    if args.naive_rep is None:
        args.naive_rep = 50.0 if args.quick else 100.0
    return args


def select_models(names: list[str] | None) -> list[ModelShape]:
    if not names:
        return list(MODELS.values())
    chosen = []
    for raw in names:
        for name in filter(None, (n.strip() for n in raw.split(","))):
            key = name.lower()
            if key not in MODELS:
                raise SystemExit(
                    f"unknown model {name!r}; choose from {', '.join(m.name for m in MODELS.values())}"
                )
            chosen.append(MODELS[key])
    return chosen


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    models = select_models(args.models)
    if args.dry_run:
        device = torch.device("cpu")
        device_name = "cpu (TRITON_INTERPRET=1 dry run)"
        models = [DRY_RUN_MODEL]
        Ms = args.M or DRY_RUN_M
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device; use --dry-run to check the script on CPU")
        device = torch.device("cuda")
        device_name = torch.cuda.get_device_name()
        Ms = args.M or (QUICK_M if args.quick else DEFAULT_M)
    peaks = device_peaks(device_name) if device.type == "cuda" else device_peaks("")

    print(
        f"device: {device_name}; torch {torch.__version__}, triton {triton.__version__}; dtype {args.dtype}"
    )
    print(
        f"peaks: HBM {peaks['hbm_tbps']} TB/s, tensor core {peaks['tc_tflops']} TFLOP/s dense "
        f"(measured reference {peaks['measured_tflops']})"
    )
    l2_note = (
        f"{L2_BYTES_NOTE}. Timer {args.timer}: "
        + (
            "L2 flushed (256 MB read) before every timed call. "
            if args.timer == "cold"
            else "L2 flushed (256 MB write) before every timed call. "
            if args.timer == "do_bench"
            else "back-to-back replays, no flush. "
        )
        + f"Weights rotated over up to {MAX_WEIGHT_COPIES} copies (one CUDA graph each) when one call "
        f"touches < {ROTATE_BELOW_BYTES // 1024**2} MB of expert weights."
    )
    print(f"note: {l2_note}\n", flush=True)

    records: list[dict[str, Any]] = []
    for shape in models:
        records.extend(bench_model(shape, Ms, args.dtype, args, device, peaks))

    print()
    print(markdown_table(records, peaks))

    out = args.out or REPO_ROOT / "benchmarks" / "results" / f"bench_base_{slugify(device_name)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "bench_base: triton_ops.fused_experts vs naive per-expert PyTorch loop",
        "device": device_name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {
            "models": [vars(m) | {"name": m.name} for m in models],
            "M": Ms,
            "dtype": args.dtype,
            "timer": args.timer,
            "warmup_ms": args.warmup,
            "rep_ms": args.rep,
            "naive_rep_ms": args.naive_rep,
            "naive": not args.no_naive,
            "naive_max_s": args.naive_max_s,
            "cuda_graph": not args.no_graph and device.type == "cuda",
            "seed": args.seed,
            "dry_run": args.dry_run,
            "routing": "randn logits -> softmax -> top-k -> renormalise; ids int32, weights float32",
            "bytes_model": "experts_touched * 3*H*I*elem + 2*M*H*elem (x in, out)",
            "flops_model": "2 * M * top_k * 3 * H * I",
            "cache_note": l2_note,
            "peaks": peaks,
        },
        "records": records,
    }
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
