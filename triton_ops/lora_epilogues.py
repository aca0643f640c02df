"""The LoRA variants of the fused GEMM (``fused_moe._fused_moe_kernel``): for each, the prologue that
loads what it needs before the base K-loop and the epilogue that adds the delta after it.

Semantics (every variant): for each row m of the block with adapter slot s = row_slot[m] >= 0,
            acc[m, :]    += scaling_s * B[s, e, :N] (A[s, e] a_m)          (gate, or the only projection)
            acc_up[m, :] += scaling_s * B[s, e, N:2N] (A[s, e, R:2R] a_m)  (up, when GATED)
before the activation and the routed weight (docs/design.md §1). The variants differ only in where the shrink
A a_m comes from and how the expand is tiled; ``fused_moe.plan_lora_epilogue`` picks one per launch from
host-known sizes, and the kernel takes it as its ``LORA`` meta-parameter:

| LORA            | shrink                                   | expand                                      |
|-----------------|------------------------------------------|---------------------------------------------|
| LORA_FUSED      | in the base K-loop (the main slot), and  | per slot present (``lora_expand_slots``)    |
|                 | before it for other slots (own K pass)   |                                             |
| LORA_ONE_ROW    | split-K partials (``moe_lora_a``)        | one decode pair a program: slot a scalar,   |
|                 |                                          | every operand loaded before the K-loop      |
| LORA_PREFETCHED | split-K partials                         | first slot group's operands before the      |
|                 |                                          | loop, other groups after it                 |
| LORA_DEFERRED   | split-K partials, one chunk, held raw    | as LORA_PREFETCHED, the prefetched loads'   |
|                 | through the loop                         | uses (sum, scaling, rank masks) after it    |
| LORA_GROUPS     | split-K partials, one load for all rows  | one dot per group of slots side by side     |
| LORA_CHUNKED    | split-K partials, a slot and rank chunk  | a slot and rank chunk at a time             |
| LORA_SLOT_RANGE | packed (summed, scaled: ``pack_shrink``) | a K-loop over the block's slot range        |

Grid: none of their own; every helper runs inside one program of the fused GEMM, on its block of
BLOCK_M routed pairs (one expert) and its BLOCK_N output columns.
"""

from __future__ import annotations

import triton
import triton.language as tl

from triton_ops.lora_tiles import (
    _dot,
    first_slot,
    load_group_b,
    load_group_ranks,
    load_raw_partials,
    load_scaled_gate_up_partials,
    load_shrink_partials,
    lora_expand_from_partials,
    lora_expand_groups,
    lora_expand_slot_range,
    lora_shift_cols,
    lora_shrink_tile,
    lora_slot_rows,
    lora_store_down_partials,
    mask_group_ranks,
    next_slot,
    slot_group,
    spread_to_group,
    sum_raw_partials,
)

LORA_NONE = tl.constexpr(0)
LORA_FUSED = tl.constexpr(1)
LORA_ONE_ROW = tl.constexpr(2)
LORA_PREFETCHED = tl.constexpr(3)
LORA_GROUPS = tl.constexpr(4)
LORA_DEFERRED = tl.constexpr(5)
LORA_CHUNKED = tl.constexpr(6)
LORA_SLOT_RANGE = tl.constexpr(7)
NO_SLOT = tl.constexpr(1 << 30)  # ``first_slot`` / ``next_slot`` past the last slot of a block


