"""Tile helpers shared by the MoE LoRA kernels (the all-in-one GEMMs and the staged kernels).

A block of routed pairs always belongs to one expert (``moe_align_block_size``) but its rows may belong
to different adapter slots. The helpers therefore work one slot at a time: rows of other slots are
masked out of the loads (they cost no bytes) and the caller loops over the slots present in the block,
so a block whose rows have no adapter does no LoRA work at all, and rank rows beyond a slot's real
rank are never loaded.

Semantics:  shrink:  r[m, :rank_s] += x[m, :] @ A[s, e, :rank_s, :]^T      for rows m in slot s
            expand:  acc[m, n]     += scaling_s * (r[m, :] @ B[s, e, n, :]^T)  for rows m in slot s
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, acc, FP32_IEEE: tl.constexpr):
    if FP32_IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def lora_block_offset(
    blocks_ptr,  # (L, E) int32 first unit of each (slot, expert)'s rank rows
    slot,  # int or tensor of slots, in [0, L)
    expert,  # int64 or tensor of experts, in [0, E)
    stride_bl,  # the table's slot stride
    stride_u,  # elements per unit
):
    """Element offset of the first rank row of (slot, expert) in its LoRA buffer. The pool's block table
    gives it, so adapters are stored at their own rank and only for the experts they train; a dense
    ``(L, E, R, .)`` buffer is the table ``slot * E + expert`` with the expert stride as its unit."""
    return tl.load(blocks_ptr + slot * stride_bl + expert).to(tl.int64) * stride_u


@triton.jit
def lora_slot_rows(
    op,  # a LoRA operand bundle: (data, blocks (L, E) int32, blocks' slot stride, unit, rank stride,
    #      column stride), ``LoRAWeights.bundle()``
    slot,  # int or tensor of slots, in [0, L)
    expert,  # int64 or tensor of experts, in [0, E)
):
    """Pointer to the first rank row of (slot, expert) in the operand's data (``lora_block_offset``). A
    kernel takes each LoRA operand as this one bundle; ``op[4]`` steps a rank row, ``op[5]`` a column."""
    return op[0] + lora_block_offset(op[1], slot, expert, op[2], op[3])


@triton.jit
def lora_shift_cols(op, cols):
    """The operand bundle ``op`` starting ``cols`` columns later (a gated B's up half: ``cols = N``)."""
    return (op[0] + cols * op[5], op[1], op[2], op[3], op[4], op[5])


@triton.jit
def lora_shrink_tile(
    acc,  # (BLOCK_M, LORA_R) fp32 running result
    acc_up,  # (BLOCK_M, LORA_R) fp32, second projection when GATED (gate and up share the x tile)
    x_ptr,  # (rows, K) activations
    x_row,  # (BLOCK_M,) int64 row of x for each pair of the block
    rows_in_slot,  # (BLOCK_M,) int1
    la_ptr,  # A[s, e] base: (R or 2R, K) rows of this slot and expert
    up_offset,  # element offset of the up projection's A rows (R * stride_r) when GATED
    rank,  # the slot's real rank
    k_start,  # this program's slice of K (split-K shrinks write one partial per slice)
    k_end,
    stride_xm,
    stride_xk,
    stride_lr,
    stride_lk,
    GATED: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LORA_R: tl.constexpr,
):
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, LORA_R)
    rank_valid = offs_r < rank
    x_ptrs = x_ptr + x_row[:, None] * stride_xm + (k_start + offs_k)[None, :] * stride_xk
    a_ptrs = la_ptr + offs_r[None, :] * stride_lr + (k_start + offs_k)[:, None] * stride_lk
    for k0 in range(k_start, k_end, BLOCK_K):
        k_valid = offs_k < k_end - k0
        x = tl.load(x_ptrs, mask=rows_in_slot[:, None] & k_valid[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=k_valid[:, None] & rank_valid[None, :], other=0.0)
        acc = _dot(x, a, acc, FP32_IEEE)
        if GATED:
            a_up = tl.load(a_ptrs + up_offset, mask=k_valid[:, None] & rank_valid[None, :], other=0.0)
            acc_up = _dot(x, a_up, acc_up, FP32_IEEE)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_lk
    return acc, acc_up


@triton.jit
def lora_expand_tile(
    acc,  # (BLOCK_M, BLOCK_N) fp32 output tile to add to
    shrunk,  # (BLOCK_M, LORA_R) fp32 result of the shrink for these rows
    rows_in_slot,  # (BLOCK_M,) int1
    lb_ptr,  # B[s, e] base: (N, R) rows of this slot and expert
    offs_n,  # (BLOCK_N,) output columns
    col_valid,  # (BLOCK_N,) int1
    rank,
    scaling,
    stride_ln,
    stride_lr,
    FP32_IEEE: tl.constexpr,
    LORA_R: tl.constexpr,
):
    b = lora_load_b(lb_ptr, offs_n, col_valid, rank, stride_ln, stride_lr, LORA_R=LORA_R)
    return lora_expand_b(acc, shrunk, rows_in_slot, b, scaling, FP32_IEEE=FP32_IEEE)


@triton.jit
def lora_load_b(
    lb_ptr,  # B[s, e] base: (N, R) rows of this slot and expert
    offs_n,  # (BLOCK_N,) output columns
    col_valid,  # (BLOCK_N,) int1
    rank,  # rank rows at or past it are not loaded (0: nothing is)
    stride_ln,
    stride_lr,
    LORA_R: tl.constexpr,
):
    """(LORA_R, BLOCK_N) tile of B[s, e]^T."""
    offs_r = tl.arange(0, LORA_R)
    b_ptrs = lb_ptr + offs_n.to(tl.int64)[None, :] * stride_ln + offs_r[:, None] * stride_lr
    return tl.load(b_ptrs, mask=(offs_r < rank)[:, None] & col_valid[None, :], other=0.0)


@triton.jit
def lora_expand_b(acc, shrunk, rows_in_slot, b, scaling, FP32_IEEE: tl.constexpr):
    """``acc += scaling * shrunk @ b`` for the rows in the slot. The scaling goes on the (BLOCK_M, R)
    shrink, not on a (BLOCK_M, BLOCK_N) delta, so the dot accumulates straight into acc: no second
    output-sized register tile in the epilogue (that tile cost the base GEMM half its occupancy).
    Rounded to the weights' dtype as PEFT's lora_B input is."""
    r = tl.where(rows_in_slot[:, None], shrunk * scaling, 0.0).to(b.dtype)
    return _dot(r, b, acc, FP32_IEEE)


@triton.jit
def load_shrink_partials(
    shrunk_rows_ptr,  # (BLOCK_M,) pointers to each row's partials: (splits, width) fp32 per row
    col_offset,  # first rank column to read (LORA_R for the up half of a gated shrink)
    num_splits,
    stride_ss,
    rows_in_slot,  # (BLOCK_M,) int1
    SPLITS: tl.constexpr,  # power of two >= num_splits
    CHUNK_R: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,  # power of two <= SPLITS: splits per 3-D load (bounds the registers)
):
    """(BLOCK_M, CHUNK_R) fp32 sum of the split-K partials of these rows: 3-D loads of SPLIT_CHUNK
    splits each (independent, so they share one memory latency); the sum runs in split order
    (deterministic)."""
    offs_r = col_offset + tl.arange(0, CHUNK_R)
    total = tl.zeros((shrunk_rows_ptr.shape[0], CHUNK_R), dtype=tl.float32)
    for s0 in tl.static_range(0, SPLITS, SPLIT_CHUNK):
        offs_s = s0 + tl.arange(0, SPLIT_CHUNK)
        ptrs = shrunk_rows_ptr[:, None, None] + offs_s[None, :, None] * stride_ss + offs_r[None, None, :]
        mask = rows_in_slot[:, None, None] & (offs_s < num_splits)[None, :, None]
        total += tl.sum(tl.load(ptrs, mask=mask, other=0.0), axis=1)
    return total


@triton.jit
def load_raw_partials(
    shrunk_rows_ptr,  # (BLOCK_M,) pointers to each row's partials: (splits, width) fp32 per row
    col_offset,  # first rank column to read
    num_splits,
    stride_ss,
    rows_in_slot,  # (BLOCK_M,) int1
    SPLITS: tl.constexpr,  # power of two >= num_splits: one 3-D load of them all
    CHUNK_R: tl.constexpr,
):
    """``load_shrink_partials``' load of one chunk of SPLITS splits without its sum: a (BLOCK_M, SPLITS,
    CHUNK_R) fp32 tile for a caller that sums it later (``sum_raw_partials``), so nothing waits on this
    load where it is issued."""
    offs_r = col_offset + tl.arange(0, CHUNK_R)
    offs_s = tl.arange(0, SPLITS)
    ptrs = shrunk_rows_ptr[:, None, None] + offs_s[None, :, None] * stride_ss + offs_r[None, None, :]
    return tl.load(ptrs, mask=rows_in_slot[:, None, None] & (offs_s < num_splits)[None, :, None], other=0.0)


@triton.jit
def sum_raw_partials(raw):
    """(BLOCK_M, CHUNK_R) sum of a ``load_raw_partials`` tile, as ``load_shrink_partials`` sums one chunk
    (so the two give the same bits)."""
    total = tl.zeros((raw.shape[0], raw.shape[2]), dtype=tl.float32)
    total += tl.sum(raw, axis=1)
    return total


@triton.jit
def load_scaled_gate_up_partials(
    shrunk_rows_ptr,  # (BLOCK_M,) pointers to each row's partials: (splits, 2*LORA_R or LORA_R) fp32 per row
    num_splits,
    stride_ss,
    rows_in_slot,  # (BLOCK_M,) int1
    row_scaling,  # (BLOCK_M,) fp32 scaling of each row's slot
    GATED: tl.constexpr,  # the up half follows the gate half (GEMM1); else only one shrink
    SPLITS: tl.constexpr,
    LORA_R: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
):
    """Every row's summed shrink times its slot's scaling, (BLOCK_M, LORA_R) fp32: (gate, up), or the
    one shrink twice when not GATED."""
    gate = load_shrink_partials(shrunk_rows_ptr, 0, num_splits, stride_ss, rows_in_slot, SPLITS=SPLITS,
                                CHUNK_R=LORA_R, SPLIT_CHUNK=SPLIT_CHUNK) * row_scaling[:, None]
    up = gate
    if GATED:
        up = load_shrink_partials(shrunk_rows_ptr, LORA_R, num_splits, stride_ss, rows_in_slot, SPLITS=SPLITS,
                                  CHUNK_R=LORA_R, SPLIT_CHUNK=SPLIT_CHUNK) * row_scaling[:, None]
    return gate, up


@triton.jit
def lora_expand_from_partials(
    acc,  # (BLOCK_M, BLOCK_N) fp32 output tile to add to
    shrunk_rows_ptr,  # (BLOCK_M,) pointers to each row's shrink partials (split 0, column 0)
    col_offset,  # 0, or LORA_R for the up half of a gated shrink
    num_splits,
    stride_ss,
    rows_in_slot,  # (BLOCK_M,) int1
    lb_ptr,  # B[s, e] base: (N, R)
    offs_n,
    col_valid,
    rank,
    scaling,
    stride_ln,
    stride_lr,
    FP32_IEEE: tl.constexpr,
    LORA_R: tl.constexpr,
    CHUNK_R: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
):
    """Expand from split-K shrink partials kept in memory, CHUNK_R rank columns at a time: few live
    registers beside the accumulators. Chunks past the slot's real rank are branched around."""
    for r0 in tl.static_range(0, LORA_R, CHUNK_R):
        if r0 < rank:
            shrunk = load_shrink_partials(shrunk_rows_ptr, col_offset + r0, num_splits, stride_ss,
                                          rows_in_slot, SPLITS=SPLITS, CHUNK_R=CHUNK_R,
                                          SPLIT_CHUNK=SPLIT_CHUNK)
            b = lora_load_b(lb_ptr + r0 * stride_lr, offs_n, col_valid, rank - r0, stride_ln, stride_lr,
                            LORA_R=CHUNK_R)
            acc = _dot((shrunk * scaling).to(b.dtype), b, acc, FP32_IEEE)
    return acc


@triton.jit
def first_slot(row_slot, has_slot):
    """Smallest adapter slot among the rows (2**30 when none): with ``next_slot`` the loops below visit
    only the slots present in a block, whatever the pool's size."""
    return tl.min(tl.where(has_slot, row_slot, 1 << 30), axis=0)


@triton.jit
def next_slot(row_slot, has_slot, slot):
    return tl.min(tl.where(has_slot & (row_slot > slot), row_slot, 1 << 30), axis=0)


@triton.jit
def lora_expand_slots(
    acc,  # (BLOCK_M, BLOCK_N) fp32: gate (or only) output tile
    acc_up,  # (BLOCK_M, BLOCK_N) fp32: up output tile when GATED (ignored otherwise)
    shrunk,  # (BLOCK_M, LORA_R) fp32 shrink of each row (its own slot's A)
    shrunk_up,  # (BLOCK_M, LORA_R) fp32 up shrink when GATED
    row_valid,  # (BLOCK_M,) int1
    row_slot,  # (BLOCK_M,) int32, -1 = no adapter
    lora_b,  # (L, E, N or 2N, R) B buffer; the up rows start at row N when GATED
    expert,  # int64 expert of the block
    offs_n,
    col_valid,
    N,
    slot_ranks_ptr,  # (L,) int32
    slot_scalings_ptr,  # (L,) fp32
    GATED: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    LORA_R: tl.constexpr,
):
    """Adds every slot present in the block: ``acc += s_a B[a, e] shrunk`` for the rows of slot a."""
    has_slot = row_valid & (row_slot >= 0)
    slot = first_slot(row_slot, has_slot)
    while slot < (1 << 30):
        in_slot = has_slot & (row_slot == slot)
        rank = tl.load(slot_ranks_ptr + slot)
        scaling = tl.load(slot_scalings_ptr + slot)
        lb_ptr = lora_slot_rows(lora_b, slot, expert)
        acc = lora_expand_tile(
            acc, shrunk, in_slot, lb_ptr, offs_n, col_valid, rank, scaling, lora_b[5], lora_b[4],
            FP32_IEEE=FP32_IEEE, LORA_R=LORA_R,
        )
        if GATED:
            acc_up = lora_expand_tile(
                acc_up, shrunk_up, in_slot, lb_ptr + N * lora_b[5], offs_n, col_valid, rank, scaling,
                lora_b[5], lora_b[4], FP32_IEEE=FP32_IEEE, LORA_R=LORA_R,
            )
        slot = next_slot(row_slot, has_slot, slot)
    return acc, acc_up


@triton.jit
def lora_store_down_partials(
    h,  # (BLOCK_M, BLOCK_N) the activated GEMM1 tile, in the dtype GEMM2 reads it in
    row_slot,  # (BLOCK_M,) int32, -1 = no adapter
    has_slot,  # (BLOCK_M,) int1: valid row with an adapter
    pair,  # (BLOCK_M,) int32 routed pair of each row
    expert,  # int64 expert of the block
    offs_n,  # (BLOCK_N,) columns of h: the down projection's K
    col_valid,  # (BLOCK_N,) int1
    tile,  # this tile's index along N: which partial it writes
    down_a,  # (L, E, R, N) LoRA A of the down projection
    out_ptr,  # (numel, tiles, LORA_R) fp32 partials, out
    slot_ranks_ptr,  # (L,) int32
    first_a,  # (BLOCK_N, LORA_R) the first slot's A tile, loaded earlier (used when FIRST_PREFETCHED)
    stride_ds,
    stride_dm,
    FP32_IEEE: tl.constexpr,
    LORA_R: tl.constexpr,
    CHUNK_R: tl.constexpr,
    FIRST_PREFETCHED: tl.constexpr,  # first_a holds the block's first slot's tile (needs CHUNK_R == LORA_R)
):
    """GEMM2's shrink from GEMM1's epilogue: ``out[p, tile, :] = A_down[a_p, e][:, cols] @ h[p, cols]``
    for the tile's columns, so GEMM2 sums ``tiles`` partials instead of a separate launch re-reading h.
    Every rank column of a row with an adapter is written (zeros past the slot's rank, where A is not
    read), so the consumers never see uninitialised partials."""
    out_rows = out_ptr + pair.to(tl.int64) * stride_dm + tile * stride_ds
    slot = first_slot(row_slot, has_slot)
    if FIRST_PREFETCHED:
        if slot < (1 << 30):
            part = _dot(h, first_a, tl.zeros((h.shape[0], LORA_R), dtype=tl.float32), FP32_IEEE)
            offs_r = tl.arange(0, LORA_R)
            in_slot = has_slot & (row_slot == slot)
            tl.store(out_rows[:, None] + offs_r[None, :], part, mask=in_slot[:, None])
            slot = next_slot(row_slot, has_slot, slot)
    while slot < (1 << 30):
        in_slot = has_slot & (row_slot == slot)
        rank = tl.load(slot_ranks_ptr + slot)
        da_ptr = lora_slot_rows(down_a, slot, expert)
        for r0 in tl.static_range(0, LORA_R, CHUNK_R):
            offs_r = r0 + tl.arange(0, CHUNK_R)
            part = tl.zeros((h.shape[0], CHUNK_R), dtype=tl.float32)
            if r0 < rank:
                a_ptrs = da_ptr + offs_r[None, :] * down_a[4] + offs_n.to(tl.int64)[:, None] * down_a[5]
                a = tl.load(a_ptrs, mask=col_valid[:, None] & (offs_r < rank)[None, :], other=0.0)
                part = _dot(h, a, part, FP32_IEEE)
            tl.store(out_rows[:, None] + offs_r[None, :], part, mask=in_slot[:, None])
        slot = next_slot(row_slot, has_slot, slot)


@triton.jit
def slot_group(
    row_slot,  # (BLOCK_M,) int32, -1 = no adapter
    has_slot,  # (BLOCK_M,) int1
    slot,  # first slot of the group (present in the block)
    GROUP: tl.constexpr,  # slots per group
    LORA_R: tl.constexpr,
):
    """Up to GROUP slots present in the block, from ``slot`` on, side by side: column c of a
    (., GROUP * LORA_R) tile belongs to slot ``col_slot[c]`` (2**30: none) and rank column c % LORA_R;
    ``row_group[m]`` is the group column block of row m (-1: not in this group). Returns
    (col_slot, row_group, the first slot after the group or 2**30)."""
    cols = tl.arange(0, GROUP * LORA_R)
    col_slot = tl.full((GROUP * LORA_R,), 1 << 30, tl.int32)
    row_group = tl.full(row_slot.shape, -1, tl.int32)
    for j in tl.static_range(GROUP):
        col_slot = tl.where(cols // LORA_R == j, slot, col_slot)
        row_group = tl.where(has_slot & (row_slot == slot), j, row_group)
        slot = next_slot(row_slot, has_slot, slot)
    return col_slot, row_group, slot


@triton.jit
def select_group_columns(
    tile,  # (BLOCK_M, GROUP * LORA_R) fp32: every row against every slot of the group
    row_group,  # (BLOCK_M,) int32 column block of each row's own slot
    GROUP: tl.constexpr,
    LORA_R: tl.constexpr,
):
    """(BLOCK_M, LORA_R): each row's own slot's columns (rows outside the group: anything)."""
    if GROUP == 1:
        return tile
    blocks = tl.reshape(tile, (tile.shape[0], GROUP, LORA_R))
    own = tl.arange(0, GROUP)[None, :, None] == row_group[:, None, None]
    return tl.sum(tl.where(own, blocks, 0.0), axis=1)


@triton.jit
def load_group_ranks(col_slot, slot_ranks_ptr):
    """(GROUP * LORA_R,) int32: the real rank of each stacked column's slot (0: absent), from ``slot_group``'s
    ``col_slot``."""
    present = col_slot < (1 << 30)
    return tl.load(slot_ranks_ptr + tl.where(present, col_slot, 0), mask=present, other=0)


@triton.jit
def mask_group_ranks(tile, col_rank, LORA_R: tl.constexpr):
    """``load_group_b``'s tile loaded with ``RANK_MASK_LATER``, with its rank rows past each slot's real rank
    zeroed as ``load_group_b`` leaves them."""
    rank_col = tl.arange(0, tile.shape[0]) % LORA_R
    return tl.where((rank_col < col_rank)[:, None], tile, 0.0)


@triton.jit
def load_group_b(
    lora_b,  # (L, E, N or 2N, R) B buffer (already offset to the up rows for the up half)
    col_slot,  # (GROUP * LORA_R,) int32 from ``slot_group``
    expert,  # int64
    offs_n,  # (BLOCK_N,) output columns
    col_valid,  # (BLOCK_N,) int1
    slot_ranks_ptr,  # (L,) int32
    LORA_R: tl.constexpr,
    GROUP: tl.constexpr,
    RANK_MASK_LATER: tl.constexpr = False,
):
    """(GROUP * LORA_R, BLOCK_N): the B^T tiles of the group's slots stacked, rank rows past each slot's
    real rank (and absent slots) not loaded. With RANK_MASK_LATER the load waits on nothing but the slots:
    rank rows are loaded too (a rank tile's B is under 1 % of the weight tile the K-loop reads) and
    ``mask_group_ranks`` zeroes them."""
    rank_col = tl.arange(0, GROUP * LORA_R) % LORA_R
    present = col_slot < (1 << 30)
    safe = tl.where(present, col_slot, 0)
    if RANK_MASK_LATER:
        valid = present
    else:
        valid = present & (rank_col < tl.load(slot_ranks_ptr + safe, mask=present, other=0))
    rows = lora_slot_rows(lora_b, safe, expert) + rank_col * lora_b[4]
    ptrs = rows[:, None] + offs_n.to(tl.int64)[None, :] * lora_b[5]
    return tl.load(ptrs, mask=valid[:, None] & col_valid[None, :], other=0.0)


@triton.jit
def spread_to_group(
    u,  # (BLOCK_M, LORA_R) fp32 each row's scaled shrink
    row_group,  # (BLOCK_M,) int32 from ``slot_group`` (-1: not in the group)
    GROUP: tl.constexpr,
    LORA_R: tl.constexpr,
):
    """(BLOCK_M, GROUP * LORA_R): row m's u in its own slot's column block, zeros elsewhere, so one dot
    with ``load_group_b``'s stacked tile expands every row of the group with its own adapter."""
    if GROUP == 1:
        return tl.where((row_group == 0)[:, None], u, 0.0)
    own = tl.arange(0, GROUP)[None, :, None] == row_group[:, None, None]
    return tl.reshape(tl.where(own, u[:, None, :], 0.0), (u.shape[0], GROUP * LORA_R))


@triton.jit
def lora_expand_groups(
    acc,  # (BLOCK_M, BLOCK_N) fp32 gate (or only) output tile
    acc_up,  # (BLOCK_M, BLOCK_N) fp32 up tile when GATED
    u,  # (BLOCK_M, LORA_R) fp32 shrink of each row, times its slot's scaling
    u_up,  # (BLOCK_M, LORA_R) up shrink when GATED
    row_slot,  # (BLOCK_M,) int32
    has_slot,  # (BLOCK_M,) int1
    slot,  # first slot to expand (2**30: none)
    lora_b,  # (L, E, N or 2N, R)
    expert,
    offs_n,
    col_valid,
    N,
    slot_ranks_ptr,
    GATED: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    LORA_R: tl.constexpr,
    GROUP: tl.constexpr,
):
    """``acc += u @ B[a_m, e]^T`` for every row from ``slot`` on, GROUP slots per dot (one B load and
    one dot for a block of up to GROUP adapters instead of one dependent round per adapter).
    u is rounded to B's dtype, as PEFT's lora_B input is."""
    while slot < (1 << 30):
        col_slot, row_group, slot = slot_group(row_slot, has_slot, slot, GROUP=GROUP, LORA_R=LORA_R)
        b = load_group_b(lora_b, col_slot, expert, offs_n, col_valid, slot_ranks_ptr, LORA_R=LORA_R,
                         GROUP=GROUP)
        acc = _dot(spread_to_group(u, row_group, GROUP=GROUP, LORA_R=LORA_R).to(b.dtype), b, acc, FP32_IEEE)
        if GATED:
            b_up = load_group_b(lora_shift_cols(lora_b, N), col_slot, expert, offs_n, col_valid,
                                slot_ranks_ptr,
                                LORA_R=LORA_R, GROUP=GROUP)
            acc_up = _dot(spread_to_group(u_up, row_group, GROUP=GROUP, LORA_R=LORA_R).to(b_up.dtype), b_up,
                          acc_up, FP32_IEEE)
    return acc, acc_up


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _slot_presence_word(row_slot, has_slot, WORD: tl.constexpr):
    """int64 bits of the slots 63 * WORD .. 63 * WORD + 62 that the block's rows use (the last word, 3, also
    stands for every slot past 251: they share its top bit)."""
    first = WORD * 63
    in_word = has_slot & (row_slot >= first)
    if WORD < 3:
        in_word = in_word & (row_slot < first + 63)
    bit = tl.minimum(row_slot - first, 62).to(tl.int64)
    return tl.reduce(tl.where(in_word, tl.full(row_slot.shape, 1, tl.int64) << tl.maximum(bit, 0), 0), 0,
                     _bit_or)


@triton.jit
def _slot_is_used(col_slot, used0, used1, used2, used3):
    """Whether each of ``col_slot``'s slots is in the block's presence words (``_slot_presence_word``)."""
    word = tl.minimum(col_slot // 63, 3)
    bits = tl.where(word == 0, used0, tl.where(word == 1, used1, tl.where(word == 2, used2, used3)))
    bit = tl.minimum(col_slot - word * 63, 62).to(tl.int64)
    return ((bits >> bit) & 1) != 0


@triton.jit
def lora_expand_slot_range(
    acc,  # (BLOCK_M, BLOCK_N) fp32 output tile (one of gate / up, or GEMM2's)
    packed_rows_ptr,  # (BLOCK_M,) pointers to each row's packed shrink (pack_shrink_partials), column 0
    col_offset,  # 0, or LORA_R for the up half of a gated shrink
    row_slot,  # (BLOCK_M,) int32
    has_slot,  # (BLOCK_M,) int1
    slot_lo,  # the block's smallest slot
    slot_hi,  # its largest slot + 1 (slot_lo == slot_hi: no row has one, nothing runs)
    lora_b,  # (L, E, N, R) B buffer (already offset to the up rows for the up half)
    expert,  # int64
    offs_n,  # (BLOCK_N,) output columns
    col_valid,  # (BLOCK_N,) int1
    slot_ranks_ptr,  # (L,) int32
    FP32_IEEE: tl.constexpr,
    LORA_R: tl.constexpr,
    EXT_K: tl.constexpr,  # stacked columns per dot: a multiple of LORA_R
    EXT_STAGES: tl.constexpr,  # software-pipeline stages of the loop over the slots
):
    """``acc += u @ B[a_m, e]^T`` for every row, as a K-loop over the slots slot_lo .. slot_hi - 1 set
    side by side: stacked column c is rank c % LORA_R of slot c // LORA_R, so row m's operand is its packed
    shrink u[m] in its own slot's columns and 0 in the others', and the B tile stacks those slots' B^T.
    Both operands come straight from memory (u already scaled and rounded): no per-slot discovery, no
    fp32 partials, no layout round trip per slot, EXT_K // LORA_R slots a dot. Columns past a slot's real
    rank, and slots no row of the block has, load nothing."""
    offs_c = tl.arange(0, EXT_K)
    # The slots the block's rows use, one bit each in four words (slots 0-251; past them they share the
    # last bit): a slot inside the range that no row uses (another sequence's adapter) has its B tile
    # masked off, so the bytes follow the slots present, not the range.
    used0 = _slot_presence_word(row_slot, has_slot, 0)
    used1 = _slot_presence_word(row_slot, has_slot, 1)
    used2 = _slot_presence_word(row_slot, has_slot, 2)
    used3 = _slot_presence_word(row_slot, has_slot, 3)
    for c0 in tl.range(slot_lo * LORA_R, slot_hi * LORA_R, EXT_K, num_stages=EXT_STAGES):
        cols = c0 + offs_c
        col_slot = cols // LORA_R
        col_r = cols % LORA_R
        in_range = col_slot < slot_hi
        col_rank = tl.load(slot_ranks_ptr + col_slot, mask=in_range, other=0)
        col_used = _slot_is_used(col_slot, used0, used1, used2, used3)
        col_live = in_range & col_used & (col_r < col_rank)
        rows_of_col = has_slot[:, None] & (row_slot[:, None] == col_slot[None, :]) & col_live[None, :]
        u = tl.load(packed_rows_ptr[:, None] + (col_offset + col_r)[None, :], mask=rows_of_col, other=0.0)
        col_safe = tl.where(in_range, col_slot, 0)
        b_ptrs = (lora_slot_rows(lora_b, col_safe, expert)[:, None]
                  + offs_n.to(tl.int64)[None, :] * lora_b[5] + col_r[:, None] * lora_b[4])
        b = tl.load(b_ptrs, mask=col_live[:, None] & col_valid[None, :], other=0.0)
        acc = _dot(u.to(b.dtype), b, acc, FP32_IEEE)
    return acc
