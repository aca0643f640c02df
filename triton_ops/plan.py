"""The launch decisions: which kernel variant, tile, split and overlap a fused MoE call runs, as pure
functions of host-known sizes (token and pair counts, rank tile, adapter count, config, device).

Every rule here picks the variant measured to win (docs/performance.md, 'Levers', names each one) and
reads its launch override (``triton_ops.overrides``) so the other variant can be compared on a GPU.
The GEMM wrapper (``fused_moe``) and the orchestration (``fused_experts``) read their decisions here;
``launch`` records and replays the launches they make, and the layer's CUDA graphs sit on top.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from triton_ops import overrides
from triton_ops.configs import GemmConfig, blocks_per_sm_by_shared, pipeline_smem_bytes
from triton_ops.gemm_tiles import ACTIVATION_GATED_RAW, ACTIVATION_NONE
from triton_ops.hostmath import cdiv, next_power_of_2
from triton_ops.launch import planned
from triton_ops.lora_epilogues import (
    LORA_CHUNKED,
    LORA_DEFERRED,
    LORA_FUSED,
    LORA_GROUPS,
    LORA_ONE_ROW,
    LORA_PREFETCHED,
    LORA_SLOT_RANGE,
)
from triton_ops.moe_align import SINGLE_PROGRAM_MAX_PAIRS

if TYPE_CHECKING:
    from triton_ops.fused_moe import LoRAOperands


def lora_rank_block(max_rank: int) -> int:
    """Rank tile width: tl.dot needs >= 16, powers of two."""
    return max(16, next_power_of_2(max(1, max_rank)))


def gemm_blocks_per_sm(config: GemmConfig, *, gated: bool, lora_cols: int = 0, elem_bytes: int = 2) -> int:
    """Blocks of this GEMM an SM holds as far as its pipeline's shared memory goes (gate and up B tiles
    when ``gated``; ``lora_cols`` columns of LoRA A per stage with an inline shrink)."""
    return blocks_per_sm_by_shared(pipeline_smem_bytes(config, b_tiles=2 if gated else 1, lora_cols=lora_cols,
                                                       elem_bytes=elem_bytes))


def lora_rank_chunk(config: GemmConfig, rank_block: int) -> int:
    """Rank columns the split epilogue expands per dot. Small tiles (up to 32x128) take the whole rank tile
    (up to 64). Big ones keep their registers for the accumulators: 32 at a time from rank tile 64 on, 16
    below it; 32 rather than 16 at rank tile 64 since fewer, wider dots pay (each dot has its own layout
    round trip). Small tiles lost with 32-column chunks, so they keep the whole rank tile
    (docs/performance.md, 'Levers': 32-column rank chunks). Rank tile 32 on big
    tiles (16 wide) is not measured either way. ``lora_chunk_r=16/32/64`` forces the width on
    every tile, capped at the rank tile (to compare)."""
    forced = overrides.value("lora_chunk_r")
    if forced:
        return min(rank_block, int(forced))
    if config.block_m * config.block_n <= 32 * 128:
        return min(rank_block, 64)
    return 32 if rank_block >= 64 else 16


# Past decode (more routed pairs than the one-program alignment takes), 16-row tiles of batches with more
# adapters than this at rank tile 16 do not prefetch (``lora_prefetch_pays``).
PREFETCH_MAX_ADAPTERS_PAST_DECODE = 3


def lora_prefetch_pays(config: GemmConfig, *, numel: int = 0, num_adapters: int = 0,
                       rank_block: int = 16) -> bool:
    """Whether the split epilogue's operands (the first slot group's shrink and B tiles) are loaded
    before the K-loop, so their latency hides behind it instead of following it in every tile. They
    hold registers (and 4-16 KiB of shared memory) through the loop: worth it for the small decode tiles
    (<= 32 rows) only; on tiles of 64 rows and up it won nothing measurable where it was once kept
    (docs/performance.md, 'Levers': epilogue prefetch). Not for 16-row tiles past decode (``numel`` routed
    pairs over ``SINGLE_PROGRAM_MAX_PAIRS``) of a batch with more than ``PREFETCH_MAX_ADAPTERS_PAST_DECODE``
    adapters at rank tile 16 either: a block there holds rows of several adapters, the prefetch covers the
    first slot's operands only and holds them through the K-loop, and the GEMM waits for its shrink after
    the loop anyway. Dropping it lost with one adapter, at decode and on 32-row tiles, and went both ways at
    rank 64, hence the bounds (docs/performance.md, 'Levers': no prefetch on 16-row tiles with several
    adapters).
    ``lora_prefetch=0`` turns every prefetch off, ``lora_prefetch=1`` keeps the 16-row tiles' for any
    adapter count (to compare on a GPU)."""
    mode = overrides.value("lora_prefetch")
    if mode == "0" or config.block_m > 32:
        return False
    many_adapters = (config.block_m <= 16 and numel > SINGLE_PROGRAM_MAX_PAIRS and rank_block <= 16
                     and num_adapters > PREFETCH_MAX_ADAPTERS_PAST_DECODE)
    return mode == "1" or not many_adapters


# Slot groups on 128x64 tiles and up, where stacked slots beside the accumulators spill: two for the
# single-accumulator GEMM2, one for the gated GEMM1, whose two accumulators leave no room for a second
# (docs/performance.md, 'Levers': slot groups on big tiles).
BIG_TILE = 128 * 64


BIG_TILE_SLOT_GROUP = 2


BIG_TILE_SLOT_GROUP_GATED = 1


# ... and one for GEMM2 too once its K-loop is long: the prefetched group's operands stay live through
# the loop (tile at 255 registers), so their cost grows with K while the epilogue latency they hide does
# not: one pays on Mixtral-8x7B's K 14336 and loses on short K (docs/performance.md, 'Levers': one slot a
# group on long K).
LONG_K_SLOT_GROUP_MIN_K = 8192


BIG_TILE_SLOT_GROUP_LONG_K = 1


# Adapter counts the launch rules tell apart: each rule compares the count with a bound of at most
# LAUNCH_ADAPTER_COUNT_EXACT ... 16, or takes its next power of two capped at a few slots.
LAUNCH_ADAPTER_COUNT_EXACT = 4


LAUNCH_ADAPTER_COUNT_MAX = 64


def launch_adapter_count(num_adapters: int) -> int:
    """The adapter count a batch's launches are planned for: exact up to ``LAUNCH_ADAPTER_COUNT_EXACT``,
    then the next power of two, at most ``LAUNCH_ADAPTER_COUNT_MAX``. Every launch rule decides the same
    for a count and for this value (tests/test_launch_rules.py checks them all); the slot-program shrink
    then runs a few programs more a block, which find no slot left and end. The count is a planning hint
    (``LoRAOperands.num_adapters``: one off the real count costs speed, never correctness), so batches of
    5 to 8 adapters share their launches, their launch traces and their CUDA graphs."""
    if num_adapters <= LAUNCH_ADAPTER_COUNT_EXACT:
        return num_adapters
    return min(next_power_of_2(num_adapters), LAUNCH_ADAPTER_COUNT_MAX)


def lora_slot_group(rank_block: int, num_adapters: int, rows: int) -> int:
    """Adapter slots set side by side per pass (a stacked tile of 64 rank columns): at most
    64 // rank_block, and no more than the batch's adapters (0: unknown) or the rows a block holds, since
    a wider group than the slots present only adds masked work."""
    group = max(1, 64 // rank_block)
    if num_adapters > 0:
        group = min(group, next_power_of_2(num_adapters))
    return max(1, min(group, next_power_of_2(max(1, rows))))


def lora_tile_slot_group(config: GemmConfig, rank_block: int, num_adapters: int, rows: int, *, gated: bool,
                         K: int) -> int:
    """``lora_slot_group`` capped on big tiles: ``BIG_TILE_SLOT_GROUP_GATED`` for the gated GEMM1,
    ``BIG_TILE_SLOT_GROUP_LONG_K`` for a GEMM2 whose K reaches ``LONG_K_SLOT_GROUP_MIN_K``,
    ``BIG_TILE_SLOT_GROUP`` for any other GEMM2."""
    group = lora_slot_group(rank_block, num_adapters, rows)
    if config.block_m * config.block_n >= BIG_TILE:
        if gated:
            cap = BIG_TILE_SLOT_GROUP_GATED
        elif K >= LONG_K_SLOT_GROUP_MIN_K:
            cap = BIG_TILE_SLOT_GROUP_LONG_K
        else:
            cap = BIG_TILE_SLOT_GROUP
        group = min(group, cap)
    return group


def one_row_lora(*, direct: bool, prefetch: bool, late_wait: bool, splits: int, split_chunk: int,
                 programs: int, device: torch.device) -> bool:
    """Whether a split-path GEMM of one decode token (``direct``: one routed pair per program) takes its
    LoRA operands by the one-row prologue: the pair's slot is a scalar load beside the expert's and no
    load is used before the K-loop, so the weights stream at once (the prefetch, ``lora_prefetch_pays``,
    otherwise waits on the slot, then on its rank, before the loop). Where it prefetches, and:
    - with ``late_wait`` (the GEMM runs beside the shrink launch it waits for after its K-loop), only
      while its grid is one program per SM: with more, their K-loops starting at once slowed that shrink,
      and the GEMM waiting for it;
    - without, only if the partials are one chunk of splits (held raw through the loop, then summed):
      with two chunks it lost in GEMM2.
    (docs/performance.md, 'Levers': one-row LoRA prologue.) ``one_row_lora=0`` turns it off (to
    compare)."""
    if not (direct and prefetch) or not overrides.switch("one_row_lora", default=True):
        return False
    if late_wait:
        return _fits_one_wave(programs, device)
    return splits <= split_chunk


def defer_lora_prologue(*, late_wait: bool, splits: int, split_chunk: int, rank_block: int) -> bool:
    """Whether the epilogue prefetch (``lora_prefetch_pays``, past ``one_row_lora``) leaves every use of
    what it loads to after the K-loop (LORA_DEFERRED): the shrink partials, one chunk of splits, are held
    raw through the loop and summed and scaled after it; the B and down A tiles load under the slots'
    presence and take their rank masks after it. Same values, so the same bits. Not with ``late_wait``
    (the partials are read after the loop anyway; the rank mask alone moved out lost), and only at rank
    tile 16, where the raw partials held through the loop are a quarter of rank 64's (rank 64 lost)
    (docs/performance.md, 'Levers': deferred prologue). ``lora_defer=0`` / ``=1`` forces it off / on
    where it applies (to compare)."""
    if late_wait or splits > split_chunk:
        return False
    return overrides.switch("lora_defer", default=rank_block <= 16)


# The adapter-grouped alignment's block: one adapter's rows of one expert, padded to this many (the MMA's
# smallest M).
ADAPTER_BLOCK_M = 16


# Past this many adapters in a batch their LoRA launches run on (expert, adapter) blocks, and past
# AUTO_STAGED_MIN_ADAPTERS with AUTO_STAGED_MIN_ROWS tokens and more "auto" runs the staged path
# (docs/performance.md, 'Adapter memory: the arena'). Powers of two: ``launch_adapter_count`` plans batches
# of 9 to 16 adapters as 16, and so on, and the rules must decide the same for both.
BY_ADAPTER_MIN_ADAPTERS = 9


AUTO_STAGED_MIN_ADAPTERS = 33


AUTO_STAGED_MIN_ROWS = 1024


# ... and from AUTO_STAGED_FEW_EXPERTS_MIN_ADAPTERS adapters and AUTO_STAGED_FEW_EXPERTS_MIN_ROWS tokens on,
# where the batch's adapters train at most AUTO_STAGED_FEW_EXPERTS_SHARE of the layer's experts (ESFT-style
# adapters): the staged path's LoRA launches skip the pairs of untrained experts, the split path's GEMM
# epilogues do not.
AUTO_STAGED_FEW_EXPERTS_MIN_ADAPTERS = 17


AUTO_STAGED_FEW_EXPERTS_MIN_ROWS = 256


AUTO_STAGED_FEW_EXPERTS_SHARE = 0.125


def lora_by_adapter(num_adapters: int) -> bool:
    """Whether the LoRA launches that run apart from the GEMMs run on pairs grouped by (expert, adapter)
    (``moe_align.align_by_adapter``), blocks of ``ADAPTER_BLOCK_M`` rows of one adapter, instead of on the
    GEMMs' expert blocks, where a block of a many-adapter batch holds dozens of adapters and each costs a
    dot over all of the block's rows and a dependent load: the prefill shrinks of the split path, every
    LoRA launch of the staged path (its shrinks, the gate/up expand with the activation, the down expand).
    From ``BY_ADAPTER_MIN_ADAPTERS`` adapters on (at eight the two were even). ``lora_by_adapter=0`` /
    ``=1`` forces it off / on (on: with two adapters or more) to compare."""
    return num_adapters >= 2 and overrides.switch("lora_by_adapter",
                                                  default=num_adapters >= BY_ADAPTER_MIN_ADAPTERS)


def expand_whole_rows(by_adapter: bool) -> bool:
    """Whether the staged path's pair expands (``moe_lora_gate_up_b``, ``moe_lora_down_b``) walk all N
    columns of a block in one program instead of one 64-column tile a program. On (expert, adapter) blocks
    a block holds a few rows of one adapter, and a one-tile program spends most of its time on the chain
    of loads before its dot (the pairs, their slot, its table entry, the split partials), repeated by every
    tile of the block (docs/performance.md, 'Adapter memory: the arena', where the time goes). Off unless
    forced (``expand_whole_rows=1``, on (expert, adapter) blocks only): not yet timed."""
    return by_adapter and overrides.switch("expand_whole_rows", default=False)


def auto_lora_path(rows: int, num_adapters: int, trained_share: float = 1.0) -> str:
    """The LoRA path ``"auto"`` runs on the Triton side for ``rows`` tokens of ``num_adapters`` adapters
    (``launch_adapter_count``'s) that train ``trained_share`` of the layer's experts on average: split,
    except for prefill steps of many adapters (``AUTO_STAGED_MIN_ROWS`` tokens and
    ``AUTO_STAGED_MIN_ADAPTERS`` adapters on), where the staged path's expands on (expert, adapter) blocks
    read each pair's B once where the split path's GEMM epilogues walk every adapter of a block, and for
    prefill steps of adapters that train few experts (``AUTO_STAGED_FEW_EXPERTS_*``), whose untrained pairs
    the staged path skips."""
    if rows >= AUTO_STAGED_MIN_ROWS and num_adapters >= AUTO_STAGED_MIN_ADAPTERS:
        return "staged"
    if (rows >= AUTO_STAGED_FEW_EXPERTS_MIN_ROWS and num_adapters >= AUTO_STAGED_FEW_EXPERTS_MIN_ADAPTERS
            and trained_share <= AUTO_STAGED_FEW_EXPERTS_SHARE):
        return "staged"
    return "split"


def auto_path_needs_trained_share(rows: int, num_adapters: int) -> bool:
    """Whether ``auto_lora_path`` can decide otherwise for another ``trained_share`` (so a caller counts the
    trained experts only then)."""
    return (rows >= AUTO_STAGED_FEW_EXPERTS_MIN_ROWS and num_adapters >= AUTO_STAGED_FEW_EXPERTS_MIN_ADAPTERS
            and not (rows >= AUTO_STAGED_MIN_ROWS and num_adapters >= AUTO_STAGED_MIN_ADAPTERS))


def swap_ab(config: GemmConfig, *, block_scaled: bool) -> bool:
    """Whether a block-FP8 GEMM's K-loop accumulates ``b^T @ a^T`` (the weights the MMA's M, the block's rows
    its N) and transposes once after the loop (``gemm_tiles._gemm_k_loop``): on sm_90 a block of 16 rows then
    takes FP8 warpgroup MMAs natively where ``a @ b`` takes 16x8 MMAs on operands converted from FP8
    (docs/performance.md, 'FP8 base experts'; bf16 tiles gained nothing, so they do not swap).
    Only for 16-row blocks with 64 columns or more (the MMA's M). ``swap_ab=0`` turns it off (to
    compare)."""
    return (block_scaled and config.block_m == 16 and config.block_n >= 64
            and overrides.switch("swap_ab", default=True))


def lora_ext_expand(config: GemmConfig, *, gated: bool, num_adapters: int, K: int,
                    elem_bytes: int = 2, block_scaled: bool = False) -> bool:
    """Whether a prefill GEMM of the split path takes its shrink packed (``pack_shrink_partials``: the
    split sum, the slot scaling and the rounding done once per pair, in the launch that would sum the
    splits) and expands in a K-loop of its own over the block's slot range, slots side by side
    (``lora_expand_slot_range``), instead of finding each slot of the block and loading and summing its
    fp32 partials before a dot per slot (``lora_expand_groups``, whose stacked operand spills; this form
    does not: ``benchmarks/resource_report.py``).
    GEMM2 only, on tiles of 64 rows and up that shared memory lets two blocks share an SM, with a K-loop
    shorter than ``LONG_K_SLOT_GROUP_MIN_K``, for batches of two adapters and more. Mixtral-8x7B's GEMM2
    (K 14336) lost, hence the K bound; GEMM1 lost wherever it took it, as did GEMM2 tiles that hold one
    block (Qwen3-30B-A3B's 128x256) and stacking four rank-16 slots a dot (spills) (docs/performance.md,
    'Levers': slot-range expand).
    ``lora_ext=0`` / ``=1`` forces either on every aligned GEMM, ``=gemm1`` / ``=gemm2`` forces it on
    that GEMM and leaves the other to the rule (to compare). FP8 GEMMs (``block_scaled``) take it only
    where forced: the rule was measured on bf16 GEMMs only."""
    forced = overrides.value("lora_ext")
    if forced in ("0", "1"):
        return forced == "1"
    if forced == ("gemm1" if gated else "gemm2"):
        return True
    return (not gated and not block_scaled and config.block_m >= 64 and num_adapters >= 2
            and K < LONG_K_SLOT_GROUP_MIN_K
            and gemm_blocks_per_sm(config, gated=gated, elem_bytes=elem_bytes) >= 2)


def lora_ext_cols(rank_block: int, num_adapters: int) -> int:
    """Stacked columns per dot of the slot-range expand: two rank-16 slots, one slot from rank tile 32
    on, and no more slots than the batch has adapters (0: unknown). Four rank-16 slots a dot spilled on
    128x64 / 128x128 tiles and lost to no slot-range expand at all (docs/performance.md, 'Levers':
    slot-range expand). ``lora_ext_slots=N`` sets the
    slots a dot (to compare)."""
    forced = overrides.count("lora_ext_slots")
    slots = max(1, forced) if forced is not None else max(1, 32 // rank_block)
    if num_adapters > 0:
        slots = min(slots, next_power_of_2(num_adapters))
    return slots * rank_block


def lora_ext_stages() -> int:
    """Software-pipeline stages of the slot-range expand's loop over the block's slots: one (each slot's B
    tile loaded, then its dot). Two or three stages lost with 2-4 adapters a block (docs/performance.md,
    'Levers': slot-range expand pipelined); ``lora_ext_stages=N`` forces N, to compare where a block holds
    dozens of adapters and the loop is long."""
    forced = overrides.count("lora_ext_stages")
    return max(1, forced) if forced is not None else 1


@dataclass(frozen=True)
class LoRAEpilogue:
    """How one GEMM launch runs its LoRA (the kernel's LoRA meta-parameters), from host-known sizes only.

    Attributes:
        variant: the kernel's ``LORA`` (``lora_epilogues.LORA_*``): where the shrink comes from and how the
            expand is tiled (``lora_variant``).
        chunk_r: rank columns per expand chunk (``lora_rank_chunk``).
        splits, split_chunk: split-K partials per pair (a power of two) and how many one 3-D load sums.
        group: slots expanded side by side per dot (``lora_tile_slot_group``).
        down_shrink, down_prefetch: GEMM1's epilogue writes GEMM2's shrink partials (its first A tile
            prefetched when the grid fits one wave).
        ext_k, ext_stages: columns a step of the slot-range expand (LORA_SLOT_RANGE) and the software-
            pipeline stages of its loop (``lora_ext_stages``).
    """

    variant: int
    chunk_r: int
    splits: int
    split_chunk: int
    group: int
    down_shrink: bool
    down_prefetch: bool
    ext_k: int
    ext_stages: int


def lora_variant(*, split: bool, packed: bool, one_row: bool, prefetch: bool, one_chunk: bool,
                 group: int, defer: bool = False) -> int:
    """The kernel's LoRA variant from the launch decisions: ``split`` (the shrink is precomputed),
    ``packed`` (summed and scaled already), ``one_row`` (``one_row_lora``), ``prefetch``
    (``lora_prefetch_pays``), ``defer`` (``defer_lora_prologue``), ``one_chunk`` (the rank tile is one
    expand chunk) and ``group`` (slots a dot)."""
    if not split:
        return LORA_FUSED.value
    if packed:
        return LORA_SLOT_RANGE.value
    if one_row:
        return LORA_ONE_ROW.value
    if prefetch:
        return LORA_DEFERRED.value if defer else LORA_PREFETCHED.value
    if one_chunk and group > 1:
        return LORA_GROUPS.value
    return LORA_CHUNKED.value


def plan_lora_epilogue(lora: LoRAOperands, config: GemmConfig, *, gated: bool, activation_code: int,
                       numel: int, num_experts: int, K: int, out_n: int, a: torch.Tensor, direct: bool,
                       late_wait: bool, programs: int) -> LoRAEpilogue:
    """The LoRA meta-parameters of one GEMM launch (see :class:`LoRAEpilogue`); checks the packed and
    down-shrink operands against the GEMM."""
    ext = lora.packed is not None
    if ext:
        _check_packed(lora, a, numel, gated=gated, direct=direct)
    shrunk_splits = lora.shrunk.shape[1] if lora.shrunk is not None else 0
    down_shrink = lora.down_shrunk is not None
    if down_shrink:
        _check_down_shrink(lora, activation_code, numel, out_n, config.block_n)
    chunk_r = lora_rank_chunk(config, lora.rank_block)
    splits = next_power_of_2(max(shrunk_splits, 1))
    rows = min(config.block_m, cdiv(numel, num_experts))
    group = lora_tile_slot_group(config, lora.rank_block, lora.num_adapters, rows, gated=gated, K=K)
    # Partials summed per 3-D load: about 32 fp32 registers a thread for them.
    split_chunk = min(splits, next_power_of_2(max(1, 32 * 32 * config.num_warps
                                                            // (config.block_m * chunk_r))))
    one_chunk = bool(shrunk_splits) and lora.rank_block <= chunk_r
    prefetch = one_chunk and lora_prefetch_pays(config, numel=numel, num_adapters=lora.num_adapters,
                                                rank_block=lora.rank_block)
    one_row = one_row_lora(direct=direct, prefetch=prefetch, late_wait=late_wait, splits=splits,
                           split_chunk=split_chunk, programs=programs, device=a.device)
    split = lora.shrunk is not None or ext
    defer = prefetch and not one_row and defer_lora_prologue(
        late_wait=late_wait, splits=splits, split_chunk=split_chunk, rank_block=lora.rank_block)
    return LoRAEpilogue(
        variant=lora_variant(split=split, packed=ext, one_row=one_row, prefetch=prefetch, one_chunk=one_chunk,
                             group=group, defer=defer),
        chunk_r=chunk_r,
        splits=splits,
        split_chunk=split_chunk,
        group=group,
        down_shrink=down_shrink,
        down_prefetch=(overrides.switch("down_prefetch", default=True) and prefetch and down_shrink
                       and _fits_one_wave(numel * cdiv(out_n, config.block_n), a.device)),
        ext_k=lora_ext_cols(lora.rank_block, lora.num_adapters) if ext else 16,
        ext_stages=lora_ext_stages() if ext else 1,
    )


def tile_b_scale(block_n: int, scale_block_n: int, out_n: int, gated: bool) -> bool:
    """Whether every N tile of a block-scaled GEMM lies in one weight scale block, and so does its up tile
    when gated (up columns start at ``out_n``): then each K step has one weight scale per tile. Tiles start
    at multiples of ``block_n``; ``fp8_tile_scale=0`` reads a scale per column (to compare)."""
    fits = scale_block_n % block_n == 0 and (not gated or out_n % scale_block_n == 0)
    return fits and planned("fp8_tile_scale",
                            lambda: overrides.switch("fp8_tile_scale", default=True))


def _fits_one_wave(programs: int, device: torch.device) -> bool:
    """At most one program per SM: then a kernel variant that needs a little more shared memory (the
    down-A prefetch: +2 KiB at 16x64 tiles) cannot cost a wave. Past it, it can: DeepSeek-V2 M=1's
    16x64x128 x 4-stage tiles (144 programs) went 112 -> 114 KiB, one block per SM instead of two, and the
    GEMMs slowed (docs/performance.md, 'Levers': one-row LoRA prologue). CPU tensors (the interpreter)
    take the prefetch."""
    if device.type != "cuda":
        return True
    return programs <= sm_count(device)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 0 for any other (the interpreter's CPU tensors)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def _check_packed(lora: LoRAOperands, a: torch.Tensor, numel: int, *, gated: bool, direct: bool) -> None:
    if lora.shrunk is not None or lora.down_shrunk is not None or direct:
        raise ValueError("lora.packed replaces lora.shrunk, on aligned rows (no direct_ids) without "
                         "down_shrunk")
    expected = (numel, (2 if gated else 1) * lora.rank_block)
    # In the LoRA's dtype: an FP8 GEMM's a is the FP8 copy, its LoRA stays in the activations' dtype.
    want = lora.lora_b.dtype
    if lora.packed.dtype != want or tuple(lora.packed.shape) != expected or lora.packed.stride(1) != 1:
        width = "2 x rank_block" if gated else "rank_block"
        raise ValueError(f"lora.packed must be {want} {expected} (pairs, {width}), contiguous in its "
                         f"rows, got {lora.packed.dtype} {tuple(lora.packed.shape)}")


def _check_down_shrink(lora: LoRAOperands, activation_code: int, numel: int, out_n: int,
                       block_n: int) -> None:
    if activation_code in (ACTIVATION_NONE, ACTIVATION_GATED_RAW):
        raise ValueError("down_shrunk is written by GEMM1's activated epilogue: activation must be silu/gelu")
    rank = lora.lora_b.max_rank
    if lora.down_a is None or (lora.down_a.max_rank, lora.down_a.cols) != (rank, out_n):
        got = None if lora.down_a is None else f"rank {lora.down_a.max_rank}, {lora.down_a.cols} columns"
        raise ValueError(f"down_a must have rank {rank} and {out_n} columns beside down_shrunk, got {got}")
    expected = (numel, cdiv(out_n, block_n), lora.rank_block)
    if lora.down_shrunk.dtype != torch.float32 or tuple(lora.down_shrunk.shape) != expected:
        raise ValueError(f"down_shrunk must be fp32 {expected} (pairs, N tiles of GEMM1, rank_block), got "
                         f"{lora.down_shrunk.dtype} {tuple(lora.down_shrunk.shape)}")


# --------------------------------------------------------------------------------------------------
# fused_experts' decisions
# --------------------------------------------------------------------------------------------------


# At decode on the split path GEMM1's epilogue writes GEMM2's LoRA shrink, one partial per GEMM1 N tile,
# when there are at most this many at rank 16 (fewer for wider ranks; GEMM2 sums them): that saves the
# shrink launch (a CUDA-graph node) for a little GEMM1 epilogue. GEMM2's sum grows with tiles x rank, so
# with more partials it costs more than the launch, and at prefill the extra epilogue costs GEMM1 more
# than the launch. With at most 32 pairs (a few decode tokens) GEMM2 has few programs and more partials
# are still cheaper than the launch (docs/performance.md, 'Levers': decode shrink in the alignment's
# launch).
MAX_DOWN_PARTIALS = 16


# Rank-16-equivalent partials GEMM2 sums when the batch has at most 32 pairs (see above). Past them one
# token's down shrink is a GEMV launch on its routed pairs (``one_token_down_shrink``), which GEMM2
# overlaps like GEMM1 the gate/up shrink: the launch pays only where GEMM2 would sum many partials; with
# few, the epilogue is cheaper (docs/performance.md, 'Levers': one token's down shrink as a GEMV launch).
MAX_DECODE_DOWN_PARTIALS = 64


def decode_down_partials_limit() -> int:
    """``MAX_DECODE_DOWN_PARTIALS``, or the launch override ``decode_down_partials=N`` (to compare on a
    GPU)."""
    forced = overrides.count("decode_down_partials")
    return MAX_DECODE_DOWN_PARTIALS if forced is None else forced


# Past decode the GEMMs overlap the shrink launch before them (``prefill_shrink_overlap``); where a
# split-sum launch (``reduce_shrink_splits``) follows the shrink, only from this many routed pairs on, or
# from this rank tile on (``overlap_through_split_sum``).
PREFILL_OVERLAP_SPLIT_SUM_MIN_PAIRS = 1024


PREFILL_OVERLAP_SPLIT_SUM_MIN_RANK = 64


def overlap_through_split_sum(pairs: int, rank_block: int) -> bool:
    """Whether a GEMM overlaps its shrink through the split-sum launch between them (the sum releases
    the GEMM, then waits for the shrink), where there is one. At rank tile 16 the shrinks are short, so
    the overlap pays only from enough routed pairs (a few hundred pairs gained nothing); at rank tile 64
    the shrinks it hides are 4x longer and it pays with fewer (docs/performance.md, 'Levers': overlap
    through the split sum)."""
    return pairs >= PREFILL_OVERLAP_SPLIT_SUM_MIN_PAIRS or rank_block >= PREFILL_OVERLAP_SPLIT_SUM_MIN_RANK


# A prefill shrink launch walks all of K in each program (no split-K) only when its alignment gives at least
# this many programs (``one_split_shrink``): Mixtral-8x7B's 8 experts give ~48 at M=1024.
ONE_SPLIT_SHRINK_MIN_ROW_PROGRAMS = 96


# ... and only when the block's slots take at most this many 64-column passes over K, or up to the second
# bound from the second count of routed pairs on (see there).
ONE_SPLIT_SHRINK_MAX_PASSES = 2


ONE_SPLIT_SHRINK_MANY_PASSES = 4


ONE_SPLIT_SHRINK_MANY_PASSES_MIN_PAIRS = 4096


def one_split_shrink(pairs: int, rank_block: int, num_adapters: int, row_programs: int,
                     longest_k: int) -> bool:
    """Whether a prefill shrink launch of the split path (``moe_lora_a``) walks all of K in each program
    instead of splitting K for two programs an SM (``shrink_k_splits``): then no split-sum launch follows
    it, and the GEMM after it overlaps it directly. Where the GEMMs overlap their shrinks anyway (from
    ``PREFILL_OVERLAP_SPLIT_SUM_MIN_PAIRS`` routed pairs), the block's slots take at most
    ``ONE_SPLIT_SHRINK_MAX_PASSES`` passes over K (64 // rank_block adapters a pass, ``lora_slot_group``;
    ``ONE_SPLIT_SHRINK_MANY_PASSES`` from ``ONE_SPLIT_SHRINK_MANY_PASSES_MIN_PAIRS`` pairs on), the
    alignment gives at least ``ONE_SPLIT_SHRINK_MIN_ROW_PROGRAMS`` programs, and neither shrink's K
    (``longest_k``: hidden or intermediate size) reaches ``LONG_K_SLOT_GROUP_MIN_K``.

    Each pass walks all of K again, so a program's walk grows with the block's slots: the GEMM that
    overlaps the shrink waits for its longest program, and only a long enough K-loop (enough routed
    pairs) hides four passes. Left out for the same reason: fewer pairs, and a long K (one program walking
    Mixtral-8x7B's 14336 alone lost); DeepSeek-V3 (K 7168) splits no shrink at these M anyway
    (docs/performance.md, 'Levers': one pass over K per shrink program).
    ``one_split_shrink=0`` / ``=1`` forces either on every prefill shrink of the split path (to
    compare)."""
    passes = (ONE_SPLIT_SHRINK_MANY_PASSES if pairs >= ONE_SPLIT_SHRINK_MANY_PASSES_MIN_PAIRS
              else ONE_SPLIT_SHRINK_MAX_PASSES)
    max_adapters = passes * max(1, 64 // rank_block)
    usual = (pairs >= PREFILL_OVERLAP_SPLIT_SUM_MIN_PAIRS and 0 < num_adapters <= max_adapters
             and row_programs >= ONE_SPLIT_SHRINK_MIN_ROW_PROGRAMS and longest_k < LONG_K_SLOT_GROUP_MIN_K)
    return overrides.switch("one_split_shrink", default=usual)


# A prefill shrink runs a program per slot of each block from this many adapters, where it would split K,
# and where it would walk K in one pass (``one_split_shrink``) below the second count of routed pairs.
SLOT_PROGRAM_SHRINK_MIN_ADAPTERS = 4


SLOT_PROGRAM_OVER_ONE_PASS_MAX_PAIRS = 2048


SLOT_PROGRAM_OVER_ONE_PASS_MIN_ADAPTERS = 5


def slot_program_shrink(num_adapters: int, longest_k: int, pairs: int, one_pass: bool) -> bool:
    """Whether a prefill shrink launch of the split path runs a program per slot of each block over all of K
    (``moe_lora_a(slot_programs=True)``) instead of splitting K (``shrink_k_splits``) or, where the one-pass
    rule holds (``one_pass``, ``one_split_shrink``), instead of one program walking all of K for all the
    block's slots: about as many programs as the split with several adapters (the one pass's times the
    slots), and no split-sum launch after it, so the GEMM overlaps it directly. From
    ``SLOT_PROGRAM_SHRINK_MIN_ADAPTERS`` adapters, over the one pass only below
    ``SLOT_PROGRAM_OVER_ONE_PASS_MAX_PAIRS`` pairs and from ``SLOT_PROGRAM_OVER_ONE_PASS_MIN_ADAPTERS``
    adapters, while neither shrink's K (``longest_k``) reaches
    ``LONG_K_SLOT_GROUP_MIN_K`` (Mixtral-8x7B's 14336 was not measured; one program walking it alone is
    what cost the one-pass rule there).

    Over split K it pays from a few adapters; over the one pass only with more adapters (the one pass's
    programs then walk many slots each) and fewer pairs (from more it lost), hence the two bounds
    (docs/performance.md, 'Levers': a shrink program per slot). Fewer adapters were not measured (one
    adapter would get a program per block walking all of K: the loss ``one_split_shrink`` records at few
    pairs).
    ``slot_program_shrink=0`` / ``=1`` forces it off or on (for any known adapter count; on, over the
    one pass too)."""
    over_one_pass = (pairs < SLOT_PROGRAM_OVER_ONE_PASS_MAX_PAIRS
                     and num_adapters >= SLOT_PROGRAM_OVER_ONE_PASS_MIN_ADAPTERS)
    usual = (num_adapters >= SLOT_PROGRAM_SHRINK_MIN_ADAPTERS and longest_k < LONG_K_SLOT_GROUP_MIN_K
             and (not one_pass or over_one_pass))
    return num_adapters >= 1 and overrides.switch("slot_program_shrink", default=usual)


# Fewest K splits a pair one decode token's gate/up shrink is cut to so that its programs sit beside
# GEMM1's: each program then walks 512 of a 2048-wide K; at two splits its walk outlasts GEMM1's K-loop.
ONE_TOKEN_SHRINK_MIN_SPLITS = 4


def one_token_shrink_splits(pairs: int, usual: int, gemm1_programs: int, sm_count: int) -> int:
    """K splits of one decode token's gate/up shrink launch: ``usual`` (``decode_shrink_splits``), or fewer
    where GEMM1 leaves SMs idle that hold at least ``ONE_TOKEN_SHRINK_MIN_SPLITS`` programs a pair but not
    ``usual``: then every shrink program gets an SM of its own instead of sharing one with a GEMM1 program
    (GEMM1 runs beside the shrink, ``decode_shrink_overlap``, and ends with its slowest program).
    ``sm_count`` 0 (no GPU) keeps ``usual``. It pays where GEMM1 leaves SMs idle (Qwen3-30B-A3B's 96
    GEMM1 programs); where GEMM1 takes every SM fewer splits only lengthen each program, so those keep
    ``usual``; fewer than ``ONE_TOKEN_SHRINK_MIN_SPLITS`` outlast GEMM1 (docs/performance.md, 'Levers': one
    token's shrink fits idle SMs). ``one_token_shrink_fit=0`` keeps ``usual`` (to compare)."""
    fit = (sm_count - gemm1_programs) // max(pairs, 1)
    if not ONE_TOKEN_SHRINK_MIN_SPLITS <= fit < usual:
        return usual
    return fit if overrides.switch("one_token_shrink_fit", default=True) else usual


def decode_direct_pairs(num_tokens: int) -> bool:
    """Whether the GEMMs take the routed pairs straight from topk_ids, without the alignment launch: for
    one token, whose top-k experts are distinct, so the alignment would only put each pair in a block of
    its own. For more tokens, pairs that share an expert would each read its weights again. With
    ``fused_topk_sum`` it saves a decode token two launches (docs/performance.md, 'Levers': two-launch
    decode). ``decode_direct=0`` turns it off (to compare)."""
    return num_tokens == 1 and overrides.switch("decode_direct", default=True)


def fused_topk_sum(num_tokens: int, top_k: int) -> bool:
    """Whether the last GEMM2 program of each N-tile column sums the top-k rows, instead of a launch of
    its own: for one token. With more, that program sums every token of the column by itself, serially,
    and it lost to the separate launch (docs/performance.md, 'Levers': two-launch decode).
    ``fused_sum=0`` turns it off (to compare)."""
    return top_k > 1 and num_tokens == 1 and overrides.switch("fused_sum", default=True)


# An expert-parallel rank aligns one token's pairs from this many bytes of base weights per expert: below,
# the direct programs of other ranks' pairs re-read expert 0 mostly from L2 (50 MB on an H100/H200), and
# the two launches the alignment adds (alignment, top-k sum) cost more than they save.
SPARSE_ALIGN_MIN_EXPERT_BYTES = 32 * 1024**2


def sparse_routing_aligns(hidden: int, intermediate: int, elem_bytes: int) -> bool:
    """Whether a token whose pairs often name other ranks' experts (``sparse_routing``) is aligned, so
    those pairs take null blocks that read nothing, instead of a direct program each that runs on expert 0
    and stores zeros (``decode_direct_pairs``): where an expert's weights (3 x H x I) outgrow L2, each such
    program streams expert 0 from memory again. It paid on DeepSeek-V3 (88 MB an expert) and lost on
    Qwen3-30B-A3B (9 MB), hence the bound (docs/performance.md, 'Levers': expert-parallel decode).
    ``sparse_align=0`` / ``=1`` forces it (to compare)."""
    usual = 3 * hidden * intermediate * elem_bytes >= SPARSE_ALIGN_MIN_EXPERT_BYTES
    return overrides.switch("sparse_align", default=usual)


def fp8_lora_takes_bf16_tiles(rows: int) -> bool:
    """Whether FP8 GEMMs with adapters (split path) take the activations' dtype's tuned LoRA tiles (BLOCK_K
    set to the scale group) instead of the FP8 files' base tiles, which hold no LoRA tiles: for one decode
    token, whose one-row LoRA epilogue those tiles were tuned for. Past it the FP8 base tiles win: the bf16
    LoRA tiles with FP8's 128-wide K steps lost at prefill (docs/performance.md, 'FP8').
    ``fp8_lora_tiles=bf16`` or ``fp8`` takes those tiles at every size (to compare)."""
    choice = overrides.value("fp8_lora_tiles") or "auto"
    return choice == "bf16" or (choice == "auto" and rows == 1)
