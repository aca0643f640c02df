"""Decode: the routing alignment and GEMM1's LoRA shrink in one launch; one token's down shrink.

Semantics:  program 0:     the alignment of ``moe_align_block_size`` (one program, numel <= 128 pairs;
                           not launched for one token, whose GEMMs take the routed pairs directly)
            programs 1 ..: out[p, s, :R]  = A_gate[a, e_p, :rank_a, ks] @ x[t, ks]
                           out[p, s, R:]  = A_up[a, e_p, :rank_a, ks] @ x[t, ks]
            for every routed pair p = t*top_k + j with a = token_slots[t] >= 0, e_p = topk_ids[t, j] and
            split s of K (ks = its columns); columns past rank_a hold 0, so every column GEMM1 reads is
            written. Pairs of tokens without an adapter are not written (nobody reads them).
            Down shrink (``one_token_down_shrink``, GATED=False, no alignment):
                           out[p, s, :R]  = A_down[a, e_p, :rank_a, ks] @ h[p, ks]
Grid:       (1 + numel * splits,), or (numel * splits,) without the alignment

The shrink needs only the routing and x, not the sorted order, so at decode it rides in the alignment's
launch instead of following it: the layer then has the base path's launches (the down shrink is written
by GEMM1's epilogue). Where GEMM1 has too many N tiles for that (one token of Mixtral-8x7B: 448), the down
shrink is a launch of the same GEMVs on the activated rows, between the GEMMs, so the token still needs
no alignment. Each shrink program is a GEMV on one pair's K slice (fp32 products and sums, no tensor cores
at one row); the split partials are summed by the GEMM that reads them in a fixed order (no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops.hostmath import cdiv
from triton_ops.launch import launch
from triton_ops.lora_tiles import lora_slot_rows
from triton_ops.lora_weights import LoRAWeights, lora_weights
from triton_ops.moe_align import SINGLE_PROGRAM_MAX_PAIRS, align_single_program, single_program_align_args
from triton_ops.pdl import dependent_launch_supported, releasing_launch, wait_for_previous_kernel


@triton.jit(do_not_specialize=["numel", "max_padded", "max_blocks"])
def _align_and_pair_shrink_kernel(
    # Pointers: alignment
    topk_ids_ptr,  # (numel,) int32/int64 flat routed expert ids
    expert_start_ptr,  # (E + 1,) int32 scratch
    expert_ids_ptr,  # (max_blocks,) int32 out
    sorted_ids_ptr,  # (max_padded,) int32 out
    num_post_padded_ptr,  # (1,) int32 out
    # Pointers: shrink
    x_ptr,  # (M, K) fp16/bf16/fp32 activations x; GATED=False: (numel, K) the activated rows h
    lora_a,  # gate_up_a (gate rank rows, up rows lora_up_offset after them) or down_a, rows over K: a LoRA
    #          operand bundle (``lora_tiles.lora_slot_rows``)
    token_slots_ptr,  # (M,) int32 slot per token, -1 = no adapter
    slot_ranks_ptr,  # (L,) int32 real rank per slot
    out_ptr,  # (numel, splits, 2 * LORA_R) fp32 out: [gate | up] partials (GATED=False: LORA_R wide)
    # Sizes
    numel,
    num_experts,
    max_padded,
    max_blocks,
    K,
    k_per_split,
    num_splits,
    top_k,
    x_row_div,
    lora_up_offset,
    # Strides
    stride_xm,
    stride_xk,
    stride_os,
    stride_om,
    # Meta-parameters
    CHUNK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
    LORA_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ALIGN: tl.constexpr = True,
    GATED: tl.constexpr = True,
    USE_PDL: tl.constexpr = False,
):
    wait_for_previous_kernel(USE_PDL)
    pid = tl.program_id(0)
    if ALIGN and pid == 0:
        align_single_program(
            topk_ids_ptr, expert_start_ptr, expert_ids_ptr, sorted_ids_ptr, num_post_padded_ptr, numel,
            num_experts, max_padded, max_blocks, CHUNK=CHUNK, BLOCK_SIZE=BLOCK_SIZE, BLOCK_E=BLOCK_E,
            BLOCK_B=BLOCK_B,
        )
    else:
        work = pid - 1 if ALIGN else pid
        pair = work // num_splits
        split = work % num_splits
        token = pair // top_k
        slot = tl.load(token_slots_ptr + token)
        if slot >= 0:
            expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
            # A pair whose id is outside [0, E) contributes nothing: its partials are read on expert 0
            # (in bounds, finite) by a direct GEMM that stores zeros for it, or not read at all.
            expert = tl.where((expert >= 0) & (expert < num_experts), expert, 0)
            rank = tl.load(slot_ranks_ptr + slot)
            offs_r = tl.arange(0, LORA_R)
            offs_k = tl.arange(0, BLOCK_K)
            rank_valid = offs_r < rank
            la_ptr = lora_slot_rows(lora_a, slot, expert)
            x_row = x_ptr + (pair // x_row_div).to(tl.int64) * stride_xm
            k_start = split * k_per_split
            k_end = tl.minimum(k_start + k_per_split, K)
            gate = tl.zeros((LORA_R, BLOCK_K), dtype=tl.float32)
            up = tl.zeros((LORA_R, BLOCK_K), dtype=tl.float32)
            for k0 in range(k_start, k_end, BLOCK_K):
                cols = k0 + offs_k
                k_valid = cols < k_end
                xv = tl.load(x_row + cols * stride_xk, mask=k_valid, other=0.0).to(tl.float32)
                a_ptrs = la_ptr + offs_r[:, None] * lora_a[4] + cols[None, :] * lora_a[5]
                mask = rank_valid[:, None] & k_valid[None, :]
                gate += tl.load(a_ptrs, mask=mask, other=0.0).to(tl.float32) * xv[None, :]
                if GATED:
                    up += tl.load(a_ptrs + lora_up_offset, mask=mask, other=0.0).to(tl.float32) * xv[None, :]
            out_row = out_ptr + pair.to(tl.int64) * stride_om + split * stride_os
            tl.store(out_row + offs_r, tl.sum(gate, axis=1))
            if GATED:
                tl.store(out_row + LORA_R + offs_r, tl.sum(up, axis=1))


def decode_shrink_splits(numel: int, k: int, block_k: int, target_programs: int = 256,
                         max_splits: int = 8) -> int:
    """Splits of K for the decode shrink: about ``target_programs`` GEMVs in all (one pair's whole K is
    a long serial walk), at most ``max_splits`` (GEMM1 sums them: registers)."""
    return max(1, min(cdiv(k, block_k), cdiv(target_programs, max(numel, 1)), max_splits))


# Elements of A (rank rows x K columns) one program of the one-token down GEMV walks, at most, and the
# split count that may take (GEMM2 sums the splits in its epilogue). GEMM2 overlaps the GEMV and takes its
# programs' bandwidth, so a long serial walk ends after GEMM2's K-loop: more splits pay on a long K at a
# wide rank (Mixtral-8x7B's 14336 columns at rank 64), up to DOWN_GEMV_MAX_SPLITS (more gained nothing);
# where a program's walk is already short (rank 16, or a short K) they gain nothing or lose, since GEMM2
# has more partials to sum (docs/performance.md, 'Levers': down-GEMV splits).
DOWN_GEMV_ELEMENTS_PER_PROGRAM = 32768
DOWN_GEMV_MAX_SPLITS = 32


def one_token_down_splits(numel: int, k: int, rank_block: int, block_k: int) -> int:
    """Splits of K for ``one_token_down_shrink``: ``decode_shrink_splits``, or more where a split would
    walk more than ``DOWN_GEMV_ELEMENTS_PER_PROGRAM`` elements of A (at most ``DOWN_GEMV_MAX_SPLITS``, at
    most one per K tile)."""
    by_work = min(cdiv(rank_block * k, DOWN_GEMV_ELEMENTS_PER_PROGRAM), DOWN_GEMV_MAX_SPLITS)
    return min(cdiv(k, block_k), max(decode_shrink_splits(numel, k, block_k), by_work))


def decode_shrink_block_k(dtype: torch.dtype) -> int:
    return 64 if dtype == torch.float32 else 128


def moe_align_with_gate_up_shrink(
    topk_ids: torch.Tensor,
    block_size: int,
    num_experts: int,
    x: torch.Tensor,
    gate_up_a: torch.Tensor | LoRAWeights,
    token_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    *,
    rank_block: int,
    out: torch.Tensor,
    align: bool = True,
    release_next: bool = False,
    dependent: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``moe_align_block_size`` plus GEMM1's LoRA shrink into ``out`` (numel, splits, 2 * rank_block) fp32,
    in one launch; at most ``SINGLE_PROGRAM_MAX_PAIRS`` routed pairs. Returns the alignment, or None with
    ``align=False`` (the shrink alone: one token's GEMMs take its pairs directly).

    ``release_next`` (sm_90+, ``align=False``): every program, once the kernel before it is done, lets
    the next launch be scheduled (a GEMM1 launched with ``late_wait``, ``decode_shrink_overlap``).
    ``dependent`` (sm_90+, ignored elsewhere): launched dependently on the launch before it, whose end its
    programs wait for first (a link of ``pdl.dependent_fp8_decode``'s chain)."""
    if release_next and (align or not dependent_launch_supported(x.device)):
        raise ValueError("release_next needs align=False (the next launch may read only the shrink) and an "
                         "sm_90+ GPU")
    num_tokens, hidden = x.shape
    gate_up_a = lora_weights(gate_up_a, kind="gated_a")
    if gate_up_a.cols != hidden:
        raise ValueError(f"gate_up_a must have {hidden} columns (x's), got {gate_up_a.cols}")
    if token_slots.shape != (num_tokens,):
        raise ValueError(f"token_slots must be ({num_tokens},), got {tuple(token_slots.shape)}")
    return _launch_pair_shrink(topk_ids, block_size, num_experts, x, gate_up_a, token_slots, slot_ranks,
                               rank_block=rank_block, out=out, align=align, gated=True,
                               release_next=release_next, dependent=dependent)


