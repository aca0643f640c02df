"""Sum a LoRA shrink's split-K partials once, before the GEMM epilogues read them.

Semantics:  for every pair p whose token has an adapter (a = token_slots[p // slot_row_div] >= 0):
            reduce (in place):  partials[p, 0, :] = sum_{s < splits} partials[p, s, :]   (fp32, split order)
            pack:               packed[p, :] = dtype(scaling[a] * sum_{s < splits} partials[p, s, :])
            reduce leaves rows of tokens without an adapter alone (their partials were never written);
            pack writes 0 there.
Grid:       (cdiv(numel, BLOCK_ROWS),) for either.

Why: ``moe_lora_a`` splits K so that a few alignment blocks still fill the GPU, and leaves one fp32
partial per split. Every GEMM program of the block's N tiles then sums them again: Mixtral-8x7B at
M=256 has 224 GEMM1 N tiles per block reading 8 partials each (rank 64: 256 KiB a 128-row tile). One
pass here turns that into a single partial (the consumers get ``partials[:, :1]``). ``pack`` goes one
step further for the epilogues that expand a block's slots in a K-loop of their own (``lora_ext_expand``):
the shrink each row's expand multiplies, already scaled and rounded to the weights' dtype as the
epilogue would round it, so the GEMM loads it as a dot operand straight from memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops import overrides
from triton_ops.hostmath import cdiv
from triton_ops.launch import launch
from triton_ops.pdl import release_next_then_wait, require_dependent_launch


@triton.jit
def _sum_row_splits(partials_ptr, token_slots_ptr, numel, slot_row_div, stride_pm, stride_ps,
                    SPLITS: tl.constexpr, WIDTH: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """This program's rows, their slots, whether each has one, the pointers to their split 0 and the
    (BLOCK_ROWS, WIDTH) fp32 sum of their splits in split order (0 for rows without a slot: their partials
    were never written)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_valid = rows < numel
    slot = tl.load(token_slots_ptr + rows // slot_row_div, mask=row_valid, other=-1)
    has_slot = row_valid & (slot >= 0)
    ptrs = partials_ptr + rows.to(tl.int64)[:, None] * stride_pm + tl.arange(0, WIDTH)[None, :]
    total = tl.load(ptrs, mask=has_slot[:, None], other=0.0)
    for split in tl.static_range(1, SPLITS):
        total += tl.load(ptrs + split * stride_ps, mask=has_slot[:, None], other=0.0)
    return rows, slot, has_slot, ptrs, total


@triton.jit(do_not_specialize=["numel"])
def _reduce_shrink_splits_kernel(
    # Pointers
    partials_ptr,  # (numel, splits, WIDTH) fp32, in place: split 0 receives the sum
    token_slots_ptr,  # (numel // slot_row_div,) int32, -1 = no adapter
    # Sizes
    numel,
    slot_row_div,
    # Strides
    stride_pm,
    stride_ps,
    # Meta-parameters
    SPLITS: tl.constexpr,
    WIDTH: tl.constexpr,  # LORA_R or 2 * LORA_R (a power of two)
    BLOCK_ROWS: tl.constexpr,
    RELEASE_FIRST: tl.constexpr = False,
):
    # Launched dependently on the shrink: the GEMM after this launch is scheduled at once, this waits
    # for the shrink's partials.
    release_next_then_wait(RELEASE_FIRST)
    rows, slot, has_slot, ptrs, total = _sum_row_splits(
        partials_ptr, token_slots_ptr, numel, slot_row_div, stride_pm, stride_ps, SPLITS=SPLITS, WIDTH=WIDTH,
        BLOCK_ROWS=BLOCK_ROWS)
    tl.store(ptrs, total, mask=has_slot[:, None])


@triton.jit(do_not_specialize=["numel"])
def _pack_shrink_partials_kernel(
    # Pointers
    partials_ptr,  # (numel, splits, WIDTH) fp32 split-K shrink partials
    packed_ptr,  # (numel, WIDTH) fp16/bf16/fp32, out: summed, times the row's slot scaling
    token_slots_ptr,  # (numel // slot_row_div,) int32, -1 = no adapter
    slot_scalings_ptr,  # (L,) fp32
    # Sizes
    numel,
    slot_row_div,
    # Strides
    stride_pm,
    stride_ps,
    stride_km,
    # Meta-parameters
    SPLITS: tl.constexpr,
    WIDTH: tl.constexpr,  # LORA_R or 2 * LORA_R (a power of two)
    BLOCK_ROWS: tl.constexpr,
    RELEASE_FIRST: tl.constexpr = False,
):
    release_next_then_wait(RELEASE_FIRST)
    rows, slot, has_slot, _, total = _sum_row_splits(
        partials_ptr, token_slots_ptr, numel, slot_row_div, stride_pm, stride_ps, SPLITS=SPLITS, WIDTH=WIDTH,
        BLOCK_ROWS=BLOCK_ROWS)
    scaling = tl.load(slot_scalings_ptr + tl.where(has_slot, slot, 0), mask=has_slot, other=0.0)
    packed = tl.where(has_slot[:, None], total * scaling[:, None], 0.0).to(packed_ptr.dtype.element_ty)
    tl.store(packed_ptr + rows.to(tl.int64)[:, None] * stride_km + tl.arange(0, WIDTH)[None, :], packed,
             mask=(rows < numel)[:, None])


def _check_partials(partials: torch.Tensor, token_slots: torch.Tensor, slot_row_div: int) -> None:
    if partials.dim() != 3 or partials.dtype != torch.float32:
        raise ValueError(f"partials must be fp32 (numel, splits, width), got {partials.dtype} "
                         f"{tuple(partials.shape)}")
    numel, _, width = partials.shape
    if partials.stride(2) != 1 or width & (width - 1):
        raise ValueError(f"partials' width must be a contiguous power of two, got {tuple(partials.shape)} "
                         f"with strides {partials.stride()}")
    if token_slots.dtype != torch.int32 or token_slots.numel() * slot_row_div < numel:
        raise ValueError(f"token_slots must be int32 with one slot per {slot_row_div} rows of the {numel} "
                         f"partials, got {token_slots.dtype} {tuple(token_slots.shape)}")


def reduce_shrink_splits(
    partials: torch.Tensor, token_slots: torch.Tensor, *, slot_row_div: int, release_next: bool = False
) -> torch.Tensor:
    """Sums ``partials`` (numel, splits, width) fp32 over its splits into split 0, in place, for the rows
    whose token (``p // slot_row_div``) has an adapter; returns the (numel, 1, width) view the GEMM
    epilogue then reads. No host sync: the grid depends only on the shape.

    ``release_next`` (sm_90+; the launch before is the shrink, launched with ``release_next`` itself):
    this launch is dependent on the shrink and lets the next one be scheduled before it waits for the
    shrink, so a GEMM launched with ``late_wait`` runs its K-loop beside both (``prefill_shrink_overlap``).
    """
    _check_partials(partials, token_slots, slot_row_div)
    numel, splits, _ = partials.shape
    if release_next:
        require_dependent_launch(partials.device, "release_next")
    if numel == 0 or splits == 1:
        return partials[:, :1]
    grid, meta = _row_launch(partials, release_next)
    launch(_reduce_shrink_splits_kernel, grid,
        partials_ptr=partials,
        token_slots_ptr=token_slots,
        numel=numel,
        slot_row_div=slot_row_div,
        stride_pm=partials.stride(0),
        stride_ps=partials.stride(1),
        **meta,
    )
    return partials[:, :1]


def pack_shrink_partials(
    partials: torch.Tensor,
    token_slots: torch.Tensor,
    slot_scalings: torch.Tensor,
    *,
    slot_row_div: int,
    dtype: torch.dtype,
    release_next: bool = False,
) -> torch.Tensor:
    """Returns (numel, width) ``dtype``: each row's shrink summed over the splits of ``partials`` (numel,
    splits, width) fp32 and multiplied by its token's slot scaling, 0 for rows of tokens without an
    adapter; the operand ``lora_ext_expand``'s epilogue loop reads. No host sync. ``release_next`` as for
    ``reduce_shrink_splits``: this launch then takes the split sum's place in the shrink overlap."""
    _check_partials(partials, token_slots, slot_row_div)
    if slot_scalings.dtype != torch.float32 or slot_scalings.dim() != 1:
        raise ValueError(f"slot_scalings must be fp32 (L,), got {slot_scalings.dtype} "
                         f"{tuple(slot_scalings.shape)}")
    if release_next:
        require_dependent_launch(partials.device, "release_next")
    numel, _, width = partials.shape
    packed = torch.empty((numel, width), dtype=dtype, device=partials.device)
    if numel == 0:
        return packed
    grid, meta = _row_launch(partials, release_next)
    launch(_pack_shrink_partials_kernel, grid,
        partials_ptr=partials,
        packed_ptr=packed,
        token_slots_ptr=token_slots,
        slot_scalings_ptr=slot_scalings,
        numel=numel,
        slot_row_div=slot_row_div,
        stride_pm=partials.stride(0),
        stride_ps=partials.stride(1),
        stride_km=packed.stride(0),
        **meta,
    )
    return packed


def _row_launch(partials: torch.Tensor, release_next: bool) -> tuple[tuple[int], dict]:
    """Grid and meta-parameters of a launch over the rows of ``partials`` (numel, splits, width)."""
    numel, splits, width = partials.shape
    block_rows = reduce_block_rows(numel, width)
    meta = dict(SPLITS=splits, WIDTH=width, BLOCK_ROWS=block_rows,
                num_warps=max(1, min(4, block_rows * width // 256)))
    if release_next:
        meta |= {"RELEASE_FIRST": True, "launch_pdl": True}
    return (cdiv(numel, block_rows),), meta


# About two programs per SM: the kernel is a few dependent loads long, so its time is how many bytes
# each program has in flight, and few big programs (Mixtral-8x7B M=256 has 16 of 64 rows) leave the GPU
# mostly idle (docs/performance.md, 'Levers': split-K partials summed once).
REDUCE_TARGET_PROGRAMS = 256


def reduce_block_rows(numel: int, width: int) -> int:
    """Rows per program: the most (a power of two, at most 4096 fp32 values a program) that still
    leave about REDUCE_TARGET_PROGRAMS programs."""
    rows = 1
    while rows * 2 * width <= 4096 and cdiv(numel, rows * 2) >= REDUCE_TARGET_PROGRAMS:
        rows *= 2
    return rows


# Partial re-reads (consumer N tiles x extra splits) from which one reduction launch pays for itself.
MIN_REREADS_TO_REDUCE = 24


def reduce_splits_pays(splits: int, consumer_n_tiles: int) -> bool:
    """Whether to sum the partials once (one more launch, a few us in a CUDA graph) rather than in every
    consumer program: each of the ``consumer_n_tiles`` GEMM programs of a block re-reads ``splits``
    partials of its rows. ``lora_reduce_splits=1`` / ``=0`` forces either (to compare).

    It pays where many N tiles re-read several partials (Mixtral-8x7B's 224 GEMM1 tiles); where few
    tiles re-read few partials it is a wash either way, hence the threshold (docs/performance.md,
    'Levers': split-K partials summed once)."""
    forced = overrides.value("lora_reduce_splits")
    if splits <= 1:
        return False
    if forced:
        return forced == "1"
    return consumer_n_tiles * (splits - 1) >= MIN_REREADS_TO_REDUCE