# ---------------------------------------------------------------------------------------------------------
# Prologues: before the base K-loop
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def fused_shrink_prologue(
    a_ptr,  # (rows, K) the GEMM's input
    a_row,  # (BLOCK_M,) int64 row of a per block row
    row_slot,  # (BLOCK_M,) int32 adapter slot per row, -1 = none
    has_slot,  # (BLOCK_M,) int1
    expert,  # int64
    offs_k,  # (BLOCK_K,)
    K, stride_am, stride_ak,
    lora_a,  # (L, E, R or 2R, K) LoRA A (gate rows, then up rows)
    lora_up_offset,
    slot_ranks_ptr,  # (L,) int32
    GATED: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LORA_R: tl.constexpr,
):
    """LORA_FUSED: the block's main slot (its largest) has its shrink ride in the base K-loop on the same
    a tiles; every other slot present gets its own pass over K here, rows of other slots masked out.
    Returns (the main slot's A tile pointers at K offset 0, its rank mask, which rows it holds, the zeroed
    main-slot shrink accumulators for the K-loop, and the other slots' shrinks (gate, up))."""
    offs_r = tl.arange(0, LORA_R)
    main_slot = tl.max(tl.where(has_slot, row_slot, -1), axis=0)
    in_main = has_slot & (row_slot == main_slot)
    main_safe = tl.maximum(main_slot, 0)
    main_rank = tl.where(main_slot >= 0, tl.load(slot_ranks_ptr + main_safe), 0)
    main_rank_valid = offs_r < main_rank
    la_ptrs = (lora_slot_rows(lora_a, main_safe, expert)
               + offs_r[None, :] * lora_a[4] + offs_k[:, None] * lora_a[5])
    main_gate = tl.zeros((BLOCK_M, LORA_R), dtype=tl.float32)
    main_up = tl.zeros((BLOCK_M, LORA_R), dtype=tl.float32)
    other_gate = tl.zeros((BLOCK_M, LORA_R), dtype=tl.float32)
    other_up = tl.zeros((BLOCK_M, LORA_R), dtype=tl.float32)
    others = has_slot & (row_slot != main_slot)
    slot = first_slot(row_slot, others)
    while slot < NO_SLOT:
        in_slot = others & (row_slot == slot)
        la_ptr = lora_slot_rows(lora_a, slot, expert)
        other_gate, other_up = lora_shrink_tile(
            other_gate, other_up, a_ptr, a_row, in_slot, la_ptr, lora_up_offset,
            tl.load(slot_ranks_ptr + slot), 0, K, stride_am, stride_ak, lora_a[4], lora_a[5],
            GATED=GATED, FP32_IEEE=FP32_IEEE, BLOCK_K=BLOCK_K, LORA_R=LORA_R,
        )
        slot = next_slot(row_slot, others, slot)
    return la_ptrs, main_rank_valid, in_main, main_gate, main_up, other_gate, other_up