def one_token_down_shrink(
    activated: torch.Tensor,
    down_a: torch.Tensor | LoRAWeights,
    topk_ids: torch.Tensor,
    token_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    *,
    rank_block: int,
    out: torch.Tensor,
    release_next: bool = False,
) -> None:
    """GEMM2's LoRA shrink for one token's routed pairs, without an alignment: ``sum_s out[p, s] =
    A_down[slot, e_p] @ activated[p]`` into ``out`` (top_k, splits, rank_block) fp32 (splits from
    ``one_token_down_splits``), for a token whose GEMM1 has too many N tiles to write it in its epilogue.

    ``release_next`` (sm_90+): every program, once the kernel before it (GEMM1) is done, lets the next
    launch be scheduled (a GEMM2 launched with ``late_wait``: it reads ``activated``, complete by then,
    in its K-loop, and these partials only after its wait)."""
    if topk_ids.dim() != 2 or topk_ids.shape[0] != 1:
        raise ValueError(f"one_token_down_shrink takes one token's topk_ids (1, top_k), got "
                         f"{tuple(topk_ids.shape)}")
    if release_next and not dependent_launch_supported(activated.device):
        raise ValueError("release_next needs an sm_90+ GPU")
    pairs, inter = activated.shape
    if pairs != topk_ids.numel():
        raise ValueError(f"activated must be ({topk_ids.numel()}, I), a row per routed pair, got "
                         f"{tuple(activated.shape)}")
    down_a = lora_weights(down_a, kind="a")
    if down_a.cols != inter:
        raise ValueError(f"down_a must have {inter} columns (activated's), got {down_a.cols}")
    if token_slots.shape != (1,):
        raise ValueError(f"token_slots must be (1,) for one token, got {tuple(token_slots.shape)}")
    _launch_pair_shrink(topk_ids, 16, down_a.num_experts, activated, down_a, token_slots, slot_ranks,
                        rank_block=rank_block, out=out, align=False, gated=False, release_next=release_next)


