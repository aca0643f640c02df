"""Grouped GEMM over routed (token, expert) pairs: the two projections of a fused MoE layer.

Semantics:  for every routed pair p = t*top_k + j with expert e = topk_ids[t, j]:
              ACTIVATION = none:  c[p, :]  = scale * w_p^m * (B[e] @ a[p // a_row_div])
              ACTIVATION = silu:  c[p, :N] = act(g) * u,  g = s B[e, :N] a,  u = s B[e, N:2N] a
              ACTIVATION = gated_raw: c[p, :N] = g, c[p, N:2N] = u (the staged LoRA path: same tiles and
                                  dots as the gated epilogue, so rows without an adapter match it bit for bit)
            with w_p^m = topk_weights[p] when MUL_ROUTED_WEIGHT else 1, s = scale * w_p^m, and
            a_row_div = top_k for GEMM1 (rows of x) and 1 for GEMM2 (rows of the intermediate).
            With BLOCK_SCALED (float8_e4m3fn a and B, ``triton_ops.fp8``) B[e] @ a is the block-scaled
            product: each BLOCK_K step (= the scale group) adds its dot times a_scale[row, g] and
            b_scale[e, n // SCALE_BLOCK_N, g]. With TILE_B_SCALE a tile's columns (and its up columns)
            lie in one weight scale block: one scale per step, folded into the rows' scales, so the
            step's promotion is one multiply-add per accumulator element instead of two.
Grid:       (cdiv(max_padded, BLOCK_M) * cdiv(N, BLOCK_N),), grouped GROUP_M blocks of M at a time so
            consecutive programs reuse the same weight tiles from L2.

With LORA (any variant but LORA_NONE) every pair also gets its adapter's delta, per docs/design.md §1:
            GEMM1: g += s_a B_gate[a,e] (A_gate[a,e] x),  u += s_a B_up[a,e] (A_up[a,e] x)  before act;
            GEMM2: y += s_a B_down[a,e] (A_down[a,e] h)  before the routed weight and rsf,
            with a = token_slots[p // slot_row_div] (-1: no delta). Where the shrink comes from (inside the
            base K-loop, or precomputed by ``moe_lora_a``) and how the expand is tiled is the LoRA variant,
            one prologue and one epilogue helper each in ``lora_epilogues`` (its table lists them). With
            DOWN_SHRINK, GEMM1's epilogue also writes GEMM2's shrink A_down[a,e] h as one partial per N tile
            (``down_shrunk``), which GEMM2 then reads as ``shrunk``.

The kernel body reads prologue (the tile, its pairs and expert, the LoRA operands wanted before the loop)
-> K-loop (``_gemm_k_loop``) -> epilogue (the LoRA delta, routed weight, activation, store).

Rows come in the order of ``moe_align_block_size``: every BLOCK_M block holds one expert's pairs, padded
with the sentinel ``numel``; blocks at or past ``num_post_padded`` exit at once, so the grid can be sized
on the host without a sync. A null block (expert id -1: pairs whose id is outside [0, E)) reads nothing
and writes zero rows. With DIRECT_PAIRS (one decode token: its top-k experts are distinct) there is no
alignment: block b is routed pair b alone, its expert read from the flat topk_ids (``_direct_pair``).
Offsets into a, b and c are int64.

Decode extras (no launch of their own): with ZERO_COUNTERS GEMM1's program 0 zeroes GEMM2's per-column
arrival counters; with FUSED_SUM the last GEMM2 program of each N-tile column sums the top-k rows of every
token into ``sum_out`` (``moe_sum.finish_topk_sum_if_last``), replacing the top-k sum launch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from triton_ops import overrides
from triton_ops.configs import (
    GemmConfig,
)
from triton_ops.fp8 import FP8_DTYPE
from triton_ops.gemm_tiles import (  # noqa: F401  (the activation codes, importable from here as before)
    _ACTIVATION_CODES,
    _PLAIN_ACTIVATIONS,
    ACTIVATION_CLAMPED_SILU_AFTER,
    ACTIVATION_CLAMPED_SWIGLU,
    ACTIVATION_GATED_RAW,
    ACTIVATION_GELU,
    ACTIVATION_GELU_TANH,
    ACTIVATION_NONE,
    ACTIVATION_RELU,
    ACTIVATION_SILU,
    ACTIVATION_SOFTCAPPED_SWIGLU,
    _add_block_scaled_dot,
    _direct_pair,
    _expert_bias,
    _gated_activation,
    _gemm_k_loop,
    _grouped_tile,
    _row_scale,
    _store_rows,
    activation_args,
)
from triton_ops.hostmath import cdiv, next_power_of_2
from triton_ops.launch import active_cache, launch, planned
from triton_ops.lora_epilogues import (
    LORA_CHUNKED,
    LORA_DEFERRED,
    LORA_FUSED,
    LORA_GROUPS,
    LORA_NONE,
    LORA_ONE_ROW,
    LORA_PREFETCHED,
    LORA_SLOT_RANGE,
    chunked_expand,
    down_shrink_epilogue,
    fused_shrink_prologue,
    grouped_expand,
    one_row_expand,
    one_row_prologue,
    prefetch_prologue,
    prefetched_expand,
    slot_range_expand,
)
from triton_ops.lora_tiles import lora_expand_slots
from triton_ops.lora_weights import LoRAWeights, lora_weights
from triton_ops.moe_inputs import gate_up_dims, is_gate_up_halves
from triton_ops.moe_sum import finish_topk_sum_if_last
from triton_ops.pdl import (
    programmatic_launch,
    require_dependent_launch,
    wait_for_previous_kernel,
    wait_for_previous_kernel_late,
)
from triton_ops.plan import (  # noqa: F401  (the launch rules, importable from here as before)
    BIG_TILE,
    BIG_TILE_SLOT_GROUP,
    BIG_TILE_SLOT_GROUP_GATED,
    BIG_TILE_SLOT_GROUP_LONG_K,
    LAUNCH_ADAPTER_COUNT_EXACT,
    LAUNCH_ADAPTER_COUNT_MAX,
    LONG_K_SLOT_GROUP_MIN_K,
    PREFETCH_MAX_ADAPTERS_PAST_DECODE,
    LoRAEpilogue,
    _check_down_shrink,
    _check_packed,
    _fits_one_wave,
    gemm_blocks_per_sm,
    launch_adapter_count,
    lora_ext_cols,
    lora_ext_expand,
    lora_prefetch_pays,
    lora_rank_block,
    lora_rank_chunk,
    lora_slot_group,
    lora_tile_slot_group,
    lora_variant,
    one_row_lora,
    plan_lora_epilogue,
    sm_count,
    swap_ab,
    tile_b_scale,
)


# Sizes that change with every batch are not specialized (a compile per divisibility class otherwise);
# num_tokens keeps its == 1 specialization, the one-token decode.
@triton.jit(do_not_specialize=["numel", "max_padded"], do_not_specialize_on_alignment=["num_tokens"])
def _fused_moe_kernel(
    # The GEMM: a (rows, K) @ b[e] (N or 2N, K)^T -> c (numel, N), rows of a picked per routed pair. Each
    # operand is one bundle: its pointer, then its strides (and tables).
    a,  # ((rows, K) fp16/bf16/fp32 x for GEMM1 or the activated intermediate for GEMM2, stride_m, stride_k)
    b,  # ((E, N or 2N, K) same dtype: w13 (gate rows then up rows) or w2, stride_e, stride_n, stride_k,
    #     stride_up: gated, offset of the up rows from the gate rows)
    c,  # ((numel, N) same dtype, a row per routed pair (2N with the raw gated output), stride_m, stride_n)
    a_scale,  # ((rows, cdiv(K, BLOCK_K)) fp32 per-row group scales of a, stride_m, stride_k) (FP8)
    b_scale,  # ((E, cdiv(N or 2N, SCALE_BLOCK_N), cdiv(K, BLOCK_K)) fp32 weight block scales (FP8), or
    #           (E, N or 2N, K / 32) uint8 E8M0 scales (MXFP4), stride_e, stride_n, stride_k, and MXFP4's up
    #           rows' offset)
    bias,  # ((E, N or 2N) same dtype as c: the experts' biases (gate then up), stride_e) (HAS_BIAS)
    N, K, num_experts,
    scale,  # multiplies every output row (rsf on GEMM2)
    # Routed pairs: the alignment's blocks, or with DIRECT_PAIRS the flat topk_ids in all three pointers
    sorted_ids_ptr,  # (max_padded,) int32, from moe_align_block_size
    expert_ids_ptr,  # (max_padded / BLOCK_M,) int32
    num_post_padded_ptr,  # (1,) int32
    topk_weights_ptr,  # (numel,) fp32, read when MUL_ROUTED_WEIGHT
    numel, max_padded,
    a_row_div,  # pair p reads row p // a_row_div of a (top_k for GEMM1, 1 for GEMM2)
    # LoRA (LORA != LORA_NONE): each token's slot and the slots' tables
    token_slots_ptr,  # (M,) int32 adapter slot per token, -1 = none
    slot_ranks_ptr,  # (L,) int32 real rank per slot
    slot_scalings_ptr,  # (L,) fp32 scaling per slot
    slot_row_div,  # pair p belongs to token p // slot_row_div
    lora_a,  # LoRA A (L, E, R or 2R, K): gate_up_a (gate rows, then up rows) or down_a (lora_tiles bundle)
    lora_up_offset,  # offset of the up rows in lora_a
    lora_b,  # LoRA B (L, E, N or 2N, R): gate_up_b (gate rows, then up rows) or down_b (lora_tiles bundle)
    shrunk,  # ((numel, splits, 2*LORA_R or LORA_R) fp32 split-K shrink partials (LORA >= LORA_ONE_ROW) or,
    #          for LORA_SLOT_RANGE, (numel, 2*LORA_R or LORA_R) a's dtype packed, stride_split, stride_m)
    num_shrink_splits,
    down_a,  # LoRA A of the down projection (L, E, R, N) (DOWN_SHRINK; lora_tiles bundle)
    down_shrunk,  # ((numel, cdiv(N, BLOCK_N), LORA_R) fp32 out: its partials per N tile, stride_tile,
    #               stride_m) (DOWN_SHRINK)
    # The top-k sum at decode (FUSED_SUM; ZERO_COUNTERS: GEMM1 zeroes GEMM2's counters)
    sum_out,  # ((num_tokens, N) same dtype as c, out: the top-k sum, stride_m, stride_n)
    sum_counters_ptr,  # (num_counters,) int32 GEMM2 column arrivals
    num_counters, num_tokens, top_k,
    # Meta-parameters, bundled by concern (each bundle's order: its builder in this module)
    LORA_PLAN: tl.constexpr,  # (variant, R, CHUNK_R, SPLITS, SPLIT_CHUNK, GROUP, EXT_K, DOWN_SHRINK,
    #                            DOWN_PREFETCH, EXT_STAGES): _lora_meta
    ACT: tl.constexpr,  # (ACTIVATION, LIMIT, ALPHA, UP_OFFSET): gemm_tiles.activation_args
    FP8: tl.constexpr,  # (BLOCK_SCALED, TILE_B_SCALE, SCALE_BLOCK_N): each tile (and its up tile) within
    #                     one weight scale block; rows of b per weight scale block
    TILE: tl.constexpr,  # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K)
    TOPK_SUM: tl.constexpr,  # (ZERO_COUNTERS, COUNTERS_BLOCK, FUSED_SUM, SUM_BLOCK_T)
    MUL_ROUTED_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    DIRECT_PAIRS: tl.constexpr,
    MXFP4: tl.constexpr = False,  # b packed E2M1 (E, N or 2N, K / 2) uint8 with b_scale's E8M0 scales
    SWAP_AB: tl.constexpr = False,  # the K-loop accumulates b^T a^T (plan.swap_ab)
    USE_PDL: tl.constexpr = False,  # set by programmatic_launch where dependent launch exists
    LATE_WAIT: tl.constexpr = False,
):
    LORA: tl.constexpr = LORA_PLAN[0]
    LORA_R: tl.constexpr = LORA_PLAN[1]
    LORA_CHUNK_R: tl.constexpr = LORA_PLAN[2]
    LORA_SPLITS: tl.constexpr = LORA_PLAN[3]
    LORA_SPLIT_CHUNK: tl.constexpr = LORA_PLAN[4]
    LORA_GROUP: tl.constexpr = LORA_PLAN[5]
    LORA_EXT_K: tl.constexpr = LORA_PLAN[6]
    DOWN_SHRINK: tl.constexpr = LORA_PLAN[7]
    DOWN_PREFETCH: tl.constexpr = LORA_PLAN[8]
    LORA_EXT_STAGES: tl.constexpr = LORA_PLAN[9]
    ACTIVATION: tl.constexpr = ACT[0]
    BLOCK_SCALED: tl.constexpr = FP8[0]
    TILE_B_SCALE: tl.constexpr = FP8[1]
    SCALE_BLOCK_N: tl.constexpr = FP8[2]
    BLOCK_M: tl.constexpr = TILE[0]
    BLOCK_N: tl.constexpr = TILE[1]
    BLOCK_K: tl.constexpr = TILE[2]
    GROUP_M: tl.constexpr = TILE[3]
    EVEN_K: tl.constexpr = TILE[4]
    ZERO_COUNTERS: tl.constexpr = TOPK_SUM[0]
    COUNTERS_BLOCK: tl.constexpr = TOPK_SUM[1]
    FUSED_SUM: tl.constexpr = TOPK_SUM[2]
    SUM_BLOCK_T: tl.constexpr = TOPK_SUM[3]
    a_ptr, stride_am, stride_ak = a
    b_ptr, stride_be, stride_bn, stride_bk, stride_b_up = b
    c_ptr, stride_cm, stride_cn = c
    a_scale_ptr, stride_asm, stride_ask = a_scale
    b_scale_ptr, stride_bse, stride_bsn, stride_bsk, stride_bs_up = b_scale
    bias_ptr, stride_bias_e = bias
    shrunk_ptr, stride_ss, stride_sm = shrunk
    down_shrunk_ptr, stride_ds, stride_dm = down_shrunk
    sum_out_ptr, stride_om, stride_on = sum_out
    GATED: tl.constexpr = ACTIVATION != 0
    # ---- prologue: the program's tile, its routed pairs and expert ----
    # LATE_WAIT: launched dependently after a kernel that writes only the LoRA shrink partials, which the
    # epilogue alone reads: the base K-loop runs first, the wait comes after it.
    if not LATE_WAIT:
        wait_for_previous_kernel(USE_PDL)
    pid = tl.program_id(0)
    if ZERO_COUNTERS:
        if pid == 0:
            counter_offs = tl.arange(0, COUNTERS_BLOCK)
            tl.store(sum_counters_ptr + counter_offs, tl.zeros((COUNTERS_BLOCK,), dtype=tl.int32),
                     mask=counter_offs < num_counters)
    pid_m, pid_n = _grouped_tile(pid, max_padded, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = offs_n < N
    if DIRECT_PAIRS:
        expert, pair, null_pair = _direct_pair(expert_ids_ptr, pid_m, numel, num_experts, BLOCK_M)
        used_blocks = numel
    else:
        num_post_padded = tl.load(num_post_padded_ptr)
        if pid_m * BLOCK_M >= num_post_padded:
            return
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        used_blocks = num_post_padded // BLOCK_M
        if expert < 0:
            # A null block (pairs whose id is outside [0, E)): zero rows (both halves of a raw gated
            # row), and this column's arrival for the fused top-k sum.
            wait_for_previous_kernel_late(LATE_WAIT)
            zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            _store_rows(c_ptr, zeros, pair, pair < numel, offs_n, col_valid, stride_cm, stride_cn)
            if ACTIVATION == 3:
                _store_rows(c_ptr, zeros, pair, pair < numel, offs_n + N, col_valid, stride_cm, stride_cn)
            if FUSED_SUM:
                finish_topk_sum_if_last(
                    c_ptr, sum_out_ptr, sum_counters_ptr + pid_n, used_blocks, offs_n, col_valid, num_tokens,
                    top_k, stride_cm, stride_cn, stride_om, stride_on, BLOCK_N=BLOCK_N, BLOCK_T=SUM_BLOCK_T,
                )
            return
    row_valid = pair < numel
    a_row = (pair // a_row_div).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)

    # ---- prologue: the LoRA operands wanted before the K-loop (lora_epilogues) ----
    if LORA != LORA_NONE:
        row_slot = tl.load(token_slots_ptr + pair // slot_row_div, mask=row_valid, other=-1)
        has_slot = row_valid & (row_slot >= 0)
        down_a0 = tl.zeros((BLOCK_N, LORA_R), dtype=down_a[0].dtype.element_ty)  # unless prefetched
    if LORA == LORA_FUSED:
        la_ptrs, main_rank_valid, in_main, main_gate, main_up, lora_gate, lora_up = fused_shrink_prologue(
            a_ptr, a_row, row_slot, has_slot, expert, offs_k, K, stride_am, stride_ak, lora_a,
            lora_up_offset,
            slot_ranks_ptr,
            GATED=GATED, FP32_IEEE=FP32_IEEE, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, LORA_R=LORA_R)
    elif LORA == LORA_ONE_ROW:
        (shrunk_rows, one_has, one_rank, one_scaling, one_rows, b0_gate, b0_up, down_a0, gate_parts,
         up_parts) = one_row_prologue(
            pair, pid_m, expert, offs_n, col_valid, N, token_slots_ptr, slot_row_div, slot_ranks_ptr,
            slot_scalings_ptr, lora_b, shrunk_ptr,
            stride_ss, stride_sm, num_shrink_splits, down_a, GATED=GATED, DOWN_PREFETCH=DOWN_PREFETCH,
            LATE_WAIT=LATE_WAIT,
            LORA_SPLITS=LORA_SPLITS, LORA_R=LORA_R, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    elif LORA != LORA_NONE:
        shrunk_rows = shrunk_ptr + pair.to(tl.int64) * stride_sm
        row_scaling = tl.load(slot_scalings_ptr + tl.where(has_slot, row_slot, 0), mask=has_slot, other=0.0)
        if (LORA == LORA_PREFETCHED) | (LORA == LORA_DEFERRED):
            (pre_gate, pre_up, slot0, row_group0, slot_after0, b0_gate, b0_up, down_a0, col_rank0,
             rank0) = prefetch_prologue(
                shrunk_rows, row_slot, has_slot, row_scaling, expert, offs_n, col_valid, N, slot_ranks_ptr,
                lora_b,
                num_shrink_splits,
                stride_ss, down_a,
                GATED=GATED,
                DOWN_PREFETCH=DOWN_PREFETCH, LATE_WAIT=LATE_WAIT, DEFER=LORA == LORA_DEFERRED,
                LORA_SPLITS=LORA_SPLITS,
                LORA_SPLIT_CHUNK=LORA_SPLIT_CHUNK, LORA_GROUP=LORA_GROUP, LORA_R=LORA_R, BLOCK_N=BLOCK_N)

    # ---- K-loop ----
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    if MXFP4:  # b's K rows are bytes, two values each
        b_base = b_ptr + expert * stride_be + tl.arange(0, BLOCK_K // 2)[:, None] * stride_bk
    else:
        b_base = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk
    b_ptrs = b_base + offs_n.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up_ptrs, acc_up = b_ptrs, acc  # the up half's, when gated
    if GATED:
        up_ptrs = b_base + offs_n.to(tl.int64)[None, :] * stride_bn + stride_b_up
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if LORA != LORA_FUSED:  # nothing rides along the loop: placeholders it passes through
        la_ptrs, main_rank_valid, main_gate, main_up = b_ptrs, offs_k, acc, acc
    a_scale_ptrs = a_scale_ptr + a_row * stride_asm
    b_scale_base = b_scale_ptr + expert * stride_bse
    if MXFP4:  # a scale per column and 32 K rows
        b_scale_ptrs = (b_scale_base + tl.arange(0, BLOCK_K // 32)[:, None] * stride_bsk
                        + offs_n.to(tl.int64)[None, :] * stride_bsn)
        up_scale_ptrs = b_scale_ptrs + stride_bs_up
    elif TILE_B_SCALE:  # the tile's first column's block is all of its columns'
        b_scale_ptrs = b_scale_base + ((pid_n * BLOCK_N) // SCALE_BLOCK_N).to(tl.int64) * stride_bsn
        up_scale_ptrs = b_scale_base + ((pid_n * BLOCK_N + N) // SCALE_BLOCK_N).to(tl.int64) * stride_bsn
    else:
        b_scale_ptrs = b_scale_base + (offs_n // SCALE_BLOCK_N).to(tl.int64) * stride_bsn
        up_scale_ptrs = b_scale_base + ((offs_n + N) // SCALE_BLOCK_N).to(tl.int64) * stride_bsn
    acc, acc_up, main_gate, main_up = _gemm_k_loop(
        a_ptrs, b_ptrs, up_ptrs, la_ptrs, row_valid, col_valid, main_rank_valid, offs_k, a_scale_ptrs,
        b_scale_ptrs, up_scale_ptrs, K, stride_ak, stride_bk, lora_a[5], lora_up_offset, stride_ask,
        stride_bsk, acc, acc_up, main_gate, main_up, GATED=GATED, INLINE_SHRINK=LORA == LORA_FUSED,
        BLOCK_SCALED=BLOCK_SCALED, TILE_B_SCALE=TILE_B_SCALE, FP32_IEEE=FP32_IEEE, EVEN_K=EVEN_K,
        BLOCK_K=BLOCK_K, MXFP4=MXFP4, SWAP_AB=SWAP_AB,
    )

    # ---- epilogue: the LoRA delta (lora_epilogues), then routed weight, activation and store ----
    wait_for_previous_kernel_late(LATE_WAIT)
    if not GATED:
        acc_up = acc  # one accumulator: the expand helpers hand back an up tile they leave alone
    if LORA == LORA_FUSED:
        acc, acc_up = lora_expand_slots(
            acc, acc_up, tl.where(in_main[:, None], main_gate, lora_gate),
            tl.where(in_main[:, None], main_up, lora_up), row_valid, row_slot, lora_b, expert, offs_n,
            col_valid, N, slot_ranks_ptr, slot_scalings_ptr, GATED=GATED, FP32_IEEE=FP32_IEEE,
            LORA_R=LORA_R,
        )
    elif LORA == LORA_ONE_ROW:
        acc, acc_up = one_row_expand(
            acc, acc_up, shrunk_rows, one_has, one_rank, one_scaling, one_rows, b0_gate, b0_up, gate_parts,
            up_parts, num_shrink_splits, stride_ss, GATED=GATED, LATE_WAIT=LATE_WAIT, FP32_IEEE=FP32_IEEE,
            LORA_SPLITS=LORA_SPLITS, LORA_SPLIT_CHUNK=LORA_SPLIT_CHUNK, LORA_R=LORA_R)
    elif (LORA == LORA_PREFETCHED) | (LORA == LORA_DEFERRED):
        acc, acc_up = prefetched_expand(
            acc, acc_up, pre_gate, pre_up, slot0, row_group0, slot_after0, b0_gate, b0_up, col_rank0,
            shrunk_rows, row_slot, has_slot, row_scaling, expert, offs_n, col_valid, N, slot_ranks_ptr,
            lora_b, num_shrink_splits, stride_ss, GATED=GATED,
            LATE_WAIT=LATE_WAIT, DEFER=LORA == LORA_DEFERRED, FP32_IEEE=FP32_IEEE, LORA_SPLITS=LORA_SPLITS,
            LORA_SPLIT_CHUNK=LORA_SPLIT_CHUNK, LORA_GROUP=LORA_GROUP, LORA_R=LORA_R)
    elif LORA == LORA_GROUPS:
        acc, acc_up = grouped_expand(
            acc, acc_up, shrunk_rows, row_slot, has_slot, row_scaling, expert, offs_n, col_valid, N,
            slot_ranks_ptr, lora_b,
            num_shrink_splits, stride_ss, GATED=GATED, FP32_IEEE=FP32_IEEE, LORA_SPLITS=LORA_SPLITS,
            LORA_SPLIT_CHUNK=LORA_SPLIT_CHUNK, LORA_GROUP=LORA_GROUP, LORA_R=LORA_R)
    elif LORA == LORA_CHUNKED:
        acc, acc_up = chunked_expand(
            acc, acc_up, shrunk_rows, row_slot, has_slot, expert, offs_n, col_valid, N, slot_ranks_ptr,
            slot_scalings_ptr, lora_b,
            num_shrink_splits, stride_ss, GATED=GATED, FP32_IEEE=FP32_IEEE, LORA_SPLITS=LORA_SPLITS,
            LORA_SPLIT_CHUNK=LORA_SPLIT_CHUNK, LORA_CHUNK_R=LORA_CHUNK_R, LORA_R=LORA_R)
    elif LORA == LORA_SLOT_RANGE:
        acc, acc_up = slot_range_expand(
            acc, acc_up, shrunk_rows, row_slot, has_slot, expert, offs_n, col_valid, N, slot_ranks_ptr,
            lora_b, GATED=GATED,
            FP32_IEEE=FP32_IEEE,
            LORA_R=LORA_R, LORA_EXT_K=LORA_EXT_K, LORA_EXT_STAGES=LORA_EXT_STAGES)

    row_scale = _row_scale(topk_weights_ptr, pair, row_valid, scale, MUL_ROUTED_WEIGHT, BLOCK_M)
    if DIRECT_PAIRS:
        row_scale = tl.where(null_pair, 0.0, row_scale)
    if HAS_BIAS and not GATED:  # GEMM2: the bias is part of the expert's output, inside the routed weight
        acc += _expert_bias(bias_ptr, expert, stride_bias_e, offs_n, col_valid)[None, :]
    acc *= row_scale[:, None]
    if GATED:
        acc_up *= row_scale[:, None]
        if HAS_BIAS:  # GEMM1: after a weight on the input, which scales x, not the bias
            acc += _expert_bias(bias_ptr, expert, stride_bias_e, offs_n, col_valid)[None, :]
            acc_up += _expert_bias(bias_ptr, expert, stride_bias_e, offs_n + N, col_valid)[None, :]
        if ACTIVATION == 3:  # raw gate and up halves, for the staged LoRA path
            _store_rows(c_ptr, acc_up, pair, row_valid, offs_n + N, col_valid, stride_cm, stride_cn)
        else:
            acc = _gated_activation(acc, acc_up, ACT[0], ACT[1], ACT[2], ACT[3])
            if DOWN_SHRINK:
                if LORA != LORA_ONE_ROW:  # its scalars exist only there
                    one_has, one_rank, one_rows = 0, 0, row_valid
                if LORA == LORA_DEFERRED:
                    if DOWN_PREFETCH:  # the rank mask its prologue left for after the K-loop
                        down_a0 = tl.where((tl.arange(0, LORA_R) < rank0)[None, :], down_a0, 0.0)
                down_shrink_epilogue(
                    acc, c_ptr, pair, row_slot, has_slot, expert, offs_n, col_valid,
                    pid_n, one_has, one_rank, one_rows, down_a0, down_a, down_shrunk_ptr, stride_ds,
                    stride_dm, slot_ranks_ptr,
                    ONE_ROW=LORA == LORA_ONE_ROW, DOWN_PREFETCH=DOWN_PREFETCH, FP32_IEEE=FP32_IEEE,
                    LORA_R=LORA_R, LORA_CHUNK_R=LORA_CHUNK_R, BLOCK_M=BLOCK_M)
    if DIRECT_PAIRS:
        acc = tl.where(null_pair, 0.0, acc)
    _store_rows(c_ptr, acc, pair, row_valid, offs_n, col_valid, stride_cm, stride_cn)
    if FUSED_SUM:
        finish_topk_sum_if_last(
            c_ptr, sum_out_ptr, sum_counters_ptr + pid_n, used_blocks, offs_n, col_valid, num_tokens, top_k,
            stride_cm, stride_cn, stride_om, stride_on, BLOCK_N=BLOCK_N, BLOCK_T=SUM_BLOCK_T,
        )


@dataclass(slots=True)
class LoRAOperands:
    """The adapter side of one all-in-one GEMM: which slot each token uses and one projection's A/B.
    Built per call by ``fused_experts``, which fills the shrink fields in place as it launches the shrinks.

    ``lora_a`` is A over K or, for the gated GEMM1, gate_up_a with the up rows after the gate rows;
    ``lora_b`` is B over N or gate_up_b over 2N: :class:`LoRAWeights`, or dense (L, E, R or 2R, K) and
    (L, E, N or 2N, R) tensors. ``rank_block`` is the tile width for the rank (a power of two >= 16
    covering the largest rank in the batch).
    """

    token_slots: torch.Tensor  # (M,) int32, -1 = no adapter
    lora_a: torch.Tensor | LoRAWeights
    lora_b: torch.Tensor | LoRAWeights
    slot_ranks: torch.Tensor  # (L,) int32
    slot_scalings: torch.Tensor  # (L,) fp32
    top_k: int
    rank_block: int
    shrunk: torch.Tensor | None = None  # (numel, splits, 2*rank_block or rank_block) fp32 partials
    num_adapters: int = 0  # distinct adapters in the batch (0: unknown): sizes the slot groups
    # GEMM1 only: down_a (L, E, R, N) and its partials out, (numel, cdiv(N, BLOCK_N), rank_block) fp32,
    # written by the epilogue (GEMM2's shrink without a launch of its own).
    down_a: torch.Tensor | LoRAWeights | None = None
    down_shrunk: torch.Tensor | None = None
    # Instead of ``shrunk``: (numel, 2*rank_block or rank_block) in the GEMM's dtype, the shrink summed,
    # scaled and rounded (``pack_shrink_partials``); the epilogue then expands the block's slot range in a
    # K-loop of its own (``lora_ext_expand``).
    packed: torch.Tensor | None = None


@dataclass(frozen=True)
class TopkSumOperands:
    """GEMM2's fused top-k sum at decode: ``out`` (num_tokens, N) receives sum_j c[t * top_k + j] and
    ``counters`` (cdiv(N, BLOCK_N),) int32 counts each column's arrivals; GEMM1 zeroes them first (the
    same object passed to GEMM1 as ``zero_counters``), so they need no memset launch."""

    out: torch.Tensor
    counters: torch.Tensor
    top_k: int


def invoke_fused_moe_kernel(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    topk_weights: torch.Tensor | None,
    sorted_ids: torch.Tensor | None = None,
    expert_ids: torch.Tensor | None = None,
    num_post_padded: torch.Tensor | None = None,
    a_row_div: int,
    config: GemmConfig,
    activation: Any = None,
    scale: float = 1.0,
    lora: LoRAOperands | None = None,
    direct_ids: torch.Tensor | None = None,
    zero_counters: TopkSumOperands | None = None,
    topk_sum: TopkSumOperands | None = None,
    late_wait: bool = False,
    dependent: bool = False,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    scale_block_n: int = 0,
    bias: torch.Tensor | None = None,
) -> None:
    """Launches one grouped GEMM; ``c`` is (numel, N) with N = b.shape[1] (or b.shape[1] // 2 with a
    gated ``activation``). ``topk_weights`` (numel,) fp32 multiplies rows when given. No host sync.

    Block-scaled FP8 (``triton_ops.fp8``): a and b float8_e4m3fn, ``a_scale`` (rows, cdiv(K, block_k))
    and ``b_scale`` (E, cdiv(b.shape[1], scale_block_n), cdiv(K, block_k)) fp32, ``config.block_k`` the
    scale group block_k; c in the activations' dtype. LoRA then needs its shrink precomputed
    (``lora.shrunk`` or ``lora.packed``): the K-loop's a is the FP8 copy, which a LoRA shrink must not read.

    Rows come from the alignment (``sorted_ids``, ``expert_ids``, ``num_post_padded``) or, for one decode
    token, from ``direct_ids``: its flat (top_k,) topk_ids, each pair a block of its own. ``topk_sum``
    (GEMM2) also writes the top-k sum of ``c``'s rows; ``zero_counters`` (GEMM1) zeroes its counters.

    ``late_wait`` (sm_90+): the launch before this one wrote only ``lora.shrunk`` and let this one be
    scheduled early (``decode_shrink_overlap``, ``prefill_shrink_overlap``); this launch is dependent and
    waits for it only after its K-loop. Everything else it reads (the alignment, ``a``) must have been
    complete before that launch started (a plain launch after its writer), so only the precomputed shrink
    partials are read after the wait.

    ``dependent`` (sm_90+, ignored elsewhere): launched dependently, waiting for the launch before it as
    its first instruction (a link of ``pdl.dependent_fp8_decode``'s chain).

    ``bias`` (E, b.shape[1]), contiguous rows: the experts' biases, added to each pair's product (and
    LoRA delta) inside the routed weight of an ungated GEMM, after it for a gated one (a weight on the
    input scales x, not the bias), before the activation."""
    numel = c.shape[0]
    direct = direct_ids is not None
    gated = activation is not None
    out_n = c.shape[1] // 2 if activation == "gated_raw" else c.shape[1]
    num_experts, b_rows, _ = gate_up_dims(b)  # b: (E, N or 2N, K), or GEMM1's (E, 2, N, K) halves view
    if is_gate_up_halves(b) and (not gated or b.dtype == FP8_DTYPE):
        raise ValueError("a (E, 2, I, H) halves view is GEMM1's gate/up weight in a float dtype: got it "
                         f"{'for an ungated GEMM' if not gated else 'in float8_e4m3fn'}")
    if lora is not None:
        lora = _with_lora_weights(lora, gated=gated)
    _check_gemm_args(a, b, c, topk_weights, sorted_ids, expert_ids, num_post_padded, direct_ids, config,
                     activation, out_n, lora, zero_counters, topk_sum, late_wait)
    if bias is not None:
        expected_bias = (num_experts, b_rows)
        if tuple(bias.shape) != expected_bias or bias.stride(1) != 1 or bias.device != c.device:
            raise ValueError(f"bias must be (E, {b_rows}) = {expected_bias} with contiguous rows on "
                             f"{c.device}, got {tuple(bias.shape)} strides {bias.stride()} on {bias.device}")
    block_scaled = a.dtype == FP8_DTYPE or b.dtype == FP8_DTYPE
    mxfp4 = b.dtype == torch.uint8
    if block_scaled:
        _check_block_scaled(a, b, a_scale, b_scale, scale_block_n, config, lora)
    elif mxfp4:
        _check_mxfp4_gemm(a, b, a_scale, b_scale, config)
    elif a_scale is not None or b_scale is not None:
        raise TypeError(f"a_scale and b_scale belong to float8_e4m3fn a and b (block-scaled FP8), got "
                        f"{a.dtype} and {b.dtype}")
    act = dict(ACTIVATION=ACTIVATION_NONE, ACT_LIMIT=0.0, ACT_ALPHA=1.0, ACT_UP_OFFSET=0.0)
    if activation == "gated_raw":
        act["ACTIVATION"] = ACTIVATION_GATED_RAW
    elif gated:
        act = activation_args(activation)
    activation_code = act["ACTIVATION"]
    max_padded = numel * config.block_m if direct else sorted_ids.shape[0]
    grid_n = cdiv(out_n, config.block_n)
    grid = (cdiv(max_padded, config.block_m) * grid_n,)
    K = a.shape[1]
    epilogue = None
    if lora is not None:
        epilogue = _lora_epilogue(lora, config, gated=gated, activation_code=activation_code, numel=numel,
                                  num_experts=num_experts, K=K, out_n=out_n, a=a, direct=direct,
                                  late_wait=late_wait, programs=grid[0])
    counters = zero_counters if zero_counters is not None else topk_sum
    num_counters = counters.counters.numel() if counters is not None else 0
    rows = sorted_ids if not direct else direct_ids
    # Unused operands point at c with zero strides: the kernel never reads them.
    unused_a_scale, unused_b_scale = (c, 0, 0), (c, 0, 0, 0, 0)
    even_k = K % config.block_k == 0 and planned("even_k", lambda: overrides.switch("even_k", default=True))
    launch(_fused_moe_kernel, grid,
        a=(a, a.stride(0), a.stride(1)),
        b=(b, b.stride(0), b.stride(-2), b.stride(-1),
           b.stride(1) if b.dim() == 4 else out_n * b.stride(1)),
        c=(c, c.stride(0), c.stride(1)),
        a_scale=(a_scale, a_scale.stride(0), a_scale.stride(1)) if block_scaled else unused_a_scale,
        b_scale=(b_scale, *b_scale.stride(), 0) if block_scaled
        else (b_scale, b_scale.stride(0), b_scale.stride(-2), b_scale.stride(-1),
              b_scale.stride(1) if b_scale.dim() == 4 else out_n * b_scale.stride(1)) if mxfp4
        else unused_b_scale,
        bias=(bias, bias.stride(0)) if bias is not None else (c, 0),
        N=out_n,
        K=K,
        num_experts=num_experts,
        scale=float(scale),
        sorted_ids_ptr=rows,
        expert_ids_ptr=expert_ids if not direct else direct_ids,
        num_post_padded_ptr=num_post_padded if not direct else direct_ids,
        topk_weights_ptr=topk_weights if topk_weights is not None else c,
        numel=numel,
        max_padded=max_padded,
        a_row_div=a_row_div,
        **_lora_kernel_args(lora, epilogue, c, gated=gated),
        sum_out=(topk_sum.out, *topk_sum.out.stride()) if topk_sum is not None else (c, 0, 0),
        sum_counters_ptr=counters.counters if counters is not None else c,
        num_counters=num_counters,
        num_tokens=numel // topk_sum.top_k if topk_sum is not None else 0,
        top_k=topk_sum.top_k if topk_sum is not None else 1,
        LORA_PLAN=_lora_meta(lora, epilogue),
        ACT=(act["ACTIVATION"], act["ACT_LIMIT"], act["ACT_ALPHA"], act["ACT_UP_OFFSET"]),
        FP8=(block_scaled, block_scaled and tile_b_scale(config.block_n, scale_block_n, out_n, gated),
             scale_block_n if block_scaled else 1),
        TILE=(config.block_m, config.block_n, config.block_k, config.group_m, even_k),
        TOPK_SUM=(zero_counters is not None, next_power_of_2(max(16, num_counters)), topk_sum is not None,
                  min(16, next_power_of_2(max(1, numel // topk_sum.top_k))) if topk_sum else 16),
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        HAS_BIAS=bias is not None,
        FP32_IEEE=a.dtype == torch.float32,
        DIRECT_PAIRS=direct,
        **({"MXFP4": True} if mxfp4 else {}),
        **({"SWAP_AB": True} if swap_ab(config, block_scaled=block_scaled) else {}),
        **({"LATE_WAIT": True, "launch_pdl": True} if late_wait
           else programmatic_launch(a.device, dependent)),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _lora_epilogue(lora: LoRAOperands, config: GemmConfig, **kwargs: Any) -> LoRAEpilogue:
    """``plan_lora_epilogue``, made once per key in the active ``LaunchCache``, else every call. The key
    holds every size the plan reads: the operands' shapes and dtype, the slot count and rank tile."""
    cache = active_cache()
    if cache is None:
        return plan_lora_epilogue(lora, config, **kwargs)
    a = kwargs["a"]
    shapes = tuple(None if t is None else tuple(t.shape) for t in (lora.shrunk, lora.packed,
                                                                   lora.down_shrunk))
    down_a = None if lora.down_a is None else (lora.down_a.max_rank, lora.down_a.cols)
    key = ("lora_epilogue", config, lora.rank_block, lora.num_adapters, lora.lora_b.max_rank,
           lora.lora_b.cols, shapes, down_a, a.dtype, a.device, *(v for k, v in kwargs.items() if k != "a"))
    return cache.plan(key, lambda: plan_lora_epilogue(lora, config, **kwargs))


def _with_lora_weights(lora: LoRAOperands, *, gated: bool) -> LoRAOperands:
    """``lora`` with dense buffers given as tensors turned into :class:`LoRAWeights` (itself if none is)."""
    if all(t is None or isinstance(t, LoRAWeights) for t in (lora.lora_a, lora.lora_b, lora.down_a)):
        return lora
    return dataclasses.replace(
        lora, lora_a=lora_weights(lora.lora_a, kind="gated_a" if gated else "a"),
        lora_b=lora_weights(lora.lora_b, kind="b"),
        down_a=None if lora.down_a is None else lora_weights(lora.down_a, kind="a"))


# The kernel's LORA_PLAN bundle, in order (``lora_plan_fields(kwargs)`` names a launch's).
LORA_PLAN_FIELDS = ("variant", "rank_block", "chunk_r", "splits", "split_chunk", "group", "ext_k",
                    "down_shrink", "down_prefetch", "ext_stages")


def lora_plan_fields(kernel_kwargs: dict) -> dict[str, Any]:
    """A ``_fused_moe_kernel`` launch's ``LORA_PLAN`` by field name."""
    return dict(zip(LORA_PLAN_FIELDS, kernel_kwargs["LORA_PLAN"], strict=True))


def _lora_meta(lora: LoRAOperands | None, epilogue: LoRAEpilogue | None) -> tuple:
    """The kernel's ``LORA_PLAN`` (``LORA_PLAN_FIELDS``)."""
    if lora is None:
        return (LORA_NONE.value, 16, 16, 1, 1, 1, 16, False, False, 1)
    return (epilogue.variant, lora.rank_block, epilogue.chunk_r, epilogue.splits, epilogue.split_chunk,
            epilogue.group, epilogue.ext_k, epilogue.down_shrink, epilogue.down_prefetch, epilogue.ext_stages)


def _lora_kernel_args(lora: LoRAOperands | None, epilogue: LoRAEpilogue | None, c: torch.Tensor, *,
                      gated: bool) -> dict:
    """The kernel's LoRA arguments: the slot tables and one bundle per operand (unused ones point at ``c``
    with zero strides: the kernel never reads them)."""
    if lora is None:
        unused = (c, c, 0, 0, 0, 0)
        return dict(token_slots_ptr=c, slot_ranks_ptr=c, slot_scalings_ptr=c, slot_row_div=1, lora_a=unused,
                    lora_up_offset=0, lora_b=unused, shrunk=(c, 0, 0), num_shrink_splits=0, down_a=unused,
                    down_shrunk=(c, 0, 0))
    la, lb, shrunk, packed = lora.lora_a, lora.lora_b, lora.shrunk, lora.packed
    da, ds = (lora.down_a, lora.down_shrunk) if epilogue.down_shrink else (None, None)
    partials = packed if packed is not None else shrunk
    return dict(
        token_slots_ptr=lora.token_slots,
        slot_ranks_ptr=lora.slot_ranks,
        slot_scalings_ptr=lora.slot_scalings,
        slot_row_div=lora.top_k,
        lora_a=la.bundle(),  # A (L, E, R or 2R, K)
        lora_up_offset=la.up_offset if gated else 0,
        lora_b=lb.bundle(),  # B (L, E, N or 2N, R)
        # the precomputed shrink: split-K partials (numel, splits, width) or packed (numel, width)
        shrunk=(partials if partials is not None else c, shrunk.stride(1) if shrunk is not None else 0,
                partials.stride(0) if partials is not None else 0),
        num_shrink_splits=shrunk.shape[1] if shrunk is not None else 0,
        # GEMM2's shrink written by GEMM1's epilogue: down_a (L, E, R, N), its partials (numel, tiles, R)
        down_a=da.bundle() if da is not None else (c, c, 0, 0, 0, 0),
        down_shrunk=(ds, ds.stride(1), ds.stride(0)) if ds is not None else (c, 0, 0),
    )


def _check_mxfp4_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor | None,
                      b_scale: torch.Tensor | None, config: GemmConfig) -> None:
    """Raises for MXFP4 weights (``b`` uint8) whose scales, activations or tile do not fit them."""
    if a_scale is not None:
        raise TypeError("MXFP4 weights take bf16/fp16/fp32 activations and no a_scale")
    if a.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"MXFP4 weights take float16, bfloat16 or float32 activations, got {a.dtype}")
    if a.shape[1] % 32:
        raise ValueError(f"MXFP4 weights need K a multiple of 32 (one scale per 32 values), got {a.shape[1]}")
    expected = (*b.shape[:-1], a.shape[1] // 32)
    if (b_scale is None or b_scale.dtype != torch.uint8 or tuple(b_scale.shape) != expected
            or b_scale.device != b.device):
        got = "none" if b_scale is None else f"{b_scale.dtype} {tuple(b_scale.shape)} on {b_scale.device}"
        raise ValueError(f"MXFP4 weights {tuple(b.shape)} need b_scale: uint8 E8M0 scales {expected} on "
                         f"{b.device}, got {got}")
    if config.block_k < 32 or config.block_k % 32:
        raise ValueError(f"MXFP4 GEMMs take BLOCK_K a multiple of 32 (a scale group), got {config.block_k}")


def _check_gemm_args(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor | None,
                     sorted_ids: torch.Tensor | None, expert_ids: torch.Tensor | None,
                     num_post_padded: torch.Tensor | None, direct_ids: torch.Tensor | None,
                     config: GemmConfig, activation: Any, out_n: int, lora: LoRAOperands | None,
                     zero_counters: TopkSumOperands | None, topk_sum: TopkSumOperands | None,
                     late_wait: bool) -> None:
    """Raises ValueError/TypeError saying what was expected for inconsistent GEMM operands."""
    numel = c.shape[0]
    if direct_ids is None and (sorted_ids is None or expert_ids is None or num_post_padded is None):
        raise ValueError("pass the alignment (sorted_ids, expert_ids, num_post_padded) or direct_ids")
    if direct_ids is not None and direct_ids.shape != (numel,):
        raise ValueError(f"direct_ids must be the flat topk_ids ({numel},), got {tuple(direct_ids.shape)}")
    if late_wait:
        if lora is None or (lora.shrunk is None and lora.packed is None):
            raise ValueError("late_wait needs lora.shrunk or lora.packed: the launch before writes the "
                             "shrink partials, which only the epilogue reads")
        require_dependent_launch(a.device, "late_wait")
    for counted in (zero_counters, topk_sum):
        if counted is not None and counted.counters.dtype != torch.int32:
            raise TypeError(f"top-k sum counters must be int32, got {counted.counters.dtype}")
    gated = activation is not None
    if gated and not (isinstance(activation, str) and activation == "gated_raw"):
        activation_args(activation)  # raises for an unknown one
    expected_b_rows = 2 * out_n if gated else out_n
    _, b_rows, b_cols = gate_up_dims(b)
    expected_b_cols = a.shape[1] // 2 if b.dtype == torch.uint8 else a.shape[1]  # MXFP4: two values a byte
    if b_rows != expected_b_rows or b_cols != expected_b_cols:
        raise ValueError(
            f"weights of shape {tuple(b.shape)} do not match activations {tuple(a.shape)} and output "
            f"{tuple(c.shape)}: expected (E, {expected_b_rows}, {expected_b_cols})"
            + (" uint8 (MXFP4, two values a byte)" if b.dtype == torch.uint8 else "")
        )
    if topk_weights is not None and topk_weights.dtype != torch.float32:
        raise TypeError(f"topk_weights must be float32, got {topk_weights.dtype}")
    if topk_sum is not None:
        grid_n = cdiv(out_n, config.block_n)
        if topk_sum.counters.shape != (grid_n,) or topk_sum.out.shape != (numel // topk_sum.top_k, out_n):
            raise ValueError(
                f"topk_sum needs counters ({grid_n},) and out ({numel // topk_sum.top_k}, {out_n}) for this "
                f"GEMM, got {tuple(topk_sum.counters.shape)} and {tuple(topk_sum.out.shape)}")
        if activation is not None:
            raise ValueError("topk_sum sums GEMM2's rows: it takes no activation")
    if lora is not None:
        la, lb, K = lora.lora_a, lora.lora_b, a.shape[1]
        if la.max_rank != lb.max_rank or la.cols != K or lb.cols != b_rows:
            raise ValueError(
                f"LoRA A (rank {la.max_rank}, {la.cols} columns) / B (rank {lb.max_rank}, {lb.cols} outputs) "
                f"do not match the GEMM: expected one rank, A over K={K} and B over {b_rows} outputs"
            )


def _check_block_scaled(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor | None,
                        b_scale: torch.Tensor | None, scale_block_n: int, config: GemmConfig,
                        lora: LoRAOperands | None) -> None:
    """Raises ValueError/TypeError saying what a block-scaled FP8 GEMM expected."""
    if a.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE:
        raise TypeError(f"a block-scaled GEMM takes float8_e4m3fn a and b, got {a.dtype} and {b.dtype}")
    if a_scale is None or b_scale is None or scale_block_n <= 0:
        raise ValueError("FP8 a and b need a_scale, b_scale and scale_block_n")
    group_k, K = config.block_k, a.shape[1]
    if tuple(a_scale.shape) != (a.shape[0], cdiv(K, group_k)):
        raise ValueError(f"a_scale must be (rows, cdiv(K, block_k)) = {(a.shape[0], cdiv(K, group_k))} with "
                         f"config.block_k = the scale group {group_k}, got {tuple(a_scale.shape)}")
    want = (b.shape[0], cdiv(b.shape[1], scale_block_n), cdiv(K, group_k))
    if tuple(b_scale.shape) != want:
        raise ValueError(f"b_scale must be (E, cdiv(N, {scale_block_n}), cdiv(K, {group_k})) = {want}, "
                         f"got {tuple(b_scale.shape)}")
    if a_scale.dtype != torch.float32 or b_scale.dtype != torch.float32:
        raise TypeError(f"FP8 scales must be float32, got {a_scale.dtype} and {b_scale.dtype}")
    if lora is not None and lora.shrunk is None and lora.packed is None:
        raise ValueError("an FP8 GEMM's LoRA needs its shrink precomputed from the unquantized input "
                         "(lora.shrunk or lora.packed): the K-loop's a is the FP8 copy (docs/design.md §1)")


