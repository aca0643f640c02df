"""Staged MoE LoRA kernels (seed 002's interface with docs/design.md §1's math).

Staged path, around the base GEMMs of ``fused_moe.py``:
  1. moe_lora_a          a1[p, :]  = A_gate_up[a_p, e_p] @ x[t_p]                      (shrink, grouped)
  2. base GEMM1 (raw)    c1[p, :]  = W13[e_p] @ x[t_p]
  3. moe_lora_gate_up_b  h[p, :]   = act(g) * u,  [g | u] = c1[p] + w^m_p s_a B_gate_up[a_p, e_p] a1[p]
  4. base GEMM2 + sum    out[t]    = rsf * sum_k w_k W2[e_k] h[p_k]
  5. moe_lora_down       out[t]   += rsf * sum_k w_k s_a B_down[a, e_k] (A_down[a, e_k] h[p_k])
                         (a grouped shrink, then a gather-form expand that sums the top-k in registers:
                         no atomics, one writer per output element; or, on pairs grouped by (expert,
                         adapter), ``moe_lora_down_b`` adds each pair's delta to GEMM2's rows before the
                         top-k sum)
Shrinks and the gate_up expand run on the base alignment's blocks (one expert per block) and loop over
the adapter slots present in each block (the shrink up to 64 // R of them at a time, side by side in one
A tile, so a block of several adapters' tokens walks K once); rows of other slots are masked out of every
load, so tokens with slot -1 cost nothing and a slot's rank rows beyond its real rank are never read.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from triton_ops.gemm_tiles import _gated_activation, activation_args
from triton_ops.hostmath import cdiv
from triton_ops.launch import launch
from triton_ops.lora_tiles import (
    _dot,
    first_slot,
    lora_expand_slots,
    lora_slot_rows,
    next_slot,
    select_group_columns,
    slot_group,
)
from triton_ops.lora_weights import LoRAWeights, lora_weights
from triton_ops.pdl import releasing_launch, require_dependent_launch, wait_for_previous_kernel
from triton_ops.plan import lora_slot_group


@triton.jit(do_not_specialize=["numel"])
def _moe_lora_shrink_kernel(
    # Pointers
    x_ptr,  # (rows, K) activations: x (GEMM1 side) or h (down side)
    lora_a,  # (L, E, R or 2R, K) gate_up_a or down_a
    token_slots_ptr,  # (M,) int32, -1 = no adapter
    slot_ranks_ptr,  # (L,) int32
    sorted_ids_ptr,  # (max_padded,) int32
    expert_ids_ptr,  # (max_padded / ALIGN_M,) int32
    num_post_padded_ptr,  # (1,) int32
    out_ptr,  # (numel, splits, LORA_R or 2 * LORA_R) fp32 partial sums: [gate | up] when GATED
    # Sizes
    K,
    k_per_split,
    numel,
    x_row_div,
    top_k,
    lora_up_offset,
    # Strides
    stride_xm,
    stride_xk,
    stride_os,
    stride_om,
    # Meta-parameters
    GATED: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    LORA_R: tl.constexpr,
    ALIGN_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SLOT_GROUP: tl.constexpr,
    SLOT_PROGRAMS: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    """One BLOCK_M slice of an alignment block (one expert) times one K slice; with SLOT_PROGRAMS, times
    all of K for one slot group of the block's instead (axis 1 numbers the groups)."""
    wait_for_previous_kernel(USE_PDL)
    pid_m = tl.program_id(0)
    pid_k = 0 if SLOT_PROGRAMS else tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + (pid_m * BLOCK_M) // ALIGN_M).to(tl.int64)
    if expert < 0:  # a null block: its pairs contribute nothing (the GEMM writes zero rows)
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    row_valid = pair < numel
    row_slot = tl.load(token_slots_ptr + pair // top_k, mask=row_valid, other=-1)
    has_slot = row_valid & (row_slot >= 0)
    if tl.max(has_slot.to(tl.int32), axis=0) == 0:
        return
    x_row = (pair // x_row_div).to(tl.int64)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    offs_k = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, SLOT_GROUP * LORA_R)
    col_r = cols % LORA_R
    out_rows = out_ptr + pid_k * stride_os + pair.to(tl.int64) * stride_om
    # SLOT_GROUP slots at a time side by side in one (BLOCK_K, SLOT_GROUP * R) A tile: one pass over K
    # for all of them (a block of a few adapters' tokens walks K once, not once per adapter).
    slot = first_slot(row_slot, has_slot)
    if SLOT_PROGRAMS:  # skip the groups of the programs before this one (past the last: none is left)
        for _ in range(tl.program_id(1) * SLOT_GROUP):
            slot = next_slot(row_slot, has_slot, slot)
    while slot < (1 << 30):
        col_slot, row_group, slot = slot_group(row_slot, has_slot, slot, GROUP=SLOT_GROUP, LORA_R=LORA_R)
        if SLOT_PROGRAMS and tl.program_id(1) < tl.num_programs(1) - 1:
            # this program's group only; the last program takes every group left, so a block with more
            # slots than the grid has programs (a stale ``num_adapters``) is still complete
            slot = 1 << 30
        in_group = row_group >= 0
        col_present = col_slot < (1 << 30)
        col_safe = tl.where(col_present, col_slot, 0)
        col_rank = tl.load(slot_ranks_ptr + col_safe, mask=col_present, other=0)
        col_valid = col_present & (col_r < col_rank)
        a_cols = lora_slot_rows(lora_a, col_safe, expert) + col_r * lora_a[4]
        x_ptrs = x_ptr + x_row[:, None] * stride_xm + (k_start + offs_k)[None, :] * stride_xk
        a_ptrs = a_cols[None, :] + (k_start + offs_k).to(tl.int64)[:, None] * lora_a[5]
        acc = tl.zeros((BLOCK_M, SLOT_GROUP * LORA_R), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, SLOT_GROUP * LORA_R), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k_valid = offs_k < k_end - k0
            x = tl.load(x_ptrs, mask=in_group[:, None] & k_valid[None, :], other=0.0)
            a_mask = k_valid[:, None] & col_valid[None, :]
            acc = _dot(x, tl.load(a_ptrs, mask=a_mask, other=0.0), acc, FP32_IEEE)
            if GATED:
                acc_up = _dot(x, tl.load(a_ptrs + lora_up_offset, mask=a_mask, other=0.0), acc_up, FP32_IEEE)
            x_ptrs += BLOCK_K * stride_xk
            a_ptrs += BLOCK_K * lora_a[5]
        offs_r = tl.arange(0, LORA_R)
        own = select_group_columns(acc, row_group, GROUP=SLOT_GROUP, LORA_R=LORA_R)
        tl.store(out_rows[:, None] + offs_r[None, :], own, mask=in_group[:, None])
        if GATED:
            own_up = select_group_columns(acc_up, row_group, GROUP=SLOT_GROUP, LORA_R=LORA_R)
            tl.store(out_rows[:, None] + LORA_R + offs_r[None, :], own_up, mask=in_group[:, None])


@triton.jit
def _expand_block_rows(
    shrunk_ptr,  # (numel, splits, LORA_R or 2 * LORA_R) fp32 split-K shrink partials: [gate | up] when GATED
    token_slots_ptr,  # (M,) int32
    sorted_ids_ptr,  # (max_padded,) int32
    pid_m,
    numel,
    top_k,
    num_splits,
    stride_ss,
    stride_sm,
    GATED: tl.constexpr,
    LORA_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """The prologue of the pair expands: block ``pid_m``'s pairs, which are real, their slots, which have
    one, and the pairs' shrinks summed over the splits (gate and up when GATED; rows without a slot zero)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    row_valid = pair < numel
    row_slot = tl.load(token_slots_ptr + pair // top_k, mask=row_valid, other=-1)
    has_slot = row_valid & (row_slot >= 0)
    offs_r = tl.arange(0, LORA_R)
    s_ptrs = shrunk_ptr + pair.to(tl.int64)[:, None] * stride_sm + offs_r[None, :]
    shrunk = tl.zeros((BLOCK_M, LORA_R), dtype=tl.float32)
    shrunk_up = tl.zeros((BLOCK_M, LORA_R), dtype=tl.float32)
    for _split in range(0, num_splits):
        shrunk += tl.load(s_ptrs, mask=has_slot[:, None], other=0.0)
        if GATED:
            shrunk_up += tl.load(s_ptrs + LORA_R, mask=has_slot[:, None], other=0.0)
        s_ptrs += stride_ss
    return pair, row_valid, row_slot, has_slot, shrunk, shrunk_up


@triton.jit(do_not_specialize=["numel", "max_padded"])
def _moe_lora_gate_up_b_kernel(
    # Pointers
    c1_ptr,  # (numel, 2N) raw GEMM1 output, gate columns then up columns
    shrunk_ptr,  # (numel, splits, 2 * LORA_R) fp32 partial shrinks: [gate | up]
    lora_b,  # (L, E, 2N, R) gate_up_b
    token_slots_ptr,  # (M,) int32
    slot_ranks_ptr,  # (L,) int32
    slot_scalings_ptr,  # (L,) fp32
    topk_weights_ptr,  # (numel,) fp32, read when MUL_ROUTED_WEIGHT (GEMM1 applied it to c1)
    sorted_ids_ptr,  # (max_padded,) int32
    expert_ids_ptr,  # (max_padded / BLOCK_M,) int32
    num_post_padded_ptr,  # (1,) int32
    h_ptr,  # (numel, N) out: act(g) * u
    # Sizes
    N,
    cols_per_program,  # a multiple of BLOCK_N
    numel,
    max_padded,
    top_k,
    num_splits,
    # Strides
    stride_c1m,
    stride_ss,
    stride_sm,
    stride_hm,
    # Meta-parameters
    ACTIVATION: tl.constexpr,
    ACT_LIMIT: tl.constexpr,
    ACT_ALPHA: tl.constexpr,
    ACT_UP_OFFSET: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    LORA_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, cols_per_program)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:  # a null block: GEMM2 writes its rows as zeros without reading them
        return
    pair, row_valid, row_slot, has_slot, shrunk_gate, shrunk_up = _expand_block_rows(
        shrunk_ptr, token_slots_ptr, sorted_ids_ptr, pid_m, numel, top_k, num_splits, stride_ss, stride_sm,
        GATED=True, LORA_R=LORA_R, BLOCK_M=BLOCK_M)
    weight = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + pair, mask=row_valid, other=0.0)
    c1_rows = c1_ptr + pair.to(tl.int64)[:, None] * stride_c1m
    h_rows = h_ptr + pair.to(tl.int64)[:, None] * stride_hm
    # The block's columns in BLOCK_N steps: the prologue above (the pairs, their slots, the partial sums)
    # once for all of them.
    n_start = pid_n * cols_per_program
    for n0 in range(n_start, tl.minimum(n_start + cols_per_program, N), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        col_valid = offs_n < N
        mask = row_valid[:, None] & col_valid[None, :]
        gate = tl.load(c1_rows + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(c1_rows + N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        delta_gate, delta_up = lora_expand_slots(
            tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32),
            shrunk_gate, shrunk_up, row_valid, row_slot, lora_b, expert, offs_n, col_valid, N,
            slot_ranks_ptr, slot_scalings_ptr,
            GATED=True, FP32_IEEE=FP32_IEEE, LORA_R=LORA_R,
        )
        if MUL_ROUTED_WEIGHT:
            delta_gate *= weight[:, None]
            delta_up *= weight[:, None]
        h = _gated_activation(gate + delta_gate, up + delta_up, ACTIVATION, ACT_LIMIT, ACT_ALPHA,
                              ACT_UP_OFFSET)
        tl.store(h_rows + offs_n[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["numel"])
def _moe_lora_down_b_kernel(
    # Pointers
    y_ptr,  # (numel, N) in/out: GEMM2's per-pair rows (routed weight and scale applied), the delta added
    shrunk_ptr,  # (numel, splits, LORA_R) fp32 partial shrinks of A_down h
    lora_b,  # (L, E, N, R) down_b
    token_slots_ptr,  # (M,) int32
    slot_ranks_ptr,  # (L,) int32
    slot_scalings_ptr,  # (L,) fp32
    topk_weights_ptr,  # (numel,) fp32, read when MUL_ROUTED_WEIGHT
    sorted_ids_ptr,  # (max_padded,) int32
    expert_ids_ptr,  # (max_padded / BLOCK_M,) int32
    num_post_padded_ptr,  # (1,) int32
    # Sizes
    N,
    cols_per_program,  # a multiple of BLOCK_N
    numel,
    top_k,
    num_splits,
    scale,
    # Strides
    stride_ym,
    stride_ss,
    stride_sm,
    # Meta-parameters
    MUL_ROUTED_WEIGHT: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    LORA_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, cols_per_program)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:  # a null block: its pairs contribute nothing
        return
    pair, row_valid, row_slot, has_slot, shrunk, _ = _expand_block_rows(
        shrunk_ptr, token_slots_ptr, sorted_ids_ptr, pid_m, numel, top_k, num_splits, stride_ss, stride_sm,
        GATED=False, LORA_R=LORA_R, BLOCK_M=BLOCK_M)
    if tl.max(has_slot.to(tl.int32), axis=0) == 0:  # no row with an adapter: nothing to add
        return
    row_scale = tl.zeros((BLOCK_M,), dtype=tl.float32) + scale
    if MUL_ROUTED_WEIGHT:
        row_scale *= tl.load(topk_weights_ptr + pair, mask=has_slot, other=0.0)
    y_rows = y_ptr + pair.to(tl.int64)[:, None] * stride_ym
    n_start = pid_n * cols_per_program
    for n0 in range(n_start, tl.minimum(n_start + cols_per_program, N), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        col_valid = offs_n < N
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        delta, _ = lora_expand_slots(
            zeros, zeros, shrunk, shrunk, row_valid, row_slot, lora_b, expert, offs_n, col_valid, N,
            slot_ranks_ptr, slot_scalings_ptr, GATED=False, FP32_IEEE=FP32_IEEE, LORA_R=LORA_R,
        )
        mask = has_slot[:, None] & col_valid[None, :]
        y = tl.load(y_rows + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(y_rows + offs_n[None, :], (y + delta * row_scale[:, None]).to(y_ptr.dtype.element_ty),
                 mask=mask)


# M changes with every batch: no divisibility specialization (a compile per class otherwise), but M == 1,
# the one-token decode, keeps its own variant.
@triton.jit(do_not_specialize_on_alignment=["M"])
def _moe_lora_down_combine_kernel(
    # Pointers
    shrunk_ptr,  # (numel, splits, LORA_R) fp32 partials of A_down h per pair
    lora_b,  # (L, E, H, R) down_b
    token_slots_ptr,  # (M,) int32
    topk_ids_ptr,  # (M, top_k) int32/int64
    topk_weights_ptr,  # (M, top_k) fp32
    slot_ranks_ptr,  # (L,) int32
    slot_scalings_ptr,  # (L,) fp32
    out_ptr,  # (M, H) in/out: the base MoE output, the delta is added in place
    # Sizes
    M,
    H,
    num_experts,
    top_k,
    scale,
    num_splits,
    # Strides
    stride_ss,
    stride_sm,
    stride_om,
    # Meta-parameters
    MUL_ROUTED_WEIGHT: tl.constexpr,
    LORA_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, LORA_R)
    token_valid = offs_t < M
    col_valid = offs_n < H
    slot = tl.load(token_slots_ptr + offs_t, mask=token_valid, other=-1)
    has_slot = token_valid & (slot >= 0)
    if tl.max(has_slot.to(tl.int32), axis=0) == 0:
        return
    safe_slot = tl.where(has_slot, slot, 0)
    rank = tl.load(slot_ranks_ptr + safe_slot, mask=has_slot, other=0)
    scaling = tl.load(slot_scalings_ptr + safe_slot, mask=has_slot, other=0.0)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for j in range(0, top_k):
        pair = offs_t.to(tl.int64) * top_k + j
        expert = tl.load(topk_ids_ptr + pair, mask=has_slot, other=-1).to(tl.int64)
        # A pair whose id is outside [0, E) contributes nothing.
        pair_has = has_slot & (expert >= 0) & (expert < num_experts)
        expert = tl.where(pair_has, expert, 0)
        shrunk_ptrs = shrunk_ptr + pair[:, None] * stride_sm + offs_r[None, :]
        shrunk = tl.zeros((BLOCK_T, LORA_R), dtype=tl.float32)
        for split in range(0, num_splits):
            shrunk += tl.load(shrunk_ptrs + split * stride_ss, mask=pair_has[:, None], other=0.0)
        b_ptrs = (
            lora_slot_rows(lora_b, safe_slot, expert)[:, None, None]
            + offs_n.to(tl.int64)[None, :, None] * lora_b[5]
            + offs_r[None, None, :] * lora_b[4]
        )
        rank_valid = offs_r[None, None, :] < rank[:, None, None]
        b_mask = pair_has[:, None, None] & col_valid[None, :, None] & rank_valid
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        # Rounded to the weights' dtype before the expand, as PEFT's lora_B(lora_A(h)) does.
        shrunk = shrunk.to(b.dtype).to(tl.float32)
        delta = tl.sum(shrunk[:, None, :] * b.to(tl.float32), axis=2)
        row_scale = scaling
        if MUL_ROUTED_WEIGHT:
            row_scale = row_scale * tl.load(topk_weights_ptr + pair, mask=pair_has, other=0.0)
        acc += delta * row_scale[:, None]
    out_ptrs = out_ptr + offs_t.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    mask = has_slot[:, None] & col_valid[None, :]
    base = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (base + acc * scale).to(out_ptr.dtype.element_ty), mask=mask)


def shrink_block_m(block_m: int) -> int:
    """Rows per shrink program: a slice of an alignment block (more programs, fewer registers). 64 at
    prefill: each program then reads its A tiles for twice the rows, which beat 32 (docs/performance.md,
    'Levers': 64-row shrink programs)."""
    return min(block_m, 64)


def shrink_block_k(dtype: torch.dtype, slot_group: int = 1) -> int:
    """K tile of the shrink: 128 for 16-bit inputs (fewer, fuller iterations), 32 for fp32; 64 when
    several slots sit side by side in the A tile (each iteration then loads slot_group A tiles, and at
    128 the stages of a 64-row program fill the SM's shared memory alone; docs/performance.md, 'Levers':
    shrink K tile 64 with several slots)."""
    if dtype == torch.float32:
        return 32
    return 64 if slot_group > 1 else 128


def shrink_row_programs(max_padded: int, block_m: int) -> int:
    """Programs along the rows of a ``moe_lora_a`` grid (the alignment's padded bound, ``shrink_block_m``
    rows each), before any split of K."""
    return cdiv(max(max_padded, 1), shrink_block_m(block_m))


def shrink_k_splits(
    max_padded: int, block_m: int, k: int, block_k: int = 128, target_programs: int = 264, max_splits: int = 8
) -> int:
    """Split K until the grid has about two programs per SM: at decode the few alignment blocks would
    otherwise each walk all of K alone (latency-bound); at prefill the blocks already fill the GPU.
    At most ``max_splits``: every consumer program sums the partials, one dependent load each."""
    row_programs = shrink_row_programs(max_padded, block_m)
    return max(1, min(cdiv(k, block_k), cdiv(target_programs, row_programs), max_splits))


def moe_lora_a(
    x: torch.Tensor,
    lora_a: torch.Tensor | LoRAWeights,
    token_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    *,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_post_padded: torch.Tensor,
    block_m: int,
    top_k: int,
    x_row_div: int,
    rank_block: int,
    gated: bool,
    out: torch.Tensor,
    sub_block_m: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 4,
    num_adapters: int = 0,
    slot_programs: bool = False,
    release_next: bool = False,
) -> torch.Tensor:
    """LoRA shrink over the base alignment: ``sum_s out[p, s] = A[slot(p), e_p] @ x[p // x_row_div]`` (fp32).

    ``lora_a`` is gate_up_a (L, E, 2R, K) with ``gated`` (out is (numel, splits, 2*rank_block): gate then
    up) or down_a (L, E, R, K) (out is (numel, splits, rank_block)). Each of the ``splits`` slices of K
    writes its own partial (consumers sum them: deterministic, no atomics); rows of tokens without an
    adapter are not written. ``sub_block_m`` (a divisor of ``block_m``; default ``shrink_block_m``),
    ``block_k``, ``num_warps`` and ``num_stages`` override the launch config (benchmarks/micro_lora.py);
    ``num_adapters`` (distinct adapters in the batch, 0 = unknown) bounds the slots a program sets side by
    side in one A tile (``lora_slot_group``). ``slot_programs`` (one split, ``num_adapters`` known): a
    program per slot of the block instead, each over all of K (no split sum, yet as many programs); the
    last takes the slots past ``num_adapters``, so a stale count costs speed, not correctness.
    Grid: (cdiv(max_padded, sub_block_m), splits), or (cdiv(max_padded, sub_block_m), slots) with
    ``slot_programs``, slots = min(num_adapters, sub_block_m).
    """
    numel, splits, width = out.shape
    lora_a = lora_weights(lora_a, kind="gated_a" if gated else "a")
    if lora_a.cols != x.shape[1]:
        raise ValueError(f"lora_a has {lora_a.cols} columns, activations {tuple(x.shape)}")
    if out.dtype != torch.float32 or width != (2 if gated else 1) * rank_block:
        expected = (2 if gated else 1) * rank_block
        raise ValueError(f"out must be fp32 (numel, splits, {expected}), got {out.dtype} {tuple(out.shape)}")
    if release_next:
        require_dependent_launch(x.device, "release_next")
    if numel == 0:
        return out
    sub_m = sub_block_m or shrink_block_m(block_m)
    if block_m % sub_m:
        raise ValueError(f"sub_block_m {sub_m} must divide the alignment's block_m {block_m}")
    if slot_programs and (splits != 1 or num_adapters < 1):
        raise ValueError(f"slot_programs needs one split and the adapter count, got {splits} splits and "
                         f"num_adapters={num_adapters}")
    slot_group = 1 if slot_programs else lora_slot_group(rank_block, num_adapters,
                                                         min(sub_m, cdiv(numel, lora_a.num_experts)))
    block_k = block_k or shrink_block_k(x.dtype, slot_group)
    k_per_split = cdiv(cdiv(x.shape[1], block_k), splits) * block_k
    if num_warps is None:
        # 4 for 16-row programs with a slot group: its gathered A pointers need the registers (2 warps
        # spilled on an H200).
        num_warps = 2 if sub_m <= 16 and slot_group == 1 else 4
    grid = (cdiv(sorted_ids.shape[0], sub_m), min(num_adapters, sub_m) if slot_programs else splits)
    launch(_moe_lora_shrink_kernel, grid,
        x_ptr=x,
        lora_a=lora_a.bundle(),
        token_slots_ptr=token_slots,
        slot_ranks_ptr=slot_ranks,
        sorted_ids_ptr=sorted_ids,
        expert_ids_ptr=expert_ids,
        num_post_padded_ptr=num_post_padded,
        out_ptr=out,
        K=x.shape[1],
        k_per_split=k_per_split,
        numel=numel,
        x_row_div=x_row_div,
        top_k=top_k,
        lora_up_offset=lora_a.up_offset,
        stride_xm=x.stride(0),
        stride_xk=x.stride(1),
        stride_os=out.stride(1),
        stride_om=out.stride(0),
        GATED=gated,
        FP32_IEEE=x.dtype == torch.float32,
        LORA_R=rank_block,
        ALIGN_M=block_m,
        BLOCK_M=sub_m,
        BLOCK_K=block_k,
        SLOT_GROUP=slot_group,
        SLOT_PROGRAMS=slot_programs,
        **releasing_launch(x.device, release_next),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def _launch_pair_expand(kernel: Any, shrunk: torch.Tensor, lora_b: LoRAWeights, token_slots: torch.Tensor,
                        slot_ranks: torch.Tensor, slot_scalings: torch.Tensor,
                        topk_weights: torch.Tensor | None, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
                        num_post_padded: torch.Tensor, *, n: int, whole_rows: bool, top_k: int,
                        rank_block: int, block_m: int, fp32: bool, **own: Any) -> None:
    """Launches ``moe_lora_gate_up_b``'s or ``moe_lora_down_b``'s kernel with the arguments they share (a
    pair's split-K shrink partials, its slot's B, rank and scaling, its routed weight (the partials as a
    placeholder pointer when there is none), the alignment's blocks, the column tiling) and ``own``."""
    block_n = 64
    cols = cdiv(n, block_n) * block_n if whole_rows else block_n
    launch(kernel, (cdiv(sorted_ids.shape[0], block_m) * cdiv(n, cols),),
        N=n,
        cols_per_program=cols,
        shrunk_ptr=shrunk,
        lora_b=lora_b.bundle(),
        token_slots_ptr=token_slots,
        slot_ranks_ptr=slot_ranks,
        slot_scalings_ptr=slot_scalings,
        topk_weights_ptr=topk_weights if topk_weights is not None else shrunk,
        sorted_ids_ptr=sorted_ids,
        expert_ids_ptr=expert_ids,
        num_post_padded_ptr=num_post_padded,
        numel=shrunk.shape[0],
        top_k=top_k,
        num_splits=shrunk.shape[1],
        stride_ss=shrunk.stride(1),
        stride_sm=shrunk.stride(0),
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        FP32_IEEE=fp32,
        LORA_R=rank_block,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        **own,
    )


def moe_lora_gate_up_b(
    c1: torch.Tensor,
    shrunk: torch.Tensor,
    gate_up_b: torch.Tensor | LoRAWeights,
    token_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    *,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_post_padded: torch.Tensor,
    block_m: int,
    top_k: int,
    rank_block: int,
    activation: Any,
    topk_weights: torch.Tensor | None,
    out: torch.Tensor,
    whole_rows: bool = False,
) -> torch.Tensor:
    """``out[p] = act(g) * u`` with ``[g | u] = c1[p] + w s B_gate_up[slot, e_p] sum_s shrunk[p, s]``.

    Replaces ``silu_and_mul`` on the staged path; ``topk_weights`` (numel,) is given when GEMM1 applied
    the routing weight (apply_router_weight_on_input), so the delta gets it too. ``whole_rows``: a program
    walks all N columns of its block (``plan.expand_whole_rows``) instead of one BLOCK_N tile.
    Grid: (max_padded / block_m * cdiv(N, cols_per_program),), cols_per_program BLOCK_N or all of N.
    """
    numel, two_n = c1.shape
    n = two_n // 2
    shrunk_rows_width = (shrunk.shape[0], shrunk.shape[2])
    gate_up_b = lora_weights(gate_up_b, kind="b")
    if out.shape != (numel, n) or gate_up_b.cols != two_n or shrunk_rows_width != (numel, 2 * rank_block):
        raise ValueError(f"c1 {tuple(c1.shape)}, gate_up_b ({gate_up_b.cols} outputs) and out "
                         f"{tuple(out.shape)} disagree: expected out (numel, N), gate_up_b 2N outputs")
    if numel == 0:
        return out
    _launch_pair_expand(_moe_lora_gate_up_b_kernel, shrunk, gate_up_b, token_slots, slot_ranks, slot_scalings,
                        topk_weights, sorted_ids, expert_ids, num_post_padded, n=n, whole_rows=whole_rows,
                        top_k=top_k, rank_block=rank_block, block_m=block_m, fp32=c1.dtype == torch.float32,
                        c1_ptr=c1, h_ptr=out, max_padded=sorted_ids.shape[0], stride_c1m=c1.stride(0),
                        stride_hm=out.stride(0), **activation_args(activation))
    return out


def moe_lora_down_b(
    y: torch.Tensor,
    shrunk: torch.Tensor,
    down_b: torch.Tensor | LoRAWeights,
    token_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    *,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_post_padded: torch.Tensor,
    block_m: int,
    top_k: int,
    rank_block: int,
    topk_weights: torch.Tensor | None,
    routed_scaling_factor: float = 1.0,
    whole_rows: bool = False,
) -> torch.Tensor:
    """In place, before the top-k sum: ``y[p] += rsf * w_p * s B_down[slot, e_p] sum_s shrunk[p, s]`` for
    every routed pair p with an adapter, ``y`` GEMM2's per-pair rows (its routed weight and ``rsf``
    applied; ``topk_weights`` (numel,) None when the weight was applied on the input). On an alignment
    whose blocks each hold one adapter's rows (``moe_align.align_by_adapter``) each (adapter, expert)'s B
    is read once a block and its dot covers its own rows only; on the expert blocks it loops the slots
    present, as ``moe_lora_gate_up_b`` does; ``whole_rows`` as there.
    Grid: (max_padded / block_m * cdiv(N, cols_per_program),), cols_per_program BLOCK_N or all of N.
    """
    numel, n = y.shape
    down_b = lora_weights(down_b, kind="b")
    if down_b.cols != n or (shrunk.shape[0], shrunk.shape[2]) != (numel, rank_block):
        raise ValueError(f"down_b ({down_b.cols} outputs) / shrunk {tuple(shrunk.shape)} do not match y "
                         f"{tuple(y.shape)} with rank block {rank_block}")
    if numel == 0:
        return y
    _launch_pair_expand(_moe_lora_down_b_kernel, shrunk, down_b, token_slots, slot_ranks, slot_scalings,
                        topk_weights, sorted_ids, expert_ids, num_post_padded, n=n, whole_rows=whole_rows,
                        top_k=top_k, rank_block=rank_block, block_m=block_m, fp32=y.dtype == torch.float32,
                        y_ptr=y, scale=float(routed_scaling_factor), stride_ym=y.stride(0))
    return y


def moe_lora_down_combine(
    shrunk: torch.Tensor,
    down_b: torch.Tensor | LoRAWeights,
    token_slots: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor | None,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    out: torch.Tensor,
    *,
    rank_block: int,
    routed_scaling_factor: float = 1.0,
) -> torch.Tensor:
    """In place: ``out[t] += rsf * sum_k w_k s B_down[slot_t, e_k] sum_s shrunk[t*top_k + k, s]``.

    Gather form (each token row uses its own adapter and experts), the top-k summed in registers.
    ``topk_weights`` None means the weight was applied on the input.
    Grid: (cdiv(M, BLOCK_T), cdiv(H, BLOCK_N)).
    """
    tokens, hidden = out.shape
    top_k = topk_ids.shape[1]
    down_b = lora_weights(down_b, kind="b")
    if down_b.cols != hidden or (shrunk.shape[0], shrunk.shape[2]) != (tokens * top_k, rank_block):
        raise ValueError(f"down_b ({down_b.cols} outputs) / shrunk {tuple(shrunk.shape)} do not match out "
                         f"{tuple(out.shape)} with top_k={top_k} and rank block {rank_block}")
    if tokens == 0:
        return out
    block_t = 16
    block_n = max(16, min(64, 16384 // (block_t * rank_block)))
    launch(_moe_lora_down_combine_kernel, (cdiv(tokens, block_t), cdiv(hidden, block_n)),
        shrunk_ptr=shrunk,
        lora_b=down_b.bundle(),
        token_slots_ptr=token_slots,
        topk_ids_ptr=topk_ids,
        topk_weights_ptr=topk_weights if topk_weights is not None else shrunk,
        slot_ranks_ptr=slot_ranks,
        slot_scalings_ptr=slot_scalings,
        out_ptr=out,
        M=tokens,
        H=hidden,
        num_experts=down_b.num_experts,
        top_k=top_k,
        scale=float(routed_scaling_factor),
        num_splits=shrunk.shape[1],
        stride_ss=shrunk.stride(1),
        stride_sm=shrunk.stride(0),
        stride_om=out.stride(0),
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        LORA_R=rank_block,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
    )
    return out