def _launch_pair_shrink(topk_ids: torch.Tensor, block_size: int, num_experts: int, x: torch.Tensor,
                        lora_a: LoRAWeights, token_slots: torch.Tensor, slot_ranks: torch.Tensor, *,
                        rank_block: int, out: torch.Tensor, align: bool, gated: bool,
                        release_next: bool, dependent: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    # Without the alignment its outputs only fill the kernel's signature: token_slots stands in for them.
    (sorted_ids, expert_ids, num_post_padded), align_kwargs, num_warps = single_program_align_args(
        topk_ids, block_size, num_experts, placeholder=None if align else token_slots)
    numel, splits, width = out.shape
    k = x.shape[1]
    expected_width = (2 if gated else 1) * rank_block
    if numel != topk_ids.numel() or width != expected_width or out.dtype != torch.float32:
        raise ValueError(f"out must be fp32 ({topk_ids.numel()}, splits, {expected_width}), got {out.dtype} "
                         f"{tuple(out.shape)}")
    block_k = decode_shrink_block_k(x.dtype)
    k_per_split = cdiv(cdiv(k, block_k), splits) * block_k
    launch(_align_and_pair_shrink_kernel, (int(align) + numel * splits,),
        **align_kwargs,
        x_ptr=x,
        lora_a=lora_a.bundle(),
        token_slots_ptr=token_slots,
        slot_ranks_ptr=slot_ranks,
        out_ptr=out,
        K=k,
        k_per_split=k_per_split,
        num_splits=splits,
        top_k=topk_ids.shape[1],
        x_row_div=topk_ids.shape[1] if gated else 1,
        lora_up_offset=lora_a.up_offset,
        stride_xm=x.stride(0),
        stride_xk=x.stride(1),
        stride_os=out.stride(1),
        stride_om=out.stride(0),
        LORA_R=rank_block,
        BLOCK_K=block_k,
        ALIGN=align,
        GATED=gated,
        **releasing_launch(x.device, release_next, dependent=dependent),
        num_warps=num_warps,
    )
    return (sorted_ids, expert_ids, num_post_padded) if align else None


__all__ = [
    "SINGLE_PROGRAM_MAX_PAIRS",
    "decode_shrink_splits",
    "moe_align_with_gate_up_shrink",
    "one_token_down_shrink",
    "one_token_down_splits",
]
