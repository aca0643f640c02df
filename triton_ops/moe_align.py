"""Sort routed (token, k) pairs by expert and pad every expert's run to the GEMM block size.

Semantics:  for e = 0 .. E-1 in order, ``sorted_ids`` lists the flat pair indices p = t*top_k + j with
            topk_ids[t, j] == e in ascending order, then the sentinel ``numel`` up to the next multiple
            of ``block_size``; experts with no pair take no block. After them the null run: the pairs
            whose id is outside [0, E) (an expert-parallel "not mine" marker, or a router bug), in
            ascending order and padded the same way; its blocks have expert id -1, and a GEMM writes
            zero rows for them (such a pair contributes nothing).
            expert_ids[b] = expert of block b, -1 for a null block and past the end.
            num_post_padded[0] = sum_e roundup(count_e, block_size) + roundup(count_null, block_size).
Grid:       numel <= 128: one program does everything (decode: one launch). Otherwise:
            count   (num_chunks,)   per-chunk expert histogram and each pair's rank inside its chunk
            offsets (1,)            chunk prefix per expert, padded expert starts, block->expert map
            scatter (num_chunks,)   sorted_ids[expert_start[e] + chunk_offset[c, e] + rank] = p, and the
                                    sentinel past num_post_padded (a stripe per program)

Everything is sized from ``numel`` and ``num_experts`` on the host, so nothing syncs with the GPU and
the three launches can be captured in a CUDA graph. No id is used as an index before it is known to be
in [0, E), so any id is safe to pass. The order inside an expert is deterministic
(ascending pair index), so two runs on the same routing produce bit-identical GEMM inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops.hostmath import cdiv, next_power_of_2
from triton_ops.launch import launch, not_replayable

# Pairs handled by one program of the count/scatter kernels; the in-chunk rank uses a
# CHUNK x CHUNK comparison, so this also bounds registers.
_CHUNK = 128
# align_by_adapter's scatter ranks a run's pairs by group 64 at a time: its (CHUNK, CHUNK) comparison
# beside the gathers and scatters fits 4 warps' registers without spilling.
_SCATTER_CHUNK = 64


@triton.jit
def _load_expert_ids(topk_ids_ptr, offs, numel, num_experts):
    """The ids of lanes ``offs``: the expert, ``-2`` (null run) for an id outside [0, E), ``-1`` past numel.
    -2 is distinct from -1, so the in-chunk rank of a null pair counts the null pairs before it."""
    valid = offs < numel
    ids = tl.load(topk_ids_ptr + offs, mask=valid, other=-1)
    in_range = (ids >= 0) & (ids < num_experts)
    return tl.where(valid, tl.where(in_range, ids, -2), -1).to(tl.int32)


@triton.jit(do_not_specialize=["numel"])
def _count_kernel(
    # Pointers
    topk_ids_ptr,  # (numel,) int32/int64, flat routed expert ids
    chunk_counts_ptr,  # (num_chunks, E) int32, out: pairs of each expert in each chunk
    chunk_nulls_ptr,  # (num_chunks,) int32, out: pairs of the null run in each chunk
    pair_rank_ptr,  # (numel,) int32, out: rank of the pair among its chunk's pairs of the same expert
    # Sizes
    numel,
    num_experts,
    # Meta-parameters
    CHUNK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = offs < numel
    ids = _load_expert_ids(topk_ids_ptr, offs, numel, num_experts)

    lane = tl.arange(0, CHUNK)
    same_before = (ids[:, None] == ids[None, :]) & (lane[None, :] < lane[:, None])
    rank = tl.sum(same_before.to(tl.int32), axis=1)
    tl.store(pair_rank_ptr + offs, rank, mask=valid)
    tl.store(chunk_nulls_ptr + chunk, tl.sum((ids == -2).to(tl.int32), axis=0))

    row = chunk_counts_ptr + chunk.to(tl.int64) * num_experts
    for e0 in range(0, num_experts, BLOCK_E):
        experts = e0 + tl.arange(0, BLOCK_E)
        hits = (ids[:, None] == experts[None, :]).to(tl.int32)
        tl.store(row + experts, tl.sum(hits, axis=0), mask=experts < num_experts)


@triton.jit
def _expert_layout(
    totals,  # (BLOCK_E,) int32 pairs per expert
    null_total,  # int32 pairs of the null run
    expert_start_ptr,
    expert_ids_ptr,
    sorted_ids_ptr,
    num_post_padded_ptr,
    numel,
    num_experts,
    max_blocks,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Padded expert starts (the null run's at index E), the sentinel in each run's padding tail, and the
    block -> expert map. Returns the starts (BLOCK_E,) and the padded end of the null run."""
    experts = tl.arange(0, BLOCK_E)
    expert_mask = experts < num_experts
    padded = tl.cdiv(totals, BLOCK_SIZE) * BLOCK_SIZE
    starts = tl.cumsum(padded, axis=0) - padded
    tl.store(expert_start_ptr + experts, starts, mask=expert_mask)
    total_padded = tl.sum(padded, axis=0)
    tl.store(expert_start_ptr + num_experts, total_padded)  # the null run follows the experts' runs
    null_padded = tl.cdiv(null_total, BLOCK_SIZE) * BLOCK_SIZE
    tl.store(num_post_padded_ptr, total_padded + null_padded)

    # Sentinel in the padding tail of every run (fewer than BLOCK_SIZE slots each).
    tail = tl.arange(0, BLOCK_SIZE)
    tail_mask = expert_mask[:, None] & (tail[None, :] < (padded - totals)[:, None])
    tail_ptrs = sorted_ids_ptr + (starts + totals)[:, None] + tail[None, :]
    tl.store(tail_ptrs, tl.zeros((BLOCK_E, BLOCK_SIZE), dtype=tl.int32) + numel, mask=tail_mask)
    null_tail = sorted_ids_ptr + total_padded + null_total + tail
    tl.store(null_tail, tl.zeros((BLOCK_SIZE,), dtype=tl.int32) + numel, mask=tail < null_padded - null_total)

    # Block b belongs to the last expert whose first block is <= b; null blocks and blocks past the end
    # get -1.
    first_block = tl.where(expert_mask & (padded > 0), starts // BLOCK_SIZE, max_blocks + 1)
    num_blocks_used = total_padded // BLOCK_SIZE
    for b0 in range(0, max_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        owner = tl.max(tl.where(first_block[None, :] <= blocks[:, None], experts[None, :], -1), axis=1)
        owner = tl.where(blocks < num_blocks_used, owner, -1)
        tl.store(expert_ids_ptr + blocks, owner, mask=blocks < max_blocks)
    return starts, total_padded + null_padded


@triton.jit(do_not_specialize=["numel", "num_chunks", "max_blocks"])
def _offsets_kernel(
    # Pointers
    chunk_counts_ptr,  # (num_chunks, E) int32, in: counts; out: exclusive prefix over chunks
    chunk_nulls_ptr,  # (num_chunks,) int32, in: null-run counts; out: exclusive prefix over chunks
    expert_start_ptr,  # (E + 1,) int32, out: first sorted position of each expert, then of the null run
    expert_ids_ptr,  # (max_blocks,) int32, out: expert of each block, -1 past the end
    sorted_ids_ptr,  # (max_padded,) int32, out here: only the padding tail of each expert
    num_post_padded_ptr,  # (1,) int32, out
    # Sizes
    numel,
    num_experts,
    num_chunks,
    max_blocks,
    # Meta-parameters
    BLOCK_SIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    expert_mask = experts < num_experts

    # Per expert, turn chunk counts into exclusive prefixes (where each chunk's pairs start).
    totals = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        chunks = c0 + tl.arange(0, BLOCK_C)
        ptrs = chunk_counts_ptr + chunks.to(tl.int64)[:, None] * num_experts + experts[None, :]
        mask = (chunks[:, None] < num_chunks) & expert_mask[None, :]
        counts = tl.load(ptrs, mask=mask, other=0)
        inclusive = tl.cumsum(counts, axis=0)
        tl.store(ptrs, inclusive - counts + totals[None, :], mask=mask)
        totals += tl.sum(counts, axis=0)
    null_total = tl.full([], 0, dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        chunks = c0 + tl.arange(0, BLOCK_C)
        nulls = tl.load(chunk_nulls_ptr + chunks, mask=chunks < num_chunks, other=0)
        tl.store(chunk_nulls_ptr + chunks, tl.cumsum(nulls, axis=0) - nulls + null_total,
                 mask=chunks < num_chunks)
        null_total += tl.sum(nulls, axis=0)

    _expert_layout(
        totals,
        null_total,
        expert_start_ptr,
        expert_ids_ptr,
        sorted_ids_ptr,
        num_post_padded_ptr,
        numel,
        num_experts,
        max_blocks,
        BLOCK_SIZE=BLOCK_SIZE,
        BLOCK_E=BLOCK_E,
        BLOCK_B=BLOCK_B,
    )


@triton.jit(do_not_specialize=["numel", "max_padded", "fill_stripe"])
def _scatter_kernel(
    # Pointers
    topk_ids_ptr,  # (numel,) int32/int64
    pair_rank_ptr,  # (numel,) int32
    chunk_counts_ptr,  # (num_chunks, E) int32, exclusive prefix over chunks
    chunk_nulls_ptr,  # (num_chunks,) int32, exclusive prefix over chunks
    expert_start_ptr,  # (E + 1,) int32
    sorted_ids_ptr,  # (max_padded,) int32, out
    num_post_padded_ptr,  # (1,) int32
    # Sizes
    numel,
    num_experts,
    max_padded,
    fill_stripe,  # positions of sorted_ids each program checks for the past-the-end sentinel
    # Meta-parameters
    CHUNK: tl.constexpr,
):
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = offs < numel
    ids = _load_expert_ids(topk_ids_ptr, offs, numel, num_experts)
    is_null = ids == -2
    run = tl.where(is_null, num_experts, tl.maximum(ids, 0))  # the null run's start is stored at index E
    rank = tl.load(pair_rank_ptr + offs, mask=valid, other=0)
    chunk_offset = tl.load(chunk_counts_ptr + chunk.to(tl.int64) * num_experts + run, mask=valid & ~is_null,
                           other=0)
    chunk_offset += tl.load(chunk_nulls_ptr + chunk + tl.zeros_like(offs), mask=valid & is_null, other=0)
    start = tl.load(expert_start_ptr + run, mask=valid, other=0)
    tl.store(sorted_ids_ptr + start + chunk_offset + rank, offs.to(tl.int32), mask=valid)

    # Past the padded end: the sentinel, each program over its own stripe (disjoint from the pairs'
    # positions, all before the end).
    padded_end = tl.load(num_post_padded_ptr)
    stripe_start = chunk * fill_stripe
    stripe_end = tl.minimum(stripe_start + fill_stripe, max_padded)
    lane = tl.arange(0, CHUNK)
    for p0 in range(stripe_start, stripe_end, CHUNK):
        pos = p0 + lane
        tl.store(sorted_ids_ptr + pos, tl.zeros((CHUNK,), dtype=tl.int32) + numel,
                 mask=(pos >= padded_end) & (pos < stripe_end))


@triton.jit
def align_single_program(
    topk_ids_ptr,
    expert_start_ptr,
    expert_ids_ptr,
    sorted_ids_ptr,
    num_post_padded_ptr,
    numel,
    num_experts,
    max_padded,
    max_blocks,
    CHUNK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """The whole alignment of a decode-sized batch (numel <= CHUNK) by one program: the body of
    ``_align_single_kernel``, also run by program 0 of the LoRA decode shrink (``moe_lora.py``)."""
    offs = tl.arange(0, CHUNK)
    valid = offs < numel
    ids = _load_expert_ids(topk_ids_ptr, offs, numel, num_experts)
    is_null = ids == -2
    same_before = (ids[:, None] == ids[None, :]) & (offs[None, :] < offs[:, None])
    rank = tl.sum(same_before.to(tl.int32), axis=1)
    experts = tl.arange(0, BLOCK_E)
    hits = ids[:, None] == experts[None, :]
    totals = tl.sum(hits.to(tl.int32), axis=0)
    null_total = tl.sum(is_null.to(tl.int32), axis=0)
    starts, padded_end = _expert_layout(
        totals,
        null_total,
        expert_start_ptr,
        expert_ids_ptr,
        sorted_ids_ptr,
        num_post_padded_ptr,
        numel,
        num_experts,
        max_blocks,
        BLOCK_SIZE=BLOCK_SIZE,
        BLOCK_E=BLOCK_E,
        BLOCK_B=BLOCK_B,
    )
    null_start = tl.sum(tl.cdiv(totals, BLOCK_SIZE) * BLOCK_SIZE, axis=0)
    pair_start = tl.where(is_null, null_start, tl.sum(tl.where(hits, starts[None, :], 0), axis=1))
    tl.store(sorted_ids_ptr + pair_start + rank, offs, mask=valid)
    # Past the padded end: sentinel (disjoint from every position written above).
    for p0 in range(0, max_padded, CHUNK):
        pos = p0 + offs
        tl.store(sorted_ids_ptr + pos, tl.zeros((CHUNK,), dtype=tl.int32) + numel,
                 mask=(pos >= padded_end) & (pos < max_padded))


@triton.jit(do_not_specialize=["numel", "max_padded", "max_blocks"])
def _align_single_kernel(
    # Pointers
    topk_ids_ptr,  # (numel,) int32/int64, numel <= CHUNK
    expert_start_ptr,  # (E + 1,) int32, scratch
    expert_ids_ptr,  # (max_blocks,) int32, out
    sorted_ids_ptr,  # (max_padded,) int32, out
    num_post_padded_ptr,  # (1,) int32, out
    # Sizes
    numel,
    num_experts,
    max_padded,
    max_blocks,
    # Meta-parameters
    CHUNK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Decode-sized batches: the whole alignment in one program, one launch."""
    align_single_program(
        topk_ids_ptr, expert_start_ptr, expert_ids_ptr, sorted_ids_ptr, num_post_padded_ptr, numel,
        num_experts, max_padded, max_blocks, CHUNK=CHUNK, BLOCK_SIZE=BLOCK_SIZE, BLOCK_E=BLOCK_E,
        BLOCK_B=BLOCK_B,
    )


def max_padded_size(numel: int, num_experts: int, block_size: int) -> int:
    """Upper bound on ``num_post_padded``: every run that gets a pair (the E experts' and the null run,
    at most min(E + 1, numel) of them) wastes at most block_size - 1 slots. Keeping it tight matters at
    decode: the GEMM grids are sized from it, and every block past the real end is a program that starts
    only to exit."""
    return numel + min(num_experts + 1, numel) * (block_size - 1)


SINGLE_PROGRAM_MAX_PAIRS = _CHUNK


def _check_align_args(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> torch.Tensor:
    """Validates the arguments; returns the flat contiguous ids."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be 2-D (num_tokens, top_k), got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    flat_ids = topk_ids.reshape(-1)
    return flat_ids if flat_ids.is_contiguous() else flat_ids.contiguous()


def single_program_align_args(
    topk_ids: torch.Tensor, block_size: int, num_experts: int, placeholder: torch.Tensor | None = None
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], dict, int]:
    """Outputs and keyword arguments of ``align_single_program`` for a batch of at most
    ``SINGLE_PROGRAM_MAX_PAIRS`` pairs: ((sorted_ids, expert_ids, num_post_padded), kwargs, num_warps).
    ``placeholder`` (int32): a launch that does not align (``ALIGN=False``) passes it for every output and
    workspace pointer instead of allocating them; nothing is written through it."""
    flat_ids = _check_align_args(topk_ids, block_size, num_experts)
    numel = flat_ids.numel()
    if numel > SINGLE_PROGRAM_MAX_PAIRS:
        raise ValueError(f"one program aligns at most {SINGLE_PROGRAM_MAX_PAIRS} pairs, got {numel}")
    device = topk_ids.device
    max_padded = max_padded_size(numel, num_experts, block_size)
    max_blocks = cdiv(max_padded, block_size)
    block_e = next_power_of_2(num_experts)
    if placeholder is not None:
        outputs, expert_start = (placeholder,) * 3, placeholder
    else:
        outputs = (
            torch.empty((max_padded,), dtype=torch.int32, device=device),
            torch.empty((max_blocks,), dtype=torch.int32, device=device),
            torch.empty((1,), dtype=torch.int32, device=device),
        )
        expert_start = torch.empty((num_experts + 1,), dtype=torch.int32, device=device)
    kwargs = dict(
        topk_ids_ptr=flat_ids,
        expert_start_ptr=expert_start,
        sorted_ids_ptr=outputs[0],
        expert_ids_ptr=outputs[1],
        num_post_padded_ptr=outputs[2],
        numel=numel,
        num_experts=num_experts,
        max_padded=max_padded,
        max_blocks=max_blocks,
        CHUNK=max(16, next_power_of_2(numel)),
        BLOCK_SIZE=block_size,
        BLOCK_E=block_e,
        BLOCK_B=max(16, min(256, 8192 // block_e)),
    )
    return outputs, kwargs, 8 if block_e >= 256 else 4


def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int, *, with_starts: bool = False
) -> tuple[torch.Tensor, ...]:
    """Group routed pairs by expert, padded per expert to ``block_size`` (see the module docstring).

    Args:
        topk_ids: (M, top_k) int32 or int64. A pair whose id is outside [0, num_experts) goes to the
            null run (blocks of expert id -1), whatever the id: nothing is indexed by it.
        block_size: the GEMM's BLOCK_SIZE_M, a power of two.
        num_experts: E.

        with_starts: also return expert_start (E + 1,) int32, each expert's first position in sorted_ids
            and then the null run's (``align_by_adapter`` splits those runs).

    Returns:
        sorted_ids (max_padded,) int32, expert_ids (cdiv(max_padded, block_size),) int32 and
        num_post_padded (1,) int32 (and expert_start), all on topk_ids' device;
        max_padded = numel + min(E, numel) * (block_size - 1).
    """
    flat_ids = _check_align_args(topk_ids, block_size, num_experts)
    numel = flat_ids.numel()
    if numel <= SINGLE_PROGRAM_MAX_PAIRS:
        outputs, kwargs, num_warps = single_program_align_args(topk_ids, block_size, num_experts)
        launch(_align_single_kernel, (1,), **kwargs, num_warps=num_warps)
        return (*outputs, kwargs["expert_start_ptr"]) if with_starts else outputs

    device = topk_ids.device
    max_padded = max_padded_size(numel, num_experts, block_size)
    max_blocks = cdiv(max_padded, block_size)
    num_chunks = max(1, cdiv(numel, _CHUNK))

    expert_ids = torch.empty((max_blocks,), dtype=torch.int32, device=device)
    num_post_padded = torch.empty((1,), dtype=torch.int32, device=device)
    expert_start = torch.empty((num_experts + 1,), dtype=torch.int32, device=device)
    block_e = next_power_of_2(num_experts)
    block_b = max(16, min(256, 8192 // block_e))

    sorted_ids = torch.empty((max_padded,), dtype=torch.int32, device=device)
    chunk_counts = torch.empty((num_chunks, num_experts), dtype=torch.int32, device=device)
    chunk_nulls = torch.empty((num_chunks,), dtype=torch.int32, device=device)
    pair_rank = torch.empty((numel,), dtype=torch.int32, device=device)
    launch(_count_kernel, (num_chunks,),
        topk_ids_ptr=flat_ids,
        chunk_counts_ptr=chunk_counts,
        chunk_nulls_ptr=chunk_nulls,
        pair_rank_ptr=pair_rank,
        numel=numel,
        num_experts=num_experts,
        CHUNK=_CHUNK,
        BLOCK_E=min(block_e, 64),
        num_warps=4,
    )
    launch(_offsets_kernel, (1,),
        chunk_counts_ptr=chunk_counts,
        chunk_nulls_ptr=chunk_nulls,
        expert_start_ptr=expert_start,
        expert_ids_ptr=expert_ids,
        sorted_ids_ptr=sorted_ids,
        num_post_padded_ptr=num_post_padded,
        numel=numel,
        num_experts=num_experts,
        num_chunks=num_chunks,
        max_blocks=max_blocks,
        BLOCK_SIZE=block_size,
        BLOCK_E=block_e,
        BLOCK_C=max(1, min(next_power_of_2(num_chunks), max(1, 8192 // block_e))),
        BLOCK_B=block_b,
        num_warps=8 if block_e >= 256 else 4,
    )
    launch(_scatter_kernel, (num_chunks,),
        topk_ids_ptr=flat_ids,
        pair_rank_ptr=pair_rank,
        chunk_counts_ptr=chunk_counts,
        chunk_nulls_ptr=chunk_nulls,
        expert_start_ptr=expert_start,
        sorted_ids_ptr=sorted_ids,
        num_post_padded_ptr=num_post_padded,
        numel=numel,
        num_experts=num_experts,
        max_padded=max_padded,
        fill_stripe=cdiv(max_padded, num_chunks),
        CHUNK=_CHUNK,
        num_warps=4,
    )
    if with_starts:
        return sorted_ids, expert_ids, num_post_padded, expert_start
    return sorted_ids, expert_ids, num_post_padded


def adapter_max_padded(numel: int, num_experts: int, num_slots: int, block_size: int) -> int:
    """``align_by_adapter``'s bound on ``num_post_padded``: every group with a pair (E x (num_slots + 1)
    (expert, slot) groups and the null run) pads at most block_size - 1 slots."""
    return numel + min(num_experts * (num_slots + 1) + 1, numel) * (block_size - 1)


@triton.jit
def _run_bounds(expert_start_ptr, num_post_padded_ptr, run, num_experts):
    """[start, end) of expert ``run``'s padded run in the expert alignment (run E: the null run)."""
    start = tl.load(expert_start_ptr + run)
    is_expert = run < num_experts
    next_start = tl.load(expert_start_ptr + run + 1, mask=is_expert, other=0)
    return start, tl.where(is_expert, next_start, tl.load(num_post_padded_ptr))


@triton.jit
def _group_of_pairs(expert_sorted_ptr, token_slots_ptr, untrained_ptr, pos, run_end, run, numel, top_k,
                    num_experts, num_slots):
    """The pairs at positions ``pos`` of the expert alignment and their group in their expert's run: the
    token's slot, ``num_slots`` for a token without one (or with a slot outside [0, L), or, with
    ``untrained_ptr``, a slot whose block table entry for the run's expert is the zero block), 0 in the
    null run (one group), -1 for a padding sentinel or a position past the run. ``untrained_ptr``: (the
    table (L, E) int32 or any pointer, its slot stride, whether to read it)."""
    pair = tl.load(expert_sorted_ptr + pos, mask=pos < run_end, other=numel)
    is_pair = pair < numel
    slot = tl.load(token_slots_ptr + pair // top_k, mask=is_pair, other=-1)
    # block masks from the scalars: the interpreter takes no scalar & block mask
    is_expert = (tl.zeros_like(slot) + run) < num_experts
    has_slot = (slot >= 0) & (slot < num_slots) & is_expert
    table, stride_table, read_table = untrained_ptr
    entry = tl.where(has_slot, slot, 0).to(tl.int64) * stride_table + tl.where(is_expert, run, 0)
    read = (tl.zeros_like(slot) + read_table) != 0
    unit = tl.load(table + entry, mask=is_pair & has_slot & read, other=1)
    group = tl.where(has_slot & (unit != 0), slot, num_slots)
    group = tl.where(is_expert, group, 0)
    return pair, is_pair, tl.where(is_pair, group, -1)


@triton.jit(do_not_specialize=["numel"])
def _adapter_count_kernel(
    # Pointers
    expert_sorted_ptr,  # (expert max_padded,) int32, the expert alignment's sorted_ids
    expert_start_ptr,  # (E + 1,) int32, each expert's padded run start, then the null run's
    expert_padded_ptr,  # (1,) int32, the expert alignment's num_post_padded
    token_slots_ptr,  # (num_tokens,) int32
    untrained_ptr,  # ((L, E) int32 block table or any pointer, its slot stride, whether to read it)
    group_counts_ptr,  # (E + 1, L + 1) int32, out: pairs of each (expert, slot) group
    # Sizes
    numel,
    top_k,
    num_experts,
    num_slots,
    # Meta-parameters
    CHUNK: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    run = tl.program_id(0)
    start, end = _run_bounds(expert_start_ptr, expert_padded_ptr, run, num_experts)
    groups = tl.arange(0, BLOCK_S)
    counts = tl.zeros((BLOCK_S,), dtype=tl.int32)
    for p0 in range(start, end, CHUNK):
        offs = p0 + tl.arange(0, CHUNK)
        _, _, group = _group_of_pairs(expert_sorted_ptr, token_slots_ptr, untrained_ptr, offs, end, run,
                                      numel, top_k, num_experts, num_slots)
        counts += tl.sum((group[:, None] == groups[None, :]).to(tl.int32), axis=0)
    tl.store(group_counts_ptr + run * (num_slots + 1) + groups, counts, mask=groups <= num_slots)


@triton.jit
def _adapter_offsets_kernel(
    # Pointers
    group_counts_ptr,  # (E + 1, L + 1) int32
    group_start_ptr,  # (E + 1, L + 1) int32, out: first position of each group
    num_post_padded_ptr,  # (1,) int32, out
    # Sizes
    num_groups,
    # Meta-parameters
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    total = tl.full([], 0, dtype=tl.int32)
    for g0 in range(0, num_groups, BLOCK_G):
        groups = g0 + tl.arange(0, BLOCK_G)
        counts = tl.load(group_counts_ptr + groups, mask=groups < num_groups, other=0)
        padded = tl.cdiv(counts, BLOCK_SIZE) * BLOCK_SIZE
        tl.store(group_start_ptr + groups, total + tl.cumsum(padded, axis=0) - padded,
                 mask=groups < num_groups)
        total += tl.sum(padded, axis=0)
    tl.store(num_post_padded_ptr, total)


@triton.jit(do_not_specialize=["numel", "max_padded", "fill_stripe"])
def _adapter_scatter_kernel(
    # Pointers
    expert_sorted_ptr,  # (expert max_padded,) int32
    expert_start_ptr,  # (E + 1,) int32
    expert_padded_ptr,  # (1,) int32
    token_slots_ptr,  # (num_tokens,) int32
    untrained_ptr,  # ((L, E) int32 block table or any pointer, its slot stride, whether to read it)
    group_counts_ptr,  # (E + 1, L + 1) int32
    group_next_ptr,  # (E + 1, L + 1) int32, in: each group's first position; out: one past its last pair
    sorted_ids_ptr,  # (max_padded,) int32, out
    pair_slots_ptr,  # (numel,) int32, out: the slot of each pair's group (-1: no adapter, the null run)
    expert_ids_ptr,  # (cdiv(max_padded, BLOCK_SIZE),) int32, out
    num_post_padded_ptr,  # (1,) int32
    # Sizes
    numel,
    top_k,
    num_experts,
    num_slots,
    max_padded,
    fill_stripe,  # positions past the padded end each program fills (a multiple of BLOCK_SIZE)
    # Meta-parameters
    BLOCK_SIZE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    run = tl.program_id(0)
    start, end = _run_bounds(expert_start_ptr, expert_padded_ptr, run, num_experts)
    table = group_next_ptr + run * (num_slots + 1)
    lane = tl.arange(0, CHUNK)
    # The run's pairs in order, each after the earlier ones of its group (ascending pair order per group):
    # a chunk's pairs go to their group's next positions, and its last pair of each group moves them on.
    for p0 in range(start, end, CHUNK):
        pair, is_pair, group = _group_of_pairs(expert_sorted_ptr, token_slots_ptr, untrained_ptr, p0 + lane,
                                               end, run, numel, top_k, num_experts, num_slots)
        tl.store(pair_slots_ptr + pair, tl.where((run < num_experts) & (group < num_slots), group, -1),
                 mask=is_pair)
        same = group[:, None] == group[None, :]
        rank = tl.sum((same & (lane[None, :] < lane[:, None])).to(tl.int32), axis=1)
        in_chunk = tl.sum(same.to(tl.int32), axis=1)
        # through L2 (.cg): the positions were moved on by this program's own stores
        next_pos = tl.load(table + group, mask=is_pair, other=0, cache_modifier=".cg")
        tl.store(sorted_ids_ptr + next_pos + rank, pair, mask=is_pair)
        tl.debug_barrier()  # every lane has read the positions before one moves them on
        tl.store(table + group, next_pos + in_chunk, mask=is_pair & (rank == in_chunk - 1))
        tl.debug_barrier()  # and the next chunk reads them moved
    # Each group's padding tail, then the run's blocks: its expert (-1 for the null run).
    groups = tl.arange(0, BLOCK_S)
    in_table = groups <= num_slots
    group_end = tl.load(table + groups, mask=in_table, other=0, cache_modifier=".cg")
    count = tl.load(group_counts_ptr + run * (num_slots + 1) + groups, mask=in_table, other=0)
    padded = tl.cdiv(count, BLOCK_SIZE) * BLOCK_SIZE
    tail = tl.arange(0, BLOCK_SIZE)
    tl.store(sorted_ids_ptr + group_end[:, None] + tail[None, :],
             tl.zeros((BLOCK_S, BLOCK_SIZE), dtype=tl.int32) + numel,
             mask=in_table[:, None] & (tail[None, :] < (padded - count)[:, None]))
    first_block = tl.sum(tl.where(groups == 0, group_end - count, 0), axis=0) // BLOCK_SIZE
    end_block = first_block + tl.sum(padded, axis=0) // BLOCK_SIZE
    owner = tl.where(run < num_experts, run, -1)
    for b0 in range(first_block, end_block, CHUNK):
        blocks = b0 + lane
        tl.store(expert_ids_ptr + blocks, tl.zeros((CHUNK,), dtype=tl.int32) + owner, mask=blocks < end_block)
    # Past the padded end: sentinels and -1 blocks, each program over its own stripe.
    padded_end = tl.load(num_post_padded_ptr)
    stripe_start = run * fill_stripe
    stripe_end = tl.minimum(stripe_start + fill_stripe, max_padded)
    for q0 in range(stripe_start, stripe_end, CHUNK):
        pos = q0 + lane
        past = (pos >= padded_end) & (pos < stripe_end)
        tl.store(sorted_ids_ptr + pos, tl.zeros((CHUNK,), dtype=tl.int32) + numel, mask=past)
        tl.store(expert_ids_ptr + pos // BLOCK_SIZE, tl.zeros((CHUNK,), dtype=tl.int32) - 1,
                 mask=past & (pos % BLOCK_SIZE == 0))


def align_by_adapter(
    topk_ids: torch.Tensor,
    token_slots: torch.Tensor,
    block_size: int,
    num_experts: int,
    num_slots: int,
    *,
    expert_alignment: tuple[torch.Tensor, ...] | None = None,
    untrained_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routed pairs grouped by (expert, adapter slot), each group padded to ``block_size``: the LoRA
    launches' alignment when a batch holds many adapters, so that every block has one adapter's rows (its
    A and B tiles read once a block, its dots on its own rows only) where the expert alignment's blocks
    mix dozens.

    Semantics: as ``moe_align_block_size`` with the virtual expert ``e * (num_slots + 1) + s`` of a pair
    in place of its expert ``e`` (``s`` its token's slot, ``num_slots`` for a token without an adapter or
    with a slot outside [0, num_slots)), in the order of those ids, then the null run (ids outside
    [0, E)); ``expert_ids`` holds each block's real expert (-1 for the null run and past the end), so the
    LoRA kernels take it unchanged. Pairs keep their ascending order inside a group (deterministic).

    ``untrained_table``: the LoRA block table (L, E) int32 of a pool's arena (unit 0 the zero block): a
    pair whose (slot, expert) entry is the zero block (an expert its adapter does not train) goes to its
    expert's no-adapter group too, so the LoRA launches that take ``pair_slots`` do no work for it.

    Built on the expert alignment (``expert_alignment``: ``moe_align_block_size(..., with_starts=True)``
    of these ids at any block size, the GEMMs' one; aligned here when None), whose runs already hold each
    expert's pairs in ascending order: each run is split by slot in place of a sort.
    Grid:   count   (E + 1,)  each run's pairs per slot group
            offsets (1,)      padded group starts (a scan over (E + 1) x (L + 1) groups), num_post_padded
            scatter (E + 1,)  each run's pairs to their group's next positions, the padding sentinels, the
                              run's block experts, and past the end a stripe of sentinels and -1 blocks
    Sized on the host, no sync: capturable in a CUDA graph and replayable from a launch trace.
    Returns sorted_ids (max_padded,) int32, expert_ids (cdiv(max_padded, block_size),) int32,
    num_post_padded (1,) int32 (max_padded = ``adapter_max_padded``) and pair_slots (numel,) int32, the
    slot of each pair's group (-1: no adapter, an untrained expert, the null run): the LoRA launches'
    token slots, one a pair (``top_k`` 1).
    """
    flat = _check_align_args(topk_ids, block_size, num_experts)
    if token_slots.dim() != 1 or token_slots.numel() != topk_ids.shape[0]:
        raise ValueError(f"token_slots must be (num_tokens,) for topk_ids {tuple(topk_ids.shape)}, got "
                         f"{tuple(token_slots.shape)}")
    if token_slots.dtype != torch.int32:
        raise TypeError(f"token_slots must be int32, got {token_slots.dtype}")
    if num_slots < 0:
        raise ValueError(f"num_slots must be >= 0, got {num_slots}")
    device = topk_ids.device
    numel, top_k = flat.numel(), topk_ids.shape[1]
    max_padded = adapter_max_padded(numel, num_experts, num_slots, block_size)
    sorted_ids = torch.empty((max_padded,), dtype=torch.int32, device=device)
    expert_ids = torch.empty((cdiv(max_padded, block_size),), dtype=torch.int32, device=device)
    num_post_padded = torch.empty((1,), dtype=torch.int32, device=device)
    pair_slots = torch.empty((numel,), dtype=torch.int32, device=device)
    if numel == 0:
        not_replayable()  # torch fills, which a launch trace would skip
        return sorted_ids, expert_ids, num_post_padded.fill_(0), pair_slots
    if untrained_table is not None and (untrained_table.shape != (num_slots, num_experts)
                                        or untrained_table.dtype != torch.int32
                                        or untrained_table.stride(1) != 1):
        raise ValueError(f"untrained_table must be the ({num_slots}, {num_experts}) int32 block table with "
                         f"unit stride along the experts, got {untrained_table.dtype} "
                         f"{tuple(untrained_table.shape)}")
    if expert_alignment is None:
        expert_alignment = moe_align_block_size(topk_ids, 16, num_experts, with_starts=True)
    if len(expert_alignment) != 4:
        raise ValueError("expert_alignment must be the 4 tensors of moe_align_block_size(..., "
                         "with_starts=True)")
    expert_sorted, _, expert_padded, expert_start = expert_alignment
    if expert_start.shape != (num_experts + 1,):
        raise ValueError(f"expert_alignment must be moe_align_block_size(..., with_starts=True) of these ids "
                         f"(run starts ({num_experts + 1},)), got starts {tuple(expert_start.shape)}")
    runs, groups = num_experts + 1, num_slots + 1
    block_s = max(2, next_power_of_2(groups))
    group_counts = torch.empty((runs, groups), dtype=torch.int32, device=device)
    group_start = torch.empty((runs, groups), dtype=torch.int32, device=device)
    sizes = dict(numel=numel, top_k=top_k, num_experts=num_experts, num_slots=num_slots)
    untrained = ((untrained_table, untrained_table.stride(0), 1) if untrained_table is not None
                 else (token_slots, 0, 0))  # not read
    runs_args = dict(expert_sorted_ptr=expert_sorted, expert_start_ptr=expert_start,
                     expert_padded_ptr=expert_padded, token_slots_ptr=token_slots, untrained_ptr=untrained)
    launch(_adapter_count_kernel, (runs,), **runs_args, group_counts_ptr=group_counts, **sizes,
           CHUNK=_CHUNK, BLOCK_S=block_s, num_warps=4)
    launch(_adapter_offsets_kernel, (1,), group_counts_ptr=group_counts, group_start_ptr=group_start,
           num_post_padded_ptr=num_post_padded, num_groups=runs * groups, BLOCK_SIZE=block_size,
           BLOCK_G=1024, num_warps=4)
    launch(_adapter_scatter_kernel, (runs,), **runs_args, group_counts_ptr=group_counts,
           group_next_ptr=group_start, sorted_ids_ptr=sorted_ids, pair_slots_ptr=pair_slots,
           expert_ids_ptr=expert_ids,
           num_post_padded_ptr=num_post_padded, **sizes, max_padded=max_padded,
           fill_stripe=cdiv(cdiv(max_padded, runs), block_size) * block_size, BLOCK_SIZE=block_size,
           CHUNK=_SCATTER_CHUNK, BLOCK_S=block_s, num_warps=4)
    return sorted_ids, expert_ids, num_post_padded, pair_slots
