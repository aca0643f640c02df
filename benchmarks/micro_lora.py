"""Per-kernel times of one MoE LoRA layer call, to see where the LoRA overhead goes.

    python benchmarks/micro_lora.py --model qwen3-30b-a3b --M 1 --rank 16

Times each launch alone, replayed from a CUDA graph (``moelora.bench.cold_l2_time_ms`` median): alignment,
GEMM1 and GEMM2 without LoRA, with the inline shrink ("fused") and with a precomputed shrink ("split"),
and the shrink kernels.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moelora.bench import MODELS, cold_l2_time_ms, make_lora_buffers, token_slots_for  # noqa: E402
from triton_ops import fused_moe  # noqa: E402
from triton_ops.configs import get_moe_config  # noqa: E402
from triton_ops.decode_shrink import (  # noqa: E402
    decode_shrink_block_k,
    decode_shrink_splits,
    moe_align_with_gate_up_shrink,
)
from triton_ops.fused_experts import MoELoRAInputs, _with_lora_tiles  # noqa: E402
from triton_ops.fused_moe import LoRAOperands, invoke_fused_moe_kernel, lora_rank_block  # noqa: E402
from triton_ops.moe_align import SINGLE_PROGRAM_MAX_PAIRS, moe_align_block_size  # noqa: E402
from triton_ops.moe_lora import moe_lora_a, shrink_k_splits  # noqa: E402
from triton_ops.shrink_reduce import reduce_shrink_splits  # noqa: E402


def us(fn) -> float:
    """Median time of one launch (or a few) replayed from a CUDA graph, L2 flushed before each replay:
    timing the Python launch directly counted its host overhead for the small kernels (the alignment's
    three launches read 70-160 us)."""
    try:
        fn()  # compile outside the capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return cold_l2_time_ms(graph.replay, 20, 100) * 1000
    except triton.runtime.errors.OutOfResources:  # a sweep point this device cannot hold
        return float("inf")


def make_lora(shape, rank: int, n_adapters: int, m: int, dtype: torch.dtype) -> MoELoRAInputs:
    """An 8-slot pool (as ``moelora bench``) with ``n_adapters`` of them used, uniform popularity."""
    slots = max(8, n_adapters)
    buf = make_lora_buffers(shape, rank, slots, dtype, torch.device("cuda"), seed=rank)
    ranks = torch.zeros(slots, dtype=torch.int32)
    ranks[:n_adapters] = rank
    token_slots = token_slots_for(m, n_adapters, "uniform", seed=m)
    return MoELoRAInputs(
        token_slots=token_slots.cuda(), **buf.weights, slot_ranks=ranks.cuda(),
        slot_scalings=torch.full((slots,), 2.0, device="cuda"), max_rank=rank,
        num_adapters=int(torch.unique(token_slots).numel()), slots_checked=True,  # as the layer's
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-30b-a3b", choices=list(MODELS))
    parser.add_argument("--M", type=int, nargs="+", default=[1])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=1)
    parser.add_argument("--no-sweep", action="store_true", help="skip the shrink launch-config sweep")
    args = parser.parse_args()
    shape = MODELS[args.model]
    num_experts, top_k, hidden, inter = shape.E, shape.top_k, shape.H, shape.I
    dtype = torch.bfloat16
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", dtype=dtype) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, device="cuda", dtype=dtype) / inter**0.5
    for m in args.M:
        x = torch.randn(m, hidden, device="cuda", dtype=dtype)
        weights, ids = torch.topk(torch.softmax(torch.randn(m, num_experts, device="cuda"), -1), top_k, -1)
        ids = ids.to(torch.int32)
        weights = weights.reshape(-1).contiguous()
        lora = make_lora(shape, args.rank, args.adapters, m, dtype)
        cfg = get_moe_config(m, num_experts, hidden, inter, top_k, dtype, x.device)
        rb = lora_rank_block(args.rank)
        lcfg = _with_lora_tiles(cfg, rank_block=rb)
        scfg = _with_lora_tiles(cfg, inline_shrink=False)
        s, e, n = moe_align_block_size(ids, cfg.block_m, num_experts)
        align = dict(sorted_ids=s, expert_ids=e, num_post_padded=n)
        act = torch.empty(m * top_k, inter, device="cuda", dtype=dtype)
        out = torch.empty(m * top_k, hidden, device="cuda", dtype=dtype)
        max_padded = s.shape[0]
        splits_gu = shrink_k_splits(max_padded, cfg.block_m, hidden)
        splits_d = shrink_k_splits(max_padded, cfg.block_m, inter)
        sgu = torch.empty(m * top_k, splits_gu, 2 * rb, device="cuda", dtype=torch.float32)
        sd = torch.empty(m * top_k, splits_d, rb, device="cuda", dtype=torch.float32)
        common = dict(
            token_slots=lora.token_slots,
            slot_ranks=lora.slot_ranks,
            slot_scalings=lora.slot_scalings,
            top_k=top_k,
            rank_block=rb,
            num_adapters=lora.num_adapters,
        )
        l1 = LoRAOperands(lora_a=lora.gate_up_a, lora_b=lora.gate_up_b, **common)
        l2 = LoRAOperands(lora_a=lora.down_a, lora_b=lora.down_b, **common)
        rows = {
            "align": us(lambda: moe_align_block_size(ids, cfg.block_m, num_experts)),
            "gemm1 base": us(
                lambda: invoke_fused_moe_kernel(
                    x,
                    w13,
                    act,
                    topk_weights=None,
                    a_row_div=top_k,
                    config=cfg.gemm1,
                    activation="silu",
                    **align,
                )
            ),
            "gemm1 base (lora cfg)": us(
                lambda: invoke_fused_moe_kernel(
                    x,
                    w13,
                    act,
                    topk_weights=None,
                    a_row_div=top_k,
                    config=lcfg.gemm1,
                    activation="silu",
                    **align,
                )
            ),
            "gemm1 fused": us(
                lambda: invoke_fused_moe_kernel(
                    x,
                    w13,
                    act,
                    topk_weights=None,
                    a_row_div=top_k,
                    config=lcfg.gemm1,
                    activation="silu",
                    lora=l1,
                    **align,
                )
            ),
            "shrink gate_up": us(
                lambda: moe_lora_a(
                    x,
                    lora.gate_up_a,
                    lora.token_slots,
                    lora.slot_ranks,
                    **align,
                    block_m=cfg.block_m,
                    top_k=top_k,
                    x_row_div=top_k,
                    rank_block=rb,
                    num_adapters=lora.num_adapters,
                    gated=True,
                    out=sgu,
                )
            ),
            "gemm1 split": us(
                lambda: invoke_fused_moe_kernel(
                    x,
                    w13,
                    act,
                    topk_weights=None,
                    a_row_div=top_k,
                    config=scfg.gemm1,
                    activation="silu",
                    lora=replace(l1, shrunk=sgu),
                    **align,
                )
            ),
            "gemm1 split (base cfg)": us(
                lambda: invoke_fused_moe_kernel(
                    x, w13, act, topk_weights=None, a_row_div=top_k, config=cfg.gemm1, activation="silu",
                    lora=replace(l1, shrunk=sgu), **align,
                )
            ),
            "gemm2 base": us(
                lambda: invoke_fused_moe_kernel(
                    act, w2, out, topk_weights=weights, a_row_div=1, config=cfg.gemm2, **align
                )
            ),
            "gemm2 fused": us(
                lambda: invoke_fused_moe_kernel(
                    act, w2, out, topk_weights=weights, a_row_div=1, config=lcfg.gemm2, lora=l2, **align
                )
            ),
            "shrink down": us(
                lambda: moe_lora_a(
                    act,
                    lora.down_a,
                    lora.token_slots,
                    lora.slot_ranks,
                    **align,
                    block_m=cfg.block_m,
                    top_k=top_k,
                    x_row_div=1,
                    rank_block=rb,
                    num_adapters=lora.num_adapters,
                    gated=False,
                    out=sd,
                )
            ),
            "gemm2 split": us(
                lambda: invoke_fused_moe_kernel(
                    act,
                    w2,
                    out,
                    topk_weights=weights,
                    a_row_div=1,
                    config=scfg.gemm2,
                    lora=replace(l2, shrunk=sd),
                    **align,
                )
            ),
            "gemm2 split (base cfg)": us(
                lambda: invoke_fused_moe_kernel(
                    act, w2, out, topk_weights=weights, a_row_div=1, config=cfg.gemm2,
                    lora=replace(l2, shrunk=sd), **align,
                )
            ),
        }
        # Split-K partials summed once (reduce_shrink_splits) before the GEMMs read them, vs summed per tile.
        if splits_gu > 1 or splits_d > 1:
            sgu_sum, sd_sum = sgu.clone(), sd.clone()
            rows["reduce gate_up"] = us(lambda: reduce_shrink_splits(sgu_sum, lora.token_slots,
                                                                     slot_row_div=top_k))
            rows["reduce down"] = us(lambda: reduce_shrink_splits(sd_sum, lora.token_slots,
                                                                  slot_row_div=top_k))
            rows["gemm1 split (reduced)"] = us(lambda: invoke_fused_moe_kernel(
                x, w13, act, topk_weights=None, a_row_div=top_k, config=scfg.gemm1, activation="silu",
                lora=replace(l1, shrunk=sgu_sum[:, :1]), **align))
            rows["gemm2 split (reduced)"] = us(lambda: invoke_fused_moe_kernel(
                act, w2, out, topk_weights=weights, a_row_div=1, config=scfg.gemm2,
                lora=replace(l2, shrunk=sd_sum[:, :1]), **align))
        # The split epilogue's slot groups on big tiles (BIG_TILE_SLOT_GROUP*), where they may spill.
        saved = fused_moe.BIG_TILE_SLOT_GROUP, fused_moe.BIG_TILE_SLOT_GROUP_GATED
        for group in (1, 2, 4):
            fused_moe.BIG_TILE_SLOT_GROUP = fused_moe.BIG_TILE_SLOT_GROUP_GATED = group
            rows[f"gemm1 split (big-tile group {group})"] = us(lambda: invoke_fused_moe_kernel(
                x, w13, act, topk_weights=None, a_row_div=top_k, config=cfg.gemm1, activation="silu",
                lora=replace(l1, shrunk=sgu), **align))
            rows[f"gemm2 split (big-tile group {group})"] = us(lambda: invoke_fused_moe_kernel(
                act, w2, out, topk_weights=weights, a_row_div=1, config=cfg.gemm2,
                lora=replace(l2, shrunk=sd), **align))
        fused_moe.BIG_TILE_SLOT_GROUP, fused_moe.BIG_TILE_SLOT_GROUP_GATED = saved
        # GEMM2's shrink in GEMM1's epilogue: one partial per GEMM1 N tile, summed by GEMM2.
        sdt = torch.zeros(m * top_k, triton.cdiv(inter, cfg.gemm1.block_n), rb, device="cuda",
                          dtype=torch.float32)
        rows["gemm1 split+down"] = us(lambda: invoke_fused_moe_kernel(
            x, w13, act, topk_weights=None, a_row_div=top_k, config=cfg.gemm1, activation="silu",
            lora=replace(l1, shrunk=sgu, down_a=lora.down_a, down_shrunk=sdt), **align))
        rows[f"gemm2 split ({sdt.shape[1]} partials)"] = us(lambda: invoke_fused_moe_kernel(
            act, w2, out, topk_weights=weights, a_row_div=1, config=cfg.gemm2, lora=replace(l2, shrunk=sdt),
            **align))
        if m * top_k <= SINGLE_PROGRAM_MAX_PAIRS:
            dsplits = decode_shrink_splits(m * top_k, hidden, decode_shrink_block_k(dtype))
            dgu = torch.empty(m * top_k, dsplits, 2 * rb, device="cuda", dtype=torch.float32)
            rows[f"align+shrink ({dsplits} splits)"] = us(lambda: moe_align_with_gate_up_shrink(
                ids, cfg.block_m, num_experts, x, lora.gate_up_a, lora.token_slots, lora.slot_ranks,
                rank_block=rb, out=dgu))
            rows["gemm1 split (decode partials)"] = us(lambda: invoke_fused_moe_kernel(
                x, w13, act, topk_weights=None, a_row_div=top_k, config=cfg.gemm1, activation="silu",
                lora=replace(l1, shrunk=dgu), **align))
        if not args.no_sweep:
            rows.update(sweep_shrinks(x, act, lora, align, cfg.block_m, top_k, rb, max_padded))
        print(
            f"{args.model} M={m} rank={args.rank} adapters={args.adapters} "
            f"shrink splits {splits_gu}/{splits_d}"
            f" cfg={cfg}"
        )
        for name, t in rows.items():
            print(f"  {name:24s} {t:8.1f} us")
    print_register_use()


def sweep_shrinks(x, act, lora, align, block_m: int, top_k: int, rank_block: int, max_padded: int) -> dict:
    """Both shrinks over launch configs and split-K counts; the ``SWEEP_TOP`` fastest of each go in the
    table (the current choice is the table's "shrink gate_up" / "shrink down" row). First split count x
    rows per program x K tile at 4 warps and 3 stages, then warps and stages for the three fastest of
    those. With several splits the time includes ``reduce_shrink_splits`` ("+r"): once the partials are
    summed once, the GEMM tiles no longer pay per split, so counts past the rule's cap of 8 are in."""
    pairs = act.shape[0]
    found = {}
    for name, src, lora_a, gated, row_div in (("gu", x, lora.gate_up_a, True, top_k),
                                               ("down", act, lora.down_a, False, 1)):
        k = src.shape[1]
        outs = {}

        def run(splits, sub_m, bk, warps, stages, src=src, lora_a=lora_a, gated=gated, row_div=row_div,
                outs=outs):
            out = outs.setdefault(splits, torch.empty(pairs, splits, (2 if gated else 1) * rank_block,
                                                      device=src.device, dtype=torch.float32))
            moe_lora_a(src, lora_a, lora.token_slots, lora.slot_ranks, **align, block_m=block_m, top_k=top_k,
                       x_row_div=row_div, rank_block=rank_block, gated=gated, num_adapters=lora.num_adapters,
                       out=out, sub_block_m=sub_m, block_k=bk, num_warps=warps, num_stages=stages)
            if splits > 1:
                reduce_shrink_splits(out, lora.token_slots, slot_row_div=top_k)

        def label(splits, sub_m, bk, warps, stages):
            return f"shrink {name} x{splits}{'+r' if splits > 1 else ''} m{sub_m} k{bk} w{warps} s{stages}"

        first = {}
        for splits in sorted({1, 2, 4, 8, 16, shrink_k_splits(max_padded, block_m, k),
                              shrink_k_splits(pairs, block_m, k)}):
            if splits > triton.cdiv(k, 64):
                continue
            for sub_m in (16, 32, 64, 128):
                if sub_m > block_m:
                    continue
                for bk in (64, 128):
                    first[(splits, sub_m, bk)] = us(lambda: run(splits, sub_m, bk, 4, 3))
        times = {label(*point, 4, 3): t for point, t in first.items()}
        for point in sorted(first, key=first.get)[:3]:
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    times[label(*point, warps, stages)] = us(lambda: run(*point, warps, stages))
        for key in sorted(times, key=times.get)[:SWEEP_TOP]:
            found[key] = times[key]
    return found


SWEEP_TOP = 6


def print_register_use() -> None:
    """Registers and spills of every compiled variant (Triton's per-device kernel cache)."""
    from triton_ops.fused_moe import _fused_moe_kernel
    from triton_ops.moe_lora import _moe_lora_shrink_kernel

    for kernel in (_fused_moe_kernel, _moe_lora_shrink_kernel):
        caches = getattr(kernel, "device_caches", {})
        for cache in caches.values():
            compiled = cache[0] if isinstance(cache, tuple) else cache
            for binary in compiled.values():
                meta = getattr(binary, "metadata", None)
                print(f"  {kernel.fn.__name__}: regs={binary.n_regs} spills={binary.n_spills} "
                      f"warps={getattr(meta, 'num_warps', '?')} smem={getattr(meta, 'shared', '?')}")


if __name__ == "__main__":
    main()