@triton.jit
def one_row_prologue(
    pair,  # (BLOCK_M,) int32: the program's pair in row 0, the sentinel numel in the others
    pid_m,  # the program's routed pair
    expert,  # int64
    offs_n,  # (BLOCK_N,)
    col_valid,  # (BLOCK_N,) int1
    N,
    token_slots_ptr,  # (M,) int32
    slot_row_div,
    slot_ranks_ptr,  # (L,) int32
    slot_scalings_ptr,  # (L,) fp32
    lora_b,  # (L, E, N or 2N, R)
    shrunk_ptr,  # (numel, splits, 2R or R) fp32 split-K partials
    stride_ss, stride_sm,
    num_shrink_splits,
    down_a,  # (L, E, R, N) down projection's A (DOWN_PREFETCH)
    GATED: tl.constexpr,
    DOWN_PREFETCH: tl.constexpr,
    LATE_WAIT: tl.constexpr,
    LORA_SPLITS: tl.constexpr,
    LORA_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """LORA_ONE_ROW: one decode pair a program (row 0), so its slot is a scalar load beside the expert's
    and no reduction finds it. Nothing loaded here is used before the K-loop (rank masks and scaling apply
    after it), so the weights stream at once instead of after two dependent round trips (slot, then its
    rank). Returns (the pair's partial rows, whether it has a slot, its rank, its scaling, the rows mask,
    B tiles gate and up, the down A tile (zeros unless DOWN_PREFETCH), the raw partials gate and up (only
    without LATE_WAIT: they are written by then))."""
    offs_r = tl.arange(0, LORA_R)
    shrunk_rows = shrunk_ptr + pair.to(tl.int64) * stride_sm
    one_slot = tl.load(token_slots_ptr + pid_m // slot_row_div)
    one_has = one_slot >= 0
    one_safe = tl.where(one_has, one_slot, 0).to(tl.int64)
    one_rank = tl.load(slot_ranks_ptr + one_safe)
    one_scaling = tl.load(slot_scalings_ptr + one_safe)
    # Masks from the slot broadcast first (the interpreter rejects scalar & block masks).
    one_has_r = (tl.zeros((LORA_R,), dtype=tl.int32) + one_slot) >= 0
    one_rows = (tl.arange(0, BLOCK_M) == 0) & ((tl.zeros((BLOCK_M,), dtype=tl.int32) + one_slot) >= 0)
    # The one slot as a group of one (absent: NO_SLOT), its tiles rank-masked after the loop.
    one_col_slot = tl.where(one_has_r, one_slot, NO_SLOT)
    b_gate = load_group_b(lora_b, one_col_slot, expert, offs_n, col_valid, slot_ranks_ptr,
                          LORA_R=LORA_R, GROUP=1,
                          RANK_MASK_LATER=True)
    b_up = b_gate
    if GATED:
        b_up = load_group_b(lora_shift_cols(lora_b, N), one_col_slot, expert, offs_n, col_valid,
                            slot_ranks_ptr,
                            LORA_R=LORA_R, GROUP=1, RANK_MASK_LATER=True)
    if DOWN_PREFETCH:
        down_a_tile = tl.load(
            lora_slot_rows(down_a, one_safe, expert)
            + offs_r[None, :] * down_a[4] + offs_n.to(tl.int64)[:, None] * down_a[5],
            mask=col_valid[:, None] & one_has_r[None, :], other=0.0)
    else:
        down_a_tile = tl.zeros((BLOCK_N, LORA_R), dtype=down_a[0].dtype.element_ty)
    gate_parts = b_gate  # placeholders with LATE_WAIT: the epilogue loads the partials itself
    up_parts = b_gate
    if not LATE_WAIT:
        # Summed after the K-loop (one chunk of splits: ``one_row_lora``).
        gate_parts = load_raw_partials(shrunk_rows, 0, num_shrink_splits, stride_ss, one_rows,
                                       SPLITS=LORA_SPLITS, CHUNK_R=LORA_R)
        if GATED:
            up_parts = load_raw_partials(shrunk_rows, LORA_R, num_shrink_splits, stride_ss, one_rows,
                                         SPLITS=LORA_SPLITS, CHUNK_R=LORA_R)
    return (shrunk_rows, one_has, one_rank, one_scaling, one_rows, b_gate, b_up, down_a_tile, gate_parts,
            up_parts)


@triton.jit
def prefetch_prologue(
    shrunk_rows,  # (BLOCK_M,) pointers to each row's partials
    row_slot,  # (BLOCK_M,) int32
    has_slot,  # (BLOCK_M,) int1
    row_scaling,  # (BLOCK_M,) fp32 scaling of each row's slot (0: none)
    expert,  # int64
    offs_n,  # (BLOCK_N,)
    col_valid,  # (BLOCK_N,) int1
    N,
    slot_ranks_ptr,  # (L,) int32
    lora_b,  # (L, E, N or 2N, R)
    num_shrink_splits, stride_ss,
    down_a,  # (L, E, R, N) (DOWN_PREFETCH)
    GATED: tl.constexpr,
    DOWN_PREFETCH: tl.constexpr,
    LATE_WAIT: tl.constexpr,
    DEFER: tl.constexpr,
    LORA_SPLITS: tl.constexpr,
    LORA_SPLIT_CHUNK: tl.constexpr,
    LORA_GROUP: tl.constexpr,
    LORA_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """LORA_PREFETCHED: everything the epilogue reads for the block's first slot group is loaded before
    the K-loop, so its latency hides behind the loop instead of following it (the partials only once
    they are written: not with LATE_WAIT). LORA_DEFERRED (DEFER, never with LATE_WAIT): nothing loaded
    here is used before the loop either, so no load waits on another's value but the slots: the partials
    come raw (one chunk of splits) and are summed and scaled after it, the B and down A tiles load under
    the slots' presence and take their rank masks after it (``prefetched_expand``, and the kernel for
    the down A tile); same values, same bits.
    Returns (partials gate and up: scaled, or raw with DEFER; the first slot, its group's row map, the
    slot after the group, the group's B tiles gate and up, the first slot's down A tile (zeros unless
    DOWN_PREFETCH: the epilogue's last dependent load), and with DEFER the group's column ranks and the
    first slot's rank (zeros otherwise))."""
    offs_r = tl.arange(0, LORA_R)
    pre_gate = tl.zeros((1, LORA_R), dtype=tl.float32)  # placeholders with LATE_WAIT
    pre_up = pre_gate
    if DEFER:
        pre_gate = load_raw_partials(shrunk_rows, 0, num_shrink_splits, stride_ss, has_slot,
                                     SPLITS=LORA_SPLITS, CHUNK_R=LORA_R)
        pre_up = pre_gate
        if GATED:
            pre_up = load_raw_partials(shrunk_rows, LORA_R, num_shrink_splits, stride_ss, has_slot,
                                       SPLITS=LORA_SPLITS, CHUNK_R=LORA_R)
    elif not LATE_WAIT:
        pre_gate, pre_up = load_scaled_gate_up_partials(
            shrunk_rows, num_shrink_splits, stride_ss, has_slot, row_scaling,
            GATED=GATED, SPLITS=LORA_SPLITS, LORA_R=LORA_R, SPLIT_CHUNK=LORA_SPLIT_CHUNK)
    slot0 = first_slot(row_slot, has_slot)
    col_slot0, row_group0, slot_after0 = slot_group(row_slot, has_slot, slot0, GROUP=LORA_GROUP,
                                                    LORA_R=LORA_R)
    col_rank0 = tl.zeros((LORA_GROUP * LORA_R,), dtype=tl.int32)
    if DEFER:
        col_rank0 = load_group_ranks(col_slot0, slot_ranks_ptr)
    b_gate = load_group_b(lora_b, col_slot0, expert, offs_n, col_valid, slot_ranks_ptr,
                          LORA_R=LORA_R, GROUP=LORA_GROUP, RANK_MASK_LATER=DEFER)
    b_up = b_gate
    if GATED:
        b_up = load_group_b(lora_shift_cols(lora_b, N), col_slot0, expert, offs_n, col_valid,
                            slot_ranks_ptr,
                            LORA_R=LORA_R, GROUP=LORA_GROUP, RANK_MASK_LATER=DEFER)
    has0 = slot0 < NO_SLOT
    slot0_safe = tl.where(has0, slot0, 0)
    rank0 = slot0 * 0  # the first slot's rank, read here only with DEFER
    if DOWN_PREFETCH:
        if DEFER:  # masked by the rank after the loop
            slot0_r = tl.zeros((LORA_R,), dtype=tl.int32) + slot0
            down_mask = col_valid[:, None] & (slot0_r < NO_SLOT)[None, :]
            rank0 = tl.where(has0, tl.load(slot_ranks_ptr + slot0_safe), 0)
        else:
            down_mask = col_valid[:, None] & (offs_r < tl.where(has0, tl.load(slot_ranks_ptr + slot0_safe),
                                                                0))[None, :]
        down_a_tile = tl.load(
            lora_slot_rows(down_a, slot0_safe, expert)
            + offs_r[None, :] * down_a[4] + offs_n.to(tl.int64)[:, None] * down_a[5],
            mask=down_mask, other=0.0)
    else:
        down_a_tile = tl.zeros((BLOCK_N, LORA_R), dtype=down_a[0].dtype.element_ty)
    return pre_gate, pre_up, slot0, row_group0, slot_after0, b_gate, b_up, down_a_tile, col_rank0, rank0


# ---------------------------------------------------------------------------------------------------------
# Epilogues: after the base K-loop, before the routed weight and the activation
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def one_row_expand(
    acc, acc_up,  # (BLOCK_M, BLOCK_N) fp32 gate (or only) and up tiles
    shrunk_rows, one_has, one_rank, one_scaling, one_rows, b_gate, b_up, gate_parts, up_parts,
    num_shrink_splits, stride_ss,
    GATED: tl.constexpr,
    LATE_WAIT: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    LORA_SPLITS: tl.constexpr,
    LORA_SPLIT_CHUNK: tl.constexpr,
    LORA_R: tl.constexpr,
):
    """LORA_ONE_ROW: the same values and dots as ``prefetched_expand`` on a group of one, so the two give
    the same bits."""
    b_gate = mask_group_ranks(b_gate, tl.zeros((LORA_R,), dtype=tl.int32) + one_rank, LORA_R=LORA_R)
    b_up = mask_group_ranks(b_up, tl.zeros((LORA_R,), dtype=tl.int32) + one_rank, LORA_R=LORA_R)
    if one_has:
        if LATE_WAIT:  # the partials are written by now, not before the K-loop
            u = load_shrink_partials(shrunk_rows, 0, num_shrink_splits, stride_ss, one_rows,
                                     SPLITS=LORA_SPLITS, CHUNK_R=LORA_R, SPLIT_CHUNK=LORA_SPLIT_CHUNK)
        else:
            u = sum_raw_partials(gate_parts)
        u = tl.where(one_rows[:, None], u * one_scaling, 0.0).to(b_gate.dtype)
        acc = _dot(u, b_gate, acc, FP32_IEEE)
        if GATED:
            if LATE_WAIT:
                u = load_shrink_partials(shrunk_rows, LORA_R, num_shrink_splits, stride_ss, one_rows,
                                         SPLITS=LORA_SPLITS, CHUNK_R=LORA_R, SPLIT_CHUNK=LORA_SPLIT_CHUNK)
            else:
                u = sum_raw_partials(up_parts)
            u = tl.where(one_rows[:, None], u * one_scaling, 0.0).to(b_up.dtype)
            acc_up = _dot(u, b_up, acc_up, FP32_IEEE)
    return acc, acc_up


@triton.jit
def prefetched_expand(
    acc, acc_up,  # (BLOCK_M, BLOCK_N) fp32
    pre_gate, pre_up, slot0, row_group0, slot_after0, b_gate, b_up, col_rank0,  # ``prefetch_prologue``'s
    shrunk_rows, row_slot, has_slot, row_scaling, expert, offs_n, col_valid, N,
    slot_ranks_ptr, lora_b,
    num_shrink_splits, stride_ss,
    GATED: tl.constexpr,
    LATE_WAIT: tl.constexpr,
    DEFER: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    LORA_SPLITS: tl.constexpr,
    LORA_SPLIT_CHUNK: tl.constexpr,
    LORA_GROUP: tl.constexpr,
    LORA_R: tl.constexpr,
):
    """LORA_PREFETCHED / LORA_DEFERRED: the first slot group from its prefetched operands, then the groups
    past it (more adapters in the block than LORA_GROUP)."""
    if DEFER:  # what ``load_scaled_gate_up_partials`` and ``load_group_b`` would have given
        pre_gate = sum_raw_partials(pre_gate) * row_scaling[:, None]
        if GATED:
            pre_up = sum_raw_partials(pre_up) * row_scaling[:, None]
        else:
            pre_up = pre_gate
        b_gate = mask_group_ranks(b_gate, col_rank0, LORA_R=LORA_R)
        b_up = mask_group_ranks(b_up, col_rank0, LORA_R=LORA_R)
    if LATE_WAIT:
        pre_gate, pre_up = load_scaled_gate_up_partials(
            shrunk_rows, num_shrink_splits, stride_ss, has_slot, row_scaling, GATED=GATED,
            SPLITS=LORA_SPLITS, LORA_R=LORA_R, SPLIT_CHUNK=LORA_SPLIT_CHUNK)
    if slot0 < NO_SLOT:
        acc = _dot(spread_to_group(pre_gate, row_group0, GROUP=LORA_GROUP, LORA_R=LORA_R).to(b_gate.dtype),
                   b_gate, acc, FP32_IEEE)
        if GATED:
            acc_up = _dot(spread_to_group(pre_up, row_group0, GROUP=LORA_GROUP, LORA_R=LORA_R).to(b_up.dtype),
                          b_up, acc_up, FP32_IEEE)
        acc, acc_up = lora_expand_groups(
            acc, acc_up, pre_gate, pre_up, row_slot, has_slot, slot_after0, lora_b, expert,
            offs_n, col_valid, N, slot_ranks_ptr,
            GATED=GATED, FP32_IEEE=FP32_IEEE, LORA_R=LORA_R, GROUP=LORA_GROUP,
        )
    return acc, acc_up


@triton.jit
def grouped_expand(
    acc, acc_up,  # (BLOCK_M, BLOCK_N) fp32
    shrunk_rows, row_slot, has_slot, row_scaling, expert, offs_n, col_valid, N,
    slot_ranks_ptr, lora_b,
    num_shrink_splits, stride_ss,
    GATED: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    LORA_SPLITS: tl.constexpr,
    LORA_SPLIT_CHUNK: tl.constexpr,
    LORA_GROUP: tl.constexpr,
    LORA_R: tl.constexpr,
):
    """LORA_GROUPS (one rank chunk): every row's partials in one load, then one dot per group of slots."""
    u, u_up = load_scaled_gate_up_partials(
        shrunk_rows, num_shrink_splits, stride_ss, has_slot, row_scaling, GATED=GATED,
        SPLITS=LORA_SPLITS, LORA_R=LORA_R, SPLIT_CHUNK=LORA_SPLIT_CHUNK)
    return lora_expand_groups(
        acc, acc_up, u, u_up, row_slot, has_slot, first_slot(row_slot, has_slot), lora_b, expert,
        offs_n, col_valid, N, slot_ranks_ptr,
        GATED=GATED, FP32_IEEE=FP32_IEEE, LORA_R=LORA_R, GROUP=LORA_GROUP,
    )


@triton.jit
def chunked_expand(
    acc, acc_up,  # (BLOCK_M, BLOCK_N) fp32
    shrunk_rows, row_slot, has_slot, expert, offs_n, col_valid, N,
    slot_ranks_ptr, slot_scalings_ptr, lora_b,
    num_shrink_splits, stride_ss,
    GATED: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    LORA_SPLITS: tl.constexpr,
    LORA_SPLIT_CHUNK: tl.constexpr,
    LORA_CHUNK_R: tl.constexpr,
    LORA_R: tl.constexpr,
):
    """LORA_CHUNKED (wide ranks on big tiles): partials and B a slot and a rank chunk at a time, so few
    registers are live beside the accumulators (the grouped form spilled at 128x64 and was slower:
    docs/performance.md, 'Levers': slot groups on big tiles)."""
    slot = first_slot(row_slot, has_slot)
    while slot < NO_SLOT:
        in_slot = has_slot & (row_slot == slot)
        rank = tl.load(slot_ranks_ptr + slot)
        scaling = tl.load(slot_scalings_ptr + slot)
        lb_ptr = lora_slot_rows(lora_b, slot, expert)
        acc = lora_expand_from_partials(
            acc, shrunk_rows, 0, num_shrink_splits, stride_ss, in_slot, lb_ptr, offs_n, col_valid,
            rank, scaling, lora_b[5], lora_b[4],
            FP32_IEEE=FP32_IEEE, LORA_R=LORA_R, CHUNK_R=LORA_CHUNK_R, SPLITS=LORA_SPLITS,
            SPLIT_CHUNK=LORA_SPLIT_CHUNK,
        )
        if GATED:
            acc_up = lora_expand_from_partials(
                acc_up, shrunk_rows, LORA_R, num_shrink_splits, stride_ss, in_slot,
                lb_ptr + N * lora_b[5], offs_n, col_valid, rank, scaling, lora_b[5],
                lora_b[4], FP32_IEEE=FP32_IEEE, LORA_R=LORA_R, CHUNK_R=LORA_CHUNK_R,
                SPLITS=LORA_SPLITS, SPLIT_CHUNK=LORA_SPLIT_CHUNK,
            )
        slot = next_slot(row_slot, has_slot, slot)
    return acc, acc_up


@triton.jit
def slot_range_expand(
    acc, acc_up,  # (BLOCK_M, BLOCK_N) fp32
    shrunk_rows, row_slot, has_slot, expert, offs_n, col_valid, N,
    slot_ranks_ptr, lora_b,
    GATED: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    LORA_R: tl.constexpr,
    LORA_EXT_K: tl.constexpr,
    LORA_EXT_STAGES: tl.constexpr,
):
    """LORA_SLOT_RANGE: the shrink comes packed (summed, scaled, rounded: ``pack_shrink_partials``); the
    expand is a K-loop of its own over the block's slot range, slots side by side."""
    slot_hi = tl.max(tl.where(has_slot, row_slot, -1), axis=0) + 1
    slot_lo = tl.minimum(tl.min(tl.where(has_slot, row_slot, NO_SLOT), axis=0), slot_hi)
    acc = lora_expand_slot_range(
        acc, shrunk_rows, 0, row_slot, has_slot, slot_lo, slot_hi, lora_b, expert, offs_n,
        col_valid, slot_ranks_ptr,
        FP32_IEEE=FP32_IEEE, LORA_R=LORA_R, EXT_K=LORA_EXT_K, EXT_STAGES=LORA_EXT_STAGES,
    )
    if GATED:
        acc_up = lora_expand_slot_range(
            acc_up, shrunk_rows, LORA_R, row_slot, has_slot, slot_lo, slot_hi,
            lora_shift_cols(lora_b, N), expert, offs_n, col_valid, slot_ranks_ptr, FP32_IEEE=FP32_IEEE,
            LORA_R=LORA_R, EXT_K=LORA_EXT_K, EXT_STAGES=LORA_EXT_STAGES,
        )
    return acc, acc_up


@triton.jit
def down_shrink_epilogue(
    act,  # (BLOCK_M, BLOCK_N) fp32 the activated tile
    c_ptr,  # GEMM1's output: GEMM2 reads the tile in its dtype
    pair, row_slot, has_slot, expert, offs_n, col_valid, pid_n,
    one_has, one_rank, one_rows,  # LORA_ONE_ROW's scalars (ignored otherwise)
    down_a_tile,  # (BLOCK_N, LORA_R) the first slot's down A tile (DOWN_PREFETCH)
    down_a,  # (L, E, R, N)
    down_shrunk_ptr,  # (numel, cdiv(N, BLOCK_N), LORA_R) fp32 out
    stride_ds, stride_dm,
    slot_ranks_ptr,
    ONE_ROW: tl.constexpr,
    DOWN_PREFETCH: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    LORA_R: tl.constexpr,
    LORA_CHUNK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """GEMM1 writes GEMM2's shrink on the tile it just activated (as GEMM2 will read it, rounded to c's
    dtype), one partial per N tile: ``down_shrunk[p, pid_n, :] = h[p, tile] @ A_down[s, e, :, tile]^T``; no
    launch re-reads h. The rounding happens inside the one-row branch: done before it, every program (and
    the slower GEMM1 of a one-token batch, by ~2 points on DeepSeek-V2-Lite) paid for it."""
    if ONE_ROW and DOWN_PREFETCH:
        offs_r = tl.arange(0, LORA_R)
        if one_has:
            first = tl.where((offs_r < one_rank)[None, :], down_a_tile, 0.0)
            part = _dot(act.to(c_ptr.dtype.element_ty), first, tl.zeros((BLOCK_M, LORA_R), dtype=tl.float32),
                        FP32_IEEE)
            down_rows = down_shrunk_ptr + pair.to(tl.int64) * stride_dm + pid_n * stride_ds
            tl.store(down_rows[:, None] + offs_r[None, :], part, mask=one_rows[:, None])
    else:
        lora_store_down_partials(
            act.to(c_ptr.dtype.element_ty), row_slot, has_slot, pair, expert, offs_n, col_valid, pid_n,
            down_a, down_shrunk_ptr, slot_ranks_ptr, down_a_tile, stride_ds, stride_dm, FP32_IEEE=FP32_IEEE,
            LORA_R=LORA_R, CHUNK_R=LORA_CHUNK_R, FIRST_PREFETCHED=DOWN_PREFETCH,
        )
