"""Tune the fused MoE GEMM launch configs on the current GPU and write them as JSON.

    python benchmarks/tune_moe.py --models deepseek-v2-lite qwen3-30b-a3b --M 1 16 64 256 1024 4096
    python benchmarks/tune_moe.py --dtype fp8 --models qwen3-30b-a3b deepseek-v3    # block-scaled FP8
    python benchmarks/tune_moe.py --dtype mxfp4 --models gpt-oss-20b gpt-oss-120b    # MXFP4 (W4A16)

For each model shape and token count M, the two GEMMs are tuned apart (they share BLOCK_SIZE_M, since
one alignment feeds both): every candidate BLOCK_SIZE_M is aligned once, then each GEMM's candidates
are timed with ``moelora.bench.cold_l2_time_ms`` (median, L2 emptied by a read before each call; decode
sizes, whose GEMMs take less than an eager launch's host time, replayed from CUDA graphs). The
best pair (summed time) is written to ``triton_ops/configs/E=..,N=..,device_name=..,dtype=...json`` (or
``--out-dir``), keyed by M, and the heuristic's time is printed beside it. Run with
MOELORA_MOE_CONFIG=heuristic semantics: the heuristic shown is always ``default_moe_config``.

    python benchmarks/tune_moe.py --lora-rank 16 --lora-adapters 4 --lora-only

also tunes the tiles of the layer with adapters (split path), timing whole ``fused_experts`` calls (at
decode, replayed from CUDA graphs), and stores them as each entry's ``"lora"`` object where
they beat the base's tiles (``--lora-only`` keeps the file's base entries and tunes only those).
With ``--lora-by-rank`` the tiles go into the entry's ``"lora_by_rank"`` object under the rank tile of
``--lora-rank`` instead (``MoEConfig.for_lora``), where they beat the tiles that rank tile uses now, so a
rank-16 tuning and a rank-64 one can keep different tiles.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moelora.bench import LoRABuffers, arena_weights, cold_l2_time_ms, graph_time_us  # noqa: E402
from moelora.torch_path import quantize_fp8_blocks  # noqa: E402
from triton_ops.configs import (  # noqa: E402
    GemmConfig,
    MoEConfig,
    config_file_name,
    default_moe_config,
    device_name,
)
from triton_ops.fp8 import FP8_DTYPE, BlockFp8Weights, quantize_fp8_groups  # noqa: E402
from triton_ops.fused_experts import MoELoRAInputs, fused_experts  # noqa: E402
from triton_ops.fused_moe import invoke_fused_moe_kernel, lora_rank_block  # noqa: E402
from triton_ops.hostmath import cdiv  # noqa: E402
from triton_ops.moe_align import SINGLE_PROGRAM_MAX_PAIRS, moe_align_block_size  # noqa: E402
from triton_ops.mxfp4 import Mxfp4Weights, untuned_block_k  # noqa: E402

MODELS = {
    "deepseek-v2-lite": (64, 6, 2048, 1408),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v3": (256, 8, 7168, 2048),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "deepseek-v2": (160, 6, 5120, 1536),
    "gpt-oss-20b": (32, 4, 2880, 2880),
    "gpt-oss-120b": (128, 4, 2880, 2880),
}


def candidates(num_tokens: int, top_k: int, num_experts: int, gemm: int,
               block_k: int | None = None, mxfp4: bool = False) -> list[GemmConfig]:
    """``block_k``: only this BLOCK_SIZE_K (FP8: the scale group; its one-byte tiles also let deeper
    pipelines fit in shared memory). ``mxfp4``: half-byte weight tiles, and at decode sizes also two
    warpgroups and 128-256 columns (on sm_90 each warpgroup decodes its own 64 columns for the scaled
    dot's MMA, so a second one doubles the decode throughput of a program)."""
    pairs_per_expert = num_tokens * top_k / num_experts
    out = []
    if pairs_per_expert <= 8:
        block_ms, block_ns, block_ks, warps, stages = [16], [32, 64, 128], [64, 128, 256], [4], [3, 4, 5]
        if mxfp4:
            block_ns, warps = [64, 128, 256], [4, 8]
    elif pairs_per_expert <= 48:
        block_ms, block_ns, block_ks, warps, stages = [16, 32], [64, 128], [64, 128], [4, 8], [3, 4]
    else:
        block_ms, block_ns, block_ks, warps, stages = [64, 128], [64, 128], [64, 128], [4, 8], [3, 4]
        if gemm == 2:
            block_ns = [64, 128, 256]
    a_bytes = b_bytes = 2
    if block_k is not None:
        block_ks, a_bytes, b_bytes = [block_k], 1, 1
        stages = sorted({*stages, 5})
    if mxfp4:
        b_bytes = 0.5
    for bm, bn, bk, w, s in itertools.product(block_ms, block_ns, block_ks, warps, stages):
        # Fused gate+up doubles the B tile and the accumulators of GEMM1.
        smem = s * (bm * bk * a_bytes + (2 if gemm == 1 else 1) * bk * bn * b_bytes)
        if smem > 200 * 1024:
            continue
        if bm * bn * (2 if gemm == 1 else 1) >= 128 * 256 and w < 8:
            continue
        out.append(GemmConfig(bm, bn, bk, 1 if pairs_per_expert <= 8 else 8, w, s))
    return out


def bench_gemm(fn) -> float:
    try:
        return cold_l2_time_ms(fn, 10, 40) * 1000
    except Exception as err:  # out of resources on this device: not a candidate
        print(f"    skipped: {type(err).__name__}", file=sys.stderr)
        return float("inf")


def graph_timer(fn: Callable[[], object]) -> float:
    """µs of one call replayed from a CUDA graph (cold L2): at decode a layer call is a few tens of µs,
    under the host's launch time, so timing it eagerly would time Python."""
    try:
        return graph_time_us(fn, 10, 40)[0]
    except Exception as err:  # out of resources on this device: not a candidate
        print(f"    skipped: {type(err).__name__}", file=sys.stderr)
        return float("inf")


def compile_share(job: int, jobs: int) -> Callable[[Callable[[], object]], float]:
    """A ``tune_point`` timer that times nothing: it runs every ``jobs``-th call it is given, starting at
    ``job``, once, which compiles that candidate into Triton's on-disk cache. ``jobs`` processes with
    ``job`` 0..jobs-1 compile the whole sweep between them (``--jobs``)."""
    calls = itertools.count()

    def run_share(fn: Callable[[], object]) -> float:
        if next(calls) % jobs == job:
            try:
                fn()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            except Exception as err:  # out of resources: the timed run skips it too
                print(f"    compile job {job}: skipped {type(err).__name__}", file=sys.stderr)
        return float("inf")

    return run_share


def tune_point(m: int, w13: torch.Tensor, w2: torch.Tensor, top_k: int, gen: torch.Generator,
               fp8: BlockFp8Weights | None = None,
               timer: Callable[[Callable[[], object]], float] = bench_gemm,
               mxfp4: Mxfp4Weights | None = None):
    """Best MoEConfig for M tokens, with its time and the heuristic's time (µs, both GEMMs), each GEMM
    timed by ``timer``. ``fp8``: the scales of float8_e4m3fn w13/w2; the GEMMs then read x and h quantized
    (bf16 activations), with BLOCK_SIZE_K the scale group. ``mxfp4``: the scales of uint8 MXFP4 blocks
    w13 (E, 2I, H / 2) / w2 (E, H, I / 2), decoded in the GEMMs (bf16 activations)."""
    num_experts, two_i, hidden = w13.shape
    hidden *= 2 if mxfp4 is not None else 1
    inter = two_i // 2
    dtype = torch.bfloat16 if fp8 is not None or mxfp4 is not None else w13.dtype
    x = torch.randn(m, hidden, device="cuda", dtype=dtype, generator=gen)
    logits = torch.randn(m, num_experts, device="cuda", generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).reshape(-1).contiguous()
    ids = ids.to(torch.int32)
    act = torch.empty(m * top_k, inter, device="cuda", dtype=dtype)
    pair_out = torch.empty(m * top_k, hidden, device="cuda", dtype=dtype)

    gemm1_a, gemm2_a, gemm1_fp8, gemm2_fp8, block_k = x, act, {}, {}, None
    if fp8 is not None:
        block_n, block_k = fp8.block_shape
        gemm1_a, x_scale = quantize_fp8_groups(x, block_k)
        gemm2_a, h_scale = quantize_fp8_groups(act.normal_(generator=gen), block_k)
        gemm1_fp8 = dict(a_scale=x_scale, b_scale=fp8.w13_scale, scale_block_n=block_n)
        gemm2_fp8 = dict(a_scale=h_scale, b_scale=fp8.w2_scale, scale_block_n=block_n)
    if mxfp4 is not None:
        gemm1_fp8, gemm2_fp8 = dict(b_scale=mxfp4.w13_scale), dict(b_scale=mxfp4.w2_scale)

    def time_gemm1(cfg: GemmConfig, align: dict) -> float:
        return timer(lambda: invoke_fused_moe_kernel(
            gemm1_a, w13, act, topk_weights=None, a_row_div=top_k, config=cfg, activation="silu", **align,
            **gemm1_fp8))

    def time_gemm2(cfg: GemmConfig, align: dict) -> float:
        return timer(lambda: invoke_fused_moe_kernel(
            gemm2_a, w2, pair_out, topk_weights=weights, a_row_div=1, config=cfg, **align, **gemm2_fp8))

    def align_for(block_m: int) -> dict:
        s, e, n = moe_align_block_size(ids, block_m, num_experts)
        return dict(sorted_ids=s, expert_ids=e, num_post_padded=n)

    default = default_moe_config(m, num_experts, hidden, inter, top_k, dtype)
    if mxfp4 is not None:  # the tiles an untuned MXFP4 layer runs
        default = replace(default, **{gemm: replace(tile, block_k=untuned_block_k(tile.block_k))
                                      for gemm, tile in (("gemm1", default.gemm1), ("gemm2", default.gemm2))})
    if block_k is not None:
        default = replace(default, gemm1=replace(default.gemm1, block_k=block_k),
                          gemm2=replace(default.gemm2, block_k=block_k))
    default_align = align_for(default.block_m)
    default_us = time_gemm1(default.gemm1, default_align) + time_gemm2(default.gemm2, default_align)
    best_us, best = default_us, default
    by_block_m: dict[int, tuple[list, list]] = {}
    for gemm in (1, 2):
        for cfg in candidates(m, top_k, num_experts, gemm, block_k, mxfp4=mxfp4 is not None):
            by_block_m.setdefault(cfg.block_m, ([], []))[gemm - 1].append(cfg)
    for block_m, (c1s, c2s) in by_block_m.items():
        align = align_for(block_m)
        t1, c1 = min(((time_gemm1(c, align), c) for c in c1s), key=lambda r: r[0])
        t2, c2 = min(((time_gemm2(c, align), c) for c in c2s), key=lambda r: r[0])
        if t1 + t2 < best_us:
            best_us, best = t1 + t2, MoEConfig(c1, c2)
    return best, best_us, default_us


def lora_inputs(m: int, w13: torch.Tensor, rank: int, adapters: int, gen: torch.Generator) -> MoELoRAInputs:
    """``adapters`` adapters of rank ``rank`` in an 8-slot pool, every token on one of them (uniform)."""
    num_experts, two_i, hidden = w13.shape
    inter, slots, dtype, device = two_i // 2, max(8, adapters), w13.dtype, w13.device
    kw = dict(device=device, dtype=dtype, generator=gen)
    ranks = torch.zeros(slots, dtype=torch.int32, device=device)
    ranks[:adapters] = rank
    dense = LoRABuffers(
        gate_up_a=torch.randn(slots, num_experts, 2 * rank, hidden, **kw) / hidden**0.5,
        gate_up_b=torch.randn(slots, num_experts, two_i, rank, **kw) / rank**0.5,
        down_a=torch.randn(slots, num_experts, rank, inter, **kw) / inter**0.5,
        down_b=torch.randn(slots, num_experts, hidden, rank, **kw) / rank**0.5,
    )
    return MoELoRAInputs(
        token_slots=torch.randint(0, adapters, (m,), device=device, generator=gen, dtype=torch.int32),
        **arena_weights(dense),  # the pool's layout, as served
        slot_ranks=ranks, slot_scalings=torch.full((slots,), 2.0, device=device), max_rank=rank,
        num_adapters=adapters, slots_checked=True,  # as the layer passes a pool's batch
    )


def tune_lora_point(m: int, w13: torch.Tensor, w2: torch.Tensor, top_k: int, base: MoEConfig, rank: int,
                    adapters: int, gen: torch.Generator,
                    timer: Callable[[Callable[[], object]], float] = bench_gemm,
                    ) -> tuple[MoEConfig, float, float]:
    """Best tiles for the whole split LoRA layer at M tokens (alignment, shrinks, both GEMMs with their
    expands, combine: one ``fused_experts`` call, timed as a whole by ``timer``), with its time and the
    time of the base-tuned ``base``. GEMM1's tile is chosen with GEMM2's fixed, then GEMM2's, per
    BLOCK_SIZE_M."""
    num_experts, _, hidden = w13.shape
    x = torch.randn(m, hidden, device=w13.device, dtype=w13.dtype, generator=gen)
    logits = torch.randn(m, num_experts, device=w13.device, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    ids = ids.to(torch.int32)
    lora = lora_inputs(m, w13, rank, adapters, gen)

    def layer_us(cfg: MoEConfig) -> float:
        return timer(lambda: fused_experts(x, w13, w2, weights, ids, config=cfg, lora=lora,
                                           lora_path="split"))

    # A throwaway first timing: the first one after a shape's compiles read 1.2-1.7x slow on an H100
    # (Qwen3-30B M=1024: 1065 us, then 632 us for tiles that time like the base's in moelora bench), which
    # made any candidate look like a win.
    layer_us(base)
    base_us = layer_us(base)
    best_us, best = base_us, base
    block_ms = sorted({c.block_m for c in candidates(m, top_k, num_experts, 1)})
    for block_m in block_ms:
        gemm2 = replace(base.gemm2, block_m=block_m)
        t1, c1 = min(((layer_us(MoEConfig(c, gemm2)), c) for c in candidates(m, top_k, num_experts, 1)
                      if c.block_m == block_m), key=lambda r: r[0])
        t2, c2 = min(((layer_us(MoEConfig(c1, c)), c) for c in candidates(m, top_k, num_experts, 2)
                      if c.block_m == block_m), key=lambda r: r[0])
        if min(t1, t2) < best_us:
            best_us, best = (t2, MoEConfig(c1, c2)) if t2 <= t1 else (t1, MoEConfig(c1, gemm2))
    return best, best_us, base_us


def compile_sweep(names: list[str], token_counts: list[int], dtype: torch.dtype, job: int, jobs: int) -> None:
    """Compiles job ``job``'s share (``compile_share``) of the base sweep of every model in ``names``, with
    one uninitialized expert broadcast over E (stride 0 specializes like the real strides, all multiples of
    16): a few MB, so ``jobs`` processes fit beside each other on one GPU."""
    for name in names:
        num_experts, top_k, hidden, inter = MODELS[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        w13 = torch.empty(1, 2 * inter, hidden, device="cuda", dtype=dtype).expand(num_experts, -1, -1)
        w2 = torch.empty(1, hidden, inter, device="cuda", dtype=dtype).expand(num_experts, -1, -1)
        fp8 = mxfp4 = None
        if dtype == FP8_DTYPE:
            block_n, block_k = BlockFp8Weights.block_shape
            fp8 = BlockFp8Weights(*(
                torch.ones(1, cdiv(w.shape[1], block_n), cdiv(w.shape[2], block_k), device="cuda")
                .expand(num_experts, -1, -1) for w in (w13, w2)))
        elif dtype == torch.uint8:
            w13, w2 = (w[..., : w.shape[-1] // 2] for w in (w13, w2))  # two values a byte
            mxfp4 = Mxfp4Weights(*(torch.full((1, w.shape[1], w.shape[2] // 16), 127, dtype=torch.uint8,
                                              device="cuda").expand(num_experts, -1, -1) for w in (w13, w2)))
        for m in token_counts:
            tune_point(m, w13, w2, top_k, gen, fp8, timer=compile_share(job, jobs), mxfp4=mxfp4)


def precompile(names: list[str], token_counts: list[int], dtype: torch.dtype, jobs: int) -> None:
    """Triton's compiles bound a sweep (one CPU core each, seconds per candidate): ``jobs`` processes
    compile it into the on-disk cache first, and the timed run then only loads binaries."""
    context = torch.multiprocessing.get_context("spawn")
    workers = [context.Process(target=compile_sweep, args=(names, token_counts, dtype, job, jobs))
               for job in range(jobs)]
    print(f"compiling the sweep in {jobs} processes", flush=True)
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    failed = [job for job, worker in enumerate(workers) if worker.exitcode != 0]
    if failed:
        print(f"compile jobs {failed} failed; the timed run compiles what they left", file=sys.stderr)


def tune_shape(name: str, token_counts: list[int], dtype: torch.dtype, out_dir: Path, lora_rank: int = 0,
               lora_adapters: int = 4, lora_only: bool = False, lora_by_rank: bool = False
               ) -> tuple[str, dict]:
    num_experts, top_k, hidden, inter = MODELS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    fp8 = mxfp4 = None
    weight_dtype = torch.bfloat16 if dtype in (FP8_DTYPE, torch.uint8) else dtype
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", dtype=weight_dtype,
                      generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, device="cuda", dtype=weight_dtype,
                     generator=gen) / inter**0.5
    if dtype == torch.uint8:  # random MXFP4 blocks and scales: the values do not change the timing
        def blocks(rows: int, cols: int) -> torch.Tensor:
            return torch.randint(0, 256, (num_experts, rows, cols // 2), device="cuda", generator=gen,
                                 dtype=torch.int32).to(torch.uint8)

        def scales(rows: int, cols: int) -> torch.Tensor:
            return torch.randint(118, 126, (num_experts, rows, cols // 32), device="cuda", generator=gen,
                                 dtype=torch.int32).to(torch.uint8)

        w13, w2 = blocks(2 * inter, hidden), blocks(hidden, inter)
        mxfp4 = Mxfp4Weights(scales(2 * inter, hidden), scales(hidden, inter))
    if dtype == FP8_DTYPE:
        (w13, w13_scale), (w2, w2_scale) = quantize_fp8_blocks(w13), quantize_fp8_blocks(w2)
        fp8 = BlockFp8Weights(w13_scale, w2_scale)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / config_file_name(num_experts, inter, device_name(), dtype)
    results = json.loads(path.read_text()) if lora_only and path.is_file() else {}
    for m in token_counts:
        if lora_only and str(m) in results:
            tuned = MoEConfig.from_dict(results[str(m)])
        else:
            # Decode-sized GEMMs take a few µs, less than an eager launch's host time: timed from graphs.
            timer = graph_timer if m * top_k <= SINGLE_PROGRAM_MAX_PAIRS else bench_gemm
            tuned, tuned_us, default_us = tune_point(m, w13, w2, top_k, gen, fp8, timer=timer, mxfp4=mxfp4)
            print(f"{name:18s} M={m:5d}  heuristic {default_us:9.1f} us  tuned {tuned_us:9.1f} us  "
                  f"({default_us / tuned_us:.2f}x)  {tuned.to_dict()}", flush=True)
        if lora_rank:
            # Whole layer calls are timed from CUDA graphs at every M: eagerly, a prefill call of a few
            # hundred µs times the host's launches (H100, DeepSeek-V2-Lite M=256, 4 adapters: 1575 us
            # eager against 470 us in moelora bench).
            rank_block = lora_rank_block(lora_rank)
            # Candidates must beat the tiles the layer runs now (this rank tile's, or "lora", or the base's).
            start = replace(tuned.for_lora(rank_block if lora_by_rank else 0), lora=None, lora_by_rank=(),
                            lora_multi_by_rank=())
            lora_cfg, lora_us, base_cfg_us = tune_lora_point(m, w13, w2, top_k, start, lora_rank,
                                                             lora_adapters, gen, timer=graph_timer)
            if lora_cfg != start:
                tuned = tuned.with_lora_tiles(lora_cfg, rank_block if lora_by_rank else 0)
            print(f"{name:18s} M={m:5d}  split LoRA r={lora_rank} x{lora_adapters}: current tiles "
                  f"{base_cfg_us:9.1f} us  tuned {lora_us:9.1f} us ({base_cfg_us / lora_us:.2f}x)  "
                  f"{lora_cfg.to_dict()}", flush=True)
        results[str(m)] = tuned.to_dict()
        # After every point: a run cut short (a time limit) keeps what it has measured.
        path.write_text(json.dumps(dict(sorted(results.items(), key=lambda kv: int(kv[0]))), indent=1) + "\n")
    print(f"wrote {path}")
    return path.name, results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--M", nargs="+", type=int, default=[1, 16, 64, 256, 1024, 4096])
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp8", "mxfp4"], default="bf16",
                        help="fp8: float8_e4m3fn experts with 128 x 128 block scales, bf16 activations "
                             "(files named dtype=fp8_w8a8); mxfp4: MXFP4 experts decoded in the GEMMs, "
                             "bf16 activations (dtype=mxfp4_w4a16)")
    parser.add_argument("--lora-rank", type=int, default=0, help="also tune the split LoRA layer's tiles "
                        "(prefill M) with adapters of this rank, stored as each entry's \"lora\" object")
    parser.add_argument("--lora-adapters", type=int, default=4, help="adapters in the LoRA tuning batch")
    parser.add_argument("--lora-only", action="store_true", help="keep the file's base entries; tune only "
                        "the LoRA tiles")
    parser.add_argument("--lora-by-rank", action="store_true", help="store the LoRA tiles under the rank "
                        "tile of --lora-rank (\"lora_by_rank\") instead of as \"lora\"")
    default_dir = Path(__file__).resolve().parents[1] / "triton_ops" / "configs"
    parser.add_argument("--out-dir", type=Path, default=default_dir)
    parser.add_argument("--bundle", type=Path, help="also write every tuned file into one JSON (plain name, "
                        "easy to copy off a machine); unpack it with --install")
    parser.add_argument("--jobs", type=int, default=1, help="compile the base sweep in this many processes "
                        "first (Triton's compiles, not the timing, bound a sweep)")
    parser.add_argument("--install", type=Path, help="unpack a --bundle file into --out-dir and exit")
    args = parser.parse_args()
    if args.install:
        for file_name, entries in json.loads(args.install.read_text()).items():
            (args.out_dir / file_name).write_text(json.dumps(entries, indent=1) + "\n")
            print(f"installed {args.out_dir / file_name}")
        return
    if not torch.cuda.is_available():
        raise SystemExit("tune_moe.py needs a CUDA GPU")
    os.environ["MOELORA_MOE_CONFIG"] = "heuristic"  # trial configs come from the tuner, not the files
    if args.dtype in ("fp8", "mxfp4") and args.lora_rank:
        raise SystemExit(f"--lora-rank with --dtype {args.dtype} is not supported yet: that LoRA layer uses "
                         "the base entry's tiles")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": FP8_DTYPE,
             "mxfp4": torch.uint8}[args.dtype]
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be >= 1, got {args.jobs}")
    if args.jobs > 1 and not args.lora_only:
        precompile(args.models, args.M, dtype, args.jobs)
    bundle = {}
    for name in args.models:
        file_name, entries = tune_shape(name, args.M, dtype, args.out_dir, lora_rank=args.lora_rank,
                                        lora_adapters=args.lora_adapters, lora_only=args.lora_only,
                                        lora_by_rank=args.lora_by_rank)
        bundle[file_name] = entries
        if args.bundle:
            args.bundle.write_text(json.dumps(bundle, indent=1) + "\n")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
