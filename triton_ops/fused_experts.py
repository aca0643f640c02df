"""The base fused MoE: alignment, GEMM1 with the gated activation in its epilogue, GEMM2, top-k combine.

Semantics:  out[t] = rsf * sum_j w[t, j] * W2[e_j] @ (act(W13[e_j, :I] @ x[t]) * (W13[e_j, I:] @ x[t]))
            with e_j = topk_ids[t, j]; with apply_router_weight_on_input, w scales x before GEMM1 instead.
Launches:   moe_align_block_size (3) -> GEMM1+activation -> GEMM2 (routed weight, rsf) -> top-k sum
            (the sum is skipped for top_k == 1 and for no_combine, where GEMM2 writes the output).
            Decode (<= 128 routed pairs): the alignment is one launch. One token: no alignment
            (``decode_direct_pairs``) and the top-k sum at the end of GEMM2 (``fused_topk_sum``), so the
            base layer is GEMM1 -> GEMM2.

No step reads a device value on the host, so a call with a fixed token count can be captured in a CUDA
graph. Very large batches are processed in chunks of ``MOELORA_MOE_CHUNK_TOKENS`` tokens (default
32768) to bound the intermediate buffers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton

from triton_ops.configs import (
    MAX_SHARED_BYTES,
    MoEConfig,
    env_count,
    env_switch,
    get_moe_config,
    pipeline_smem_bytes,
)
from triton_ops.decode_shrink import (
    decode_shrink_block_k,
    decode_shrink_splits,
    moe_align_with_gate_up_shrink,
    one_token_down_shrink,
    one_token_down_splits,
)
from triton_ops.fused_moe import (
    _ACTIVATIONS,
    LONG_K_SLOT_GROUP_MIN_K,
    LoRAOperands,
    TopkSumOperands,
    invoke_fused_moe_kernel,
    lora_ext_expand,
    lora_rank_block,
    sm_count,
)
from triton_ops.moe_align import SINGLE_PROGRAM_MAX_PAIRS, moe_align_block_size
from triton_ops.moe_inputs import check_moe_inputs
from triton_ops.moe_lora import (
    moe_lora_a,
    moe_lora_down_combine,
    moe_lora_gate_up_b,
    shrink_block_k,
    shrink_k_splits,
    shrink_row_programs,
)
from triton_ops.moe_sum import moe_sum_reduce
from triton_ops.pdl import decode_shrink_overlap, one_token_dependent_gemm2, prefill_shrink_overlap
from triton_ops.shrink_reduce import pack_shrink_partials, reduce_shrink_splits, reduce_splits_pays

LORA_PATHS = ("fused", "split", "staged")

# At decode on the split path GEMM1's epilogue writes GEMM2's LoRA shrink, one partial per GEMM1 N tile,
# when there are at most this many at rank 16 (fewer for wider ranks; GEMM2 sums them): that saves the
# shrink launch (~3 us in a graph) for about 1 us of GEMM1 epilogue. With more partials GEMM2's sums cost
# more than the launch (DeepSeek-V3 M=16, 64 partials: GEMM2 710 -> 839 us), and at prefill GEMM1's
# epilogue does (Qwen3-30B M=1024, 128-row tiles: GEMM1 272 -> 437 us); H200, benchmarks/micro_lora.py.
# With at most 32 pairs (a few decode tokens) GEMM2 has few programs and 64 rank-16 partials are still
# cheap (DeepSeek-V2-Lite M=1, 44 partials: +14.1 % vs +17.0 % with the launch, moelora bench).
MAX_DOWN_PARTIALS = 16
# Rank-16-equivalent partials GEMM2 sums when the batch has at most 32 pairs (see above). Past them one
# token's down shrink is a GEMV launch on its routed pairs (``one_token_down_shrink``), which GEMM2
# overlaps like GEMM1 the gate/up shrink. H100, M=1, one adapter, GEMM1 epilogue -> GEMV launch (graph
# replays, median of 5 interleaved rounds): rank 64 DeepSeek-V2-Lite (88 partials) 57.0 -> 55.3 us,
# DeepSeek-V3 (128) 260.3 -> 258.5, but Qwen3-30B (48) 44.0 -> 46.0; rank 16 Qwen3-30B (12) 42.9 -> 44.4,
# DeepSeek-V2-Lite (22) 52.2 -> 54.0.
MAX_DECODE_DOWN_PARTIALS = 64


def decode_down_partials_limit() -> int:
    """``MAX_DECODE_DOWN_PARTIALS``, or ``MOELORA_DECODE_DOWN_PARTIALS=N`` (to compare on a GPU)."""
    forced = env_count("MOELORA_DECODE_DOWN_PARTIALS", "partial count")
    return MAX_DECODE_DOWN_PARTIALS if forced is None else forced


# Past decode the GEMMs overlap the shrink launch before them (``prefill_shrink_overlap``); where a
# split-sum launch (``reduce_shrink_splits``) follows the shrink, only from this many routed pairs on, or
# from this rank tile on (``overlap_through_split_sum``).
PREFILL_OVERLAP_SPLIT_SUM_MIN_PAIRS = 1024
PREFILL_OVERLAP_SPLIT_SUM_MIN_RANK = 64


def overlap_through_split_sum(pairs: int, rank_block: int) -> bool:
    """Whether a GEMM overlaps its shrink through the split-sum launch between them (the sum releases
    the GEMM, then waits for the shrink), where there is one. H100, interleaved A/B (benchmarks/ab_env.py),
    overlap off -> on through the sums, LoRA layer overhead over the base:
    - rank 16, 4 adapters: M=256 DeepSeek-V2-Lite (1536 pairs) +13.9 -> +11.7 %, Qwen3-30B-A3B (2048)
      +16.2 -> +14.9 %; but M=64 DeepSeek-V2-Lite (384 pairs) +11.7 -> +12.5 % in one run, +12.0 -> +12.0 %
      in another, DeepSeek-V2 (384) +5.2 -> +5.5 %, Qwen3-30B-A3B (512) +13.5 -> +13.2 %: hence the pairs;
    - rank 64 at M=64 it pays (the shrinks it hides are 4x longer), 1 / 4 adapters: DeepSeek-V2-Lite
      +14.8 -> +13.0 % / +47.1 -> +42.2 %, Qwen3-30B-A3B +16.8 -> +14.8 % / +48.2 -> +46.0 %, DeepSeek-V2
      +8.9 -> +8.0 % / +20.1 -> +19.1 %, DeepSeek-V3 unchanged (+5.1 % / +12.4 %): hence the rank tile."""
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

    H100, interleaved A/B (``benchmarks/ab_env.py``), split -> one program over K, LoRA layer overhead over
    the base, 1 / 4 adapters: rank 16 DeepSeek-V2-Lite M=256 (3 splits) +6.9 -> +3.9 % / +11.7 -> +9.6 %,
    M=1024 (2) +8.6 -> +4.4 % / +18.2 -> +13.6 %, Qwen3-30B-A3B M=256 (2) +6.0 -> +6.0 % / +15.2 -> +14.1 %,
    DeepSeek-V2 M=256 and 1024 with 4: +7.0 -> +6.4 % and +6.9 -> +6.3 %; rank 64 with one adapter
    DeepSeek-V2-Lite M=256 +10.9 -> +8.5 %, M=1024 +30.4 -> +19.3 %, Qwen3-30B-A3B M=256 +13.9 -> +12.1 %.
    Two passes: rank 64 with 2 adapters DeepSeek-V2-Lite M=1024 +40.2 -> +33.0 %, Qwen3-30B-A3B M=256
    +25.2 -> +23.9 % (the other points within 0.6), rank 16 with 8 adapters within 0.5 points. Four passes
    (rank 64 with 4 adapters) only from 4096 pairs: DeepSeek-V2-Lite M=1024 (6144 pairs) +66.3 -> +57.5 %,
    M=4096 +44.8 -> +44.7 %, Qwen3-30B-A3B M=1024 +78.2 -> +78.5 %, M=4096 +74.3 -> +73.3 %, DeepSeek-V2
    and DeepSeek-V3 M=1024/4096 within 0.2 % (median of three rounds); but M=256
    DeepSeek-V2-Lite (1536 pairs) +35.0 -> +37.2 %, DeepSeek-V2 +24.5 -> +25.4 % (Qwen3-30B-A3B, 2048 pairs,
    +49.0 -> +47.3 %). Left out: fewer pairs (M=64 with 4 adapters: the
    GEMM, overlapping the long shrink programs, waited for them: DeepSeek-V2-Lite +11.0 -> +14.3 %,
    Qwen3-30B-A3B +12.4 -> +14.9 %); Mixtral-8x7B (K 14336 down; M=4096, 144 programs, noisy: rank 64 one
    adapter +12.1 -> +19.4 % in all three rounds, rank 16 one adapter +14.3 -> +8.9 % but four +7.3 ->
    +10.8 %). DeepSeek-V3 (K 7168) splits no shrink at these M anyway.
    ``MOELORA_ONE_SPLIT_SHRINK=0`` / ``=1`` forces either on every prefill shrink of the split path (to
    compare)."""
    passes = (ONE_SPLIT_SHRINK_MANY_PASSES if pairs >= ONE_SPLIT_SHRINK_MANY_PASSES_MIN_PAIRS
              else ONE_SPLIT_SHRINK_MAX_PASSES)
    max_adapters = passes * max(1, 64 // rank_block)
    usual = (pairs >= PREFILL_OVERLAP_SPLIT_SUM_MIN_PAIRS and 0 < num_adapters <= max_adapters
             and row_programs >= ONE_SPLIT_SHRINK_MIN_ROW_PROGRAMS and longest_k < LONG_K_SLOT_GROUP_MIN_K)
    return env_switch("MOELORA_ONE_SPLIT_SHRINK", default=usual)


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

    H100, interleaved A/B (``benchmarks/ab_env.py``, median of three rounds), split K -> a program per slot,
    LoRA layer overhead over the base: M=64 rank 16, 4 / 8 adapters: DeepSeek-V2-Lite +10.9 -> +10.2 % /
    +19.9 -> +16.7 %, Qwen3-30B-A3B +12.2 -> +10.7 % / +15.8 -> +14.1 %, DeepSeek-V3 +3.4 -> +2.8 % /
    +4.3 -> +3.3 %, DeepSeek-V2 +4.5 -> +5.0 % / +5.9 -> +5.5 % (K 5120 walked by one program); rank 64 with
    4 adapters M=64 DeepSeek-V2-Lite +43.2 -> +40.1 %, Qwen3-30B-A3B +46.0 -> +43.8 %, M=256
    DeepSeek-V2-Lite +35.0 -> +33.1 %. Over the one pass, rank 16, 4 / 8 adapters: M=256 DeepSeek-V2-Lite
    (1536 pairs) +9.8 -> +8.3 % / +20.2 -> +17.7 % (again: +9.7 -> +8.5 % / +20.2 -> +18.1 %), DeepSeek-V2
    (1536) +6.4 -> +6.3 % / +10.2 -> +9.8 %, Qwen3-30B-A3B (2048) +14.2 -> +14.3 % / +24.9 -> +24.7 %; but
    M=1024 DeepSeek-V2-Lite +13.5 -> +18.3 % / +28.8 -> +34.0 %, Qwen3-30B-A3B +17.4 ->
    +22.3 % / +34.0 -> +43.1 %, and M=4096 lost 2-6 points too. At 9fc9df9 four adapters over the one pass
    lost instead (what moved it since 69ffc4c was not found; 427ced8 touched the slot programs): M=256
    DeepSeek-V2-Lite rank 16, one pass -> a program per slot, 4 / 5 / 6 / 8 adapters (5 rounds) +9.6 ->
    +10.4 % / +16.6 -> +14.0 % / +17.9 -> +16.2 % / +20.1 -> +19.0 %; DeepSeek-V2 +6.4 -> +6.4 % / +7.8 ->
    +7.5 % / +8.8 -> +8.5 % / +10.2 -> +10.1 %: so over the one pass from five adapters. (Rank 64 with four
    adapters, four passes, has no one pass below 4096 pairs: split K -> a program per slot, DeepSeek-V2-Lite
    +34.8 -> +34.5 %, DeepSeek-V2 +24.5 -> +23.9 %.) Fewer adapters were not measured (one
    adapter would get a program per block walking all of K: the loss ``one_split_shrink`` records at M=64).
    ``MOELORA_SLOT_PROGRAM_SHRINK=0`` / ``=1`` forces it off or on (for any known adapter count; on, over the
    one pass too)."""
    over_one_pass = (pairs < SLOT_PROGRAM_OVER_ONE_PASS_MAX_PAIRS
                     and num_adapters >= SLOT_PROGRAM_OVER_ONE_PASS_MIN_ADAPTERS)
    usual = (num_adapters >= SLOT_PROGRAM_SHRINK_MIN_ADAPTERS and longest_k < LONG_K_SLOT_GROUP_MIN_K
             and (not one_pass or over_one_pass))
    return num_adapters >= 1 and env_switch("MOELORA_SLOT_PROGRAM_SHRINK", default=usual)


# Fewest K splits a pair one decode token's gate/up shrink is cut to so that its programs sit beside
# GEMM1's: each program then walks 512 of a 2048-wide K; at two splits its walk outlasts GEMM1's K-loop.
ONE_TOKEN_SHRINK_MIN_SPLITS = 4


def one_token_shrink_splits(pairs: int, usual: int, gemm1_programs: int, sm_count: int) -> int:
    """K splits of one decode token's gate/up shrink launch: ``usual`` (``decode_shrink_splits``), or fewer
    where GEMM1 leaves SMs idle that hold at least ``ONE_TOKEN_SHRINK_MIN_SPLITS`` programs a pair but not
    ``usual``: then every shrink program gets an SM of its own instead of sharing one with a GEMM1 program
    (GEMM1 runs beside the shrink, ``decode_shrink_overlap``, and ends with its slowest program).
    ``sm_count`` 0 (no GPU) keeps ``usual``. H100, M=1, one adapter, interleaved A/B, 8 -> 4 splits:
    Qwen3-30B-A3B (96 GEMM1 programs, 8 pairs) rank 16 +13.5 -> +9.5 % (41.0 -> 39.6 µs), rank 64 +20.6 ->
    +17.2 %; where GEMM1 takes every SM 4 splits were even (DeepSeek-V2-Lite, 132 programs: 1.005) or lost
    (DeepSeek-V2, DeepSeek-V3, Mixtral-8x7B: 1.004-1.030), so they keep 8; on Qwen3-30B-A3B 2 splits lost
    10 % at rank 16 and 16 lost 8 %. ``MOELORA_ONE_TOKEN_SHRINK_FIT=0`` keeps ``usual`` (to compare)."""
    fit = (sm_count - gemm1_programs) // max(pairs, 1)
    if not ONE_TOKEN_SHRINK_MIN_SPLITS <= fit < usual:
        return usual
    return fit if env_switch("MOELORA_ONE_TOKEN_SHRINK_FIT", default=True) else usual


def decode_direct_pairs(num_tokens: int) -> bool:
    """Whether the GEMMs take the routed pairs straight from topk_ids, without the alignment launch: for
    one token, whose top-k experts are distinct, so the alignment would only put each pair in a block of
    its own. For more tokens, pairs that share an expert would each read its weights again. H100, base
    layer M=1, with ``fused_topk_sum`` (both off -> on, ``benchmarks/ab_env.py --layer base``):
    DeepSeek-V2-Lite 60.2 -> 54.9 us, Qwen3-30B-A3B 51.2 -> 45.3, DeepSeek-V2 120.5 -> 114.8, DeepSeek-V3
    257.2 -> 251.1, Mixtral-8x7B 253.4 -> 248.4. ``MOELORA_DECODE_DIRECT=0`` turns it off (to compare)."""
    return num_tokens == 1 and env_switch("MOELORA_DECODE_DIRECT", default=True)


def fused_topk_sum(num_tokens: int, top_k: int) -> bool:
    """Whether the last GEMM2 program of each N-tile column sums the top-k rows, instead of a launch of
    its own: for one token. With more, that program sums every token of the column by itself, and it
    lost to the separate launch: H100 base layer, off -> on, M=1 DeepSeek-V2-Lite 55.6 -> 54.7 us,
    Qwen3-30B-A3B 46.4 -> 44.9, DeepSeek-V3 252.0 -> 250.5; M=2..16 up to 1.3 % slower (DeepSeek-V2-Lite
    M=16 305.7 -> 309.8 us), and with 4 rank-16 adapters DeepSeek-V3 M=16 2931 -> 2973 us.
    ``MOELORA_FUSED_SUM=0`` turns it off (to compare)."""
    return top_k > 1 and num_tokens == 1 and env_switch("MOELORA_FUSED_SUM", default=True)


@dataclass(frozen=True)
class MoELoRAInputs:
    """One layer's adapter buffers (DESIGN §2) plus the batch's slot per token.

    ``max_rank`` is the largest real rank among the slots this batch uses (known on the host): it sets
    the rank tile, so a batch of rank-8 adapters in a max-rank-64 pool does rank-8 (tile 16) work.
    """

    token_slots: torch.Tensor  # (M,) int32, -1 = no adapter
    gate_up_a: torch.Tensor  # (L, E, 2R, H)
    gate_up_b: torch.Tensor  # (L, E, 2I, R)
    down_a: torch.Tensor  # (L, E, R, I)
    down_b: torch.Tensor  # (L, E, H, R)
    slot_ranks: torch.Tensor  # (L,) int32
    slot_scalings: torch.Tensor  # (L,) fp32
    max_rank: int
    # Distinct adapters in the batch (host-known; 0 = unknown). Only a launch hint: how many slots the
    # kernels set side by side per pass (one adapter: one, so no stacked tile is wasted).
    num_adapters: int = 0

def _chunk_tokens() -> int:
    return max(1, int(os.environ.get("MOELORA_MOE_CHUNK_TOKENS", 32768)))


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    inplace: bool = False,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    routed_scaling_factor: float = 1.0,
    no_combine: bool = False,
    config: MoEConfig | None = None,
    lora: MoELoRAInputs | None = None,
    lora_path: str = "fused",
) -> torch.Tensor:
    """Runs the routed experts of one MoE layer (see the module docstring for the math).

    Args:
        x: (M, H) float16/bfloat16/float32 activations.
        w13: (E, 2I, H), rows [0, I) gate and [I, 2I) up; w2: (E, H, I); same dtype as x.
        topk_weights: (M, top_k) routing weights (float32; other float dtypes are upcast).
        topk_ids: (M, top_k) int32/int64 expert ids in [0, E) (not checked on the device).
        inplace: write the result into x and return x.
        activation: "silu" or "gelu" (exact), applied to the gate half.
        apply_router_weight_on_input: scale x by the routing weight before GEMM1 (top_k == 1 models).
        routed_scaling_factor: rsf, multiplies the combined output.
        no_combine: return (M, top_k, H) per-pair outputs rsf * w * y instead of their sum.
        config: force a launch config (default: ``triton_ops.configs.get_moe_config``); on the split LoRA
            path its LoRA tiles for the rank tile and ``lora.num_adapters`` when it has them.
        lora: per-token adapter deltas (DESIGN §1: gate/up before the activation, down after it).
        lora_path: "fused" (shrinks in the GEMM K-loops, expands in their epilogues: the base path's
            launches), "split" (each shrink once per pair by ``moe_lora_a``, expands in the GEMM
            epilogues: two more launches, no recomputation across N tiles; at decode the gate/up
            shrink rides in the alignment's launch and, up to ``MAX_DOWN_PARTIALS`` GEMM1 N tiles, the
            down shrink in GEMM1's epilogue, so decode has the base path's launches (one token past that
            many: a GEMV launch between the GEMMs, ``one_token_down_shrink``, still no alignment); where
            many N tiles would each re-sum a shrink's split-K partials, ``reduce_shrink_splits`` sums them
            once first, or ``pack_shrink_partials`` packs them for ``lora_ext_expand``) or "staged"
            (separate shrink / gate_up+act / down+combine kernels, seed 002's interface).
    """
    check_moe_inputs(x, w13, w2, topk_weights, topk_ids)
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
    if inplace and no_combine:
        raise ValueError("inplace and no_combine cannot be combined: the outputs have different shapes")
    if lora is not None:
        _check_lora_inputs(lora, x, w13, lora_path)
        if lora_path == "staged" and no_combine:
            raise ValueError("no_combine needs lora_path='fused': the staged down kernel sums the top-k")

    # The kernels address x and the outputs as row-major: any other layout is copied (and, in place,
    # copied back at the end).
    strided_target = x if inplace and not x.is_contiguous() else None
    if not x.is_contiguous():
        x = x.contiguous()

    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    intermediate = two_i // 2
    top_k = topk_ids.shape[1]
    if topk_weights.dtype != torch.float32:
        topk_weights = topk_weights.float()

    if no_combine:
        out = torch.empty((num_tokens, top_k, hidden), dtype=x.dtype, device=x.device)
    elif inplace:
        out = x
    else:
        out = torch.empty_like(x)
    if num_tokens == 0:
        return out if strided_target is None else strided_target

    chunk = min(num_tokens, _chunk_tokens())
    activated = torch.empty((chunk * top_k, intermediate), dtype=x.dtype, device=x.device)
    pair_out = None
    if top_k > 1 and not no_combine:
        pair_out = torch.empty((chunk * top_k, hidden), dtype=x.dtype, device=x.device)
    staged = lora is not None and lora_path == "staged"
    split = lora is not None and lora_path == "split"
    if lora is not None:
        rank_block = lora_rank_block(lora.max_rank)
    if staged:
        # fp32 and computed with the gated tiles, so rows without an adapter see exactly the activation
        # input of the base path's fused epilogue and come out bit for bit equal to it (DESIGN §1).
        gemm1_raw = torch.empty((chunk * top_k, two_i), dtype=torch.float32, device=x.device)

    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        rows = end - start
        if config is not None:
            cfg = config.for_lora(rank_block, lora.num_adapters) if split else config
        else:
            cfg = get_moe_config(rows, num_experts, hidden, intermediate, top_k, x.dtype, x.device,
                                 lora=split, rank_block=rank_block if split else 0,
                                 num_adapters=lora.num_adapters if split else 0)
        if lora is not None and lora_path == "fused":
            cfg = _with_lora_tiles(cfg, rank_block=rank_block, elem_bytes=x.element_size())
        chunk_ids = topk_ids[start:end]
        chunk_weights = topk_weights[start:end].reshape(-1)
        if not chunk_weights.is_contiguous():
            chunk_weights = chunk_weights.contiguous()
        pairs = rows * top_k
        if lora is not None:
            chunk_slots = lora.token_slots[start:end]
        # Decode on the split path: GEMM1's shrink rides in the alignment's launch (or, for one token,
        # whose GEMMs need no alignment, is that launch).
        decode_shrink = split and pairs <= SINGLE_PROGRAM_MAX_PAIRS
        # GEMM2's shrink in GEMM1's epilogue (one partial per GEMM1 N tile) instead of its own launch.
        down_tiles = gemm1_n_tiles = triton.cdiv(intermediate, cfg.gemm1.block_n)
        # GEMM2 sums (rows, tiles, rank_block) fp32 partials: bounded by tiles x rank, not tiles alone
        # (DeepSeek-V2-Lite M=1 rank 64, 44 partials: 48 -> 180 us, spilled).
        partial_width = down_tiles * rank_block if lora is not None else 0
        down_in_gemm1 = decode_shrink and (
            partial_width <= MAX_DOWN_PARTIALS * 16
            or (pairs <= 32 and partial_width <= decode_down_partials_limit() * 16))
        # One token needs no alignment: its down shrink rides in GEMM1's epilogue or, past that many
        # partials, is a GEMV launch on its routed pairs (one_token_down_shrink) between the GEMMs.
        direct = not staged and pairs <= SINGLE_PROGRAM_MAX_PAIRS and decode_direct_pairs(rows)
        # GEMM1 streams its base weights while the gate/up shrink launch before it runs; GEMM2 likewise
        # while the down shrink launch runs, when there is one.
        overlap = decode_shrink and direct and decode_shrink_overlap(x.device)
        down_launch_direct = split and direct and not down_in_gemm1
        # Aligned batches: each GEMM streams its base weights while the moe_lora_a shrink launch before it
        # (and the split-sum launch after that shrink, ``overlap_through_split_sum``) runs. At decode only
        # GEMM2 has one (when the down shrink does not fit GEMM1's epilogue; no split sum there): the
        # gate/up shrink rides in the alignment's launch.
        shrink_launch_overlap = split and not direct and prefill_shrink_overlap(x.device)
        if decode_shrink:
            decode_splits = decode_shrink_splits(pairs, hidden, decode_shrink_block_k(x.dtype))
            if rows == 1:  # the same splits with or without the alignment: the same bits
                decode_splits = one_token_shrink_splits(pairs, decode_splits, pairs * gemm1_n_tiles,
                                                         sm_count(x.device))
            shrunk_gate_up = torch.empty((pairs, decode_splits, 2 * rank_block), dtype=torch.float32,
                                         device=x.device)
            alignment = moe_align_with_gate_up_shrink(
                chunk_ids, cfg.block_m, num_experts, x[start:end], lora.gate_up_a, chunk_slots,
                lora.slot_ranks, rank_block=rank_block, out=shrunk_gate_up, align=not direct,
                release_next=overlap)
        elif not direct:
            alignment = moe_align_block_size(chunk_ids, cfg.block_m, num_experts)
        if direct:
            align = dict(direct_ids=chunk_ids.reshape(-1))
            max_padded = pairs * cfg.block_m
        else:
            align = dict(zip(("sorted_ids", "expert_ids", "num_post_padded"), alignment, strict=True))
            max_padded = alignment[0].shape[0]
        topk_sum = None
        if pair_out is not None and not staged and fused_topk_sum(rows, top_k):
            topk_sum = TopkSumOperands(
                out=out[start:end],
                counters=torch.empty((triton.cdiv(hidden, cfg.gemm2.block_n),), dtype=torch.int32,
                                     device=x.device),
                top_k=top_k)

        chunk_activated = activated[: rows * top_k]
        gemm2_late_wait = False
        gemm1_lora = gemm2_lora = None
        if lora is not None:
            common = dict(slot_ranks=lora.slot_ranks, slot_scalings=lora.slot_scalings, top_k=top_k,
                          rank_block=rank_block, token_slots=chunk_slots, num_adapters=lora.num_adapters)
            gemm1_lora = LoRAOperands(lora_a=lora.gate_up_a, lora_b=lora.gate_up_b, **common)
            gemm2_lora = LoRAOperands(lora_a=lora.down_a, lora_b=lora.down_b, **common)
        gemm1_weights = chunk_weights if apply_router_weight_on_input else None
        block_k = shrink_block_k(x.dtype)
        # Past decode, how the split path's two shrinks cover K: split (summed later), one pass, or a
        # program per slot.
        prefill_split, longest_k = split and not decode_shrink, max(hidden, intermediate)
        one_pass = prefill_split and one_split_shrink(
            pairs, rank_block, lora.num_adapters, shrink_row_programs(max_padded, cfg.block_m), longest_k)
        slot_programs = prefill_split and slot_program_shrink(lora.num_adapters, longest_k, pairs, one_pass)
        gate_up_splits, down_shrink_splits = (
            (1, 1) if one_pass or slot_programs  # one partial a pair either way
            else (shrink_k_splits(max_padded, cfg.block_m, hidden, block_k),
                  shrink_k_splits(max_padded, cfg.block_m, intermediate, block_k)))
        if (split or staged) and not decode_shrink:
            shrunk_gate_up = torch.empty((pairs, gate_up_splits, 2 * rank_block),
                                         dtype=torch.float32, device=x.device)
        if down_in_gemm1:
            shrunk_down = torch.empty((pairs, down_tiles, rank_block), dtype=torch.float32, device=x.device)
            gemm1_lora = replace(gemm1_lora, down_a=lora.down_a, down_shrunk=shrunk_down)
            gemm2_lora = replace(gemm2_lora, shrunk=shrunk_down)
        elif down_launch_direct:
            down_splits = one_token_down_splits(pairs, intermediate, rank_block,
                                                decode_shrink_block_k(x.dtype))
            shrunk_down = torch.empty((pairs, down_splits, rank_block), dtype=torch.float32, device=x.device)
        elif split or staged:
            shrunk_down = torch.empty((pairs, down_shrink_splits, rank_block),
                                      dtype=torch.float32, device=x.device)
        # Where lora_ext_expand says so (GEMM2's two-block prefill tiles), a GEMM takes its shrink packed
        # (summed, scaled, rounded) by a launch in the split sum's place and expands it in a K-loop of its
        # own over the block's slot range.
        ext_gate_up = split and not decode_shrink and lora_ext_expand(
            cfg.gemm1, gated=True, num_adapters=lora.num_adapters, K=hidden, elem_bytes=x.element_size())
        reduce_gate_up = (split and not decode_shrink and not ext_gate_up
                          and reduce_splits_pays(shrunk_gate_up.shape[1], gemm1_n_tiles))
        overlap_through_sum = lora is not None and overlap_through_split_sum(pairs, rank_block)
        gate_up_overlap = (shrink_launch_overlap and not decode_shrink
                           and (overlap_through_sum or not (reduce_gate_up or ext_gate_up)))
        if (split or staged) and not decode_shrink:
            moe_lora_a(x[start:end], lora.gate_up_a, chunk_slots, lora.slot_ranks, **align,
                       num_adapters=lora.num_adapters, block_m=cfg.block_m, top_k=top_k,
                       x_row_div=top_k, rank_block=rank_block, gated=True, slot_programs=slot_programs,
                       out=shrunk_gate_up, release_next=gate_up_overlap)
        if split:
            gemm1_lora = _with_epilogue_shrink(gemm1_lora, shrunk_gate_up, pack=ext_gate_up,
                                               reduce=reduce_gate_up, release_next=gate_up_overlap,
                                               dtype=x.dtype)
        if staged:
            invoke_fused_moe_kernel(x[start:end], w13, gemm1_raw[:pairs], topk_weights=gemm1_weights,
                                    a_row_div=top_k, config=cfg.gemm1, activation="gated_raw", **align)
            moe_lora_gate_up_b(gemm1_raw[:pairs], shrunk_gate_up, lora.gate_up_b, chunk_slots,
                               lora.slot_ranks, lora.slot_scalings, **align, block_m=cfg.block_m, top_k=top_k,
                               rank_block=rank_block, activation=activation, topk_weights=gemm1_weights,
                               out=chunk_activated)
        else:
            invoke_fused_moe_kernel(
                x[start:end],
                w13,
                chunk_activated,
                topk_weights=gemm1_weights,
                a_row_div=top_k,
                config=cfg.gemm1,
                activation=activation,
                lora=gemm1_lora,
                zero_counters=topk_sum,
                late_wait=overlap or gate_up_overlap,
                **align,
            )

        if down_launch_direct:
            one_token_down_shrink(chunk_activated, lora.down_a, chunk_ids, chunk_slots, lora.slot_ranks,
                                  rank_block=rank_block, out=shrunk_down, release_next=overlap)
            gemm2_lora = replace(gemm2_lora, shrunk=shrunk_down)
        elif split and not down_in_gemm1:
            ext_down = not decode_shrink and lora_ext_expand(
                cfg.gemm2, gated=False, num_adapters=lora.num_adapters, K=intermediate,
                elem_bytes=x.element_size())
            reduce_down = not decode_shrink and not ext_down and reduce_splits_pays(
                shrunk_down.shape[1], triton.cdiv(hidden, cfg.gemm2.block_n))
            gemm2_late_wait = shrink_launch_overlap and (overlap_through_sum or not (reduce_down or ext_down))
            moe_lora_a(chunk_activated, lora.down_a, chunk_slots, lora.slot_ranks, **align,
                       num_adapters=lora.num_adapters, block_m=cfg.block_m, top_k=top_k,
                       x_row_div=1, rank_block=rank_block, gated=False, slot_programs=slot_programs,
                       out=shrunk_down, release_next=gemm2_late_wait)
            gemm2_lora = _with_epilogue_shrink(gemm2_lora, shrunk_down, pack=ext_down, reduce=reduce_down,
                                               release_next=gemm2_late_wait, dtype=x.dtype)
        if no_combine:
            target = out[start:end].view(rows * top_k, hidden)
        elif top_k == 1:
            target = out[start:end]
        else:
            target = pair_out[: rows * top_k]
        invoke_fused_moe_kernel(
            chunk_activated,
            w2,
            target,
            topk_weights=None if apply_router_weight_on_input else chunk_weights,
            a_row_div=1,
            config=cfg.gemm2,
            scale=routed_scaling_factor,
            lora=None if staged else gemm2_lora,
            topk_sum=topk_sum,
            late_wait=(down_launch_direct and overlap) or gemm2_late_wait,
            dependent=split and direct and one_token_dependent_gemm2(x.device),
            **align,
        )
        if pair_out is not None and topk_sum is None:
            moe_sum_reduce(target.view(rows, top_k, hidden), 1.0, out=out[start:end])
        if staged:
            moe_lora_a(chunk_activated, lora.down_a, chunk_slots, lora.slot_ranks, **align,
                       num_adapters=lora.num_adapters, block_m=cfg.block_m, top_k=top_k,
                       x_row_div=1, rank_block=rank_block, gated=False,
                       out=shrunk_down)
            moe_lora_down_combine(shrunk_down, lora.down_b, chunk_slots, chunk_ids.contiguous(),
                                  None if apply_router_weight_on_input else chunk_weights.view(rows, top_k),
                                  lora.slot_ranks, lora.slot_scalings, out[start:end], rank_block=rank_block,
                                  routed_scaling_factor=routed_scaling_factor)
    if strided_target is not None:
        return strided_target.copy_(out)
    return out


def _with_epilogue_shrink(operands: LoRAOperands, partials: torch.Tensor, *, pack: bool, reduce: bool,
                          release_next: bool, dtype: torch.dtype) -> LoRAOperands:
    """``operands`` with the shrink its GEMM's epilogue reads from the split-K ``partials`` a ``moe_lora_a``
    launch wrote: packed (``pack_shrink_partials``, for ``lora_ext_expand``), summed once
    (``reduce_shrink_splits``), or as they are. ``release_next``: the launch that packs or sums releases the
    GEMM after it (the shrink overlap)."""
    slots, top_k = operands.token_slots, operands.top_k
    if pack:
        return replace(operands, packed=pack_shrink_partials(partials, slots, operands.slot_scalings,
                                                             slot_row_div=top_k, dtype=dtype,
                                                             release_next=release_next))
    if reduce:
        partials = reduce_shrink_splits(partials, slots, slot_row_div=top_k, release_next=release_next)
    return replace(operands, shrunk=partials)


def _with_lora_tiles(cfg: MoEConfig, inline_shrink: bool = True, rank_block: int = 16,
                     elem_bytes: int = 2) -> MoEConfig:
    """Fit a config tuned for the base GEMMs to their LoRA variants: the epilogue expand needs registers
    beside the accumulators (BLOCK_N <= 128), and the inline shrink also stages LoRA A tiles (BLOCK_K x
    rank, twice for gate/up) in shared memory (BLOCK_K <= 128, at most 3 stages, then fewer stages and a
    shorter BLOCK_K until the pipeline fits: a config tuned without LoRA may leave no room for them,
    e.g. H100 Mixtral M=256 128x64x128 x 3 stages at rank 64 asked for 288 KiB)."""
    def capped(gemm, gated: bool):
        gemm = replace(gemm, block_n=min(gemm.block_n, 128))
        if not inline_shrink:
            return gemm
        gemm = replace(gemm, block_k=min(gemm.block_k, 128), num_stages=min(gemm.num_stages, 3))
        tiles = 2 if gated else 1
        while pipeline_smem_bytes(gemm, b_tiles=tiles, lora_cols=tiles * rank_block,
                                  elem_bytes=elem_bytes) > MAX_SHARED_BYTES:
            if gemm.num_stages > 2:
                gemm = replace(gemm, num_stages=gemm.num_stages - 1)
            elif gemm.block_k > 32:
                gemm = replace(gemm, block_k=gemm.block_k // 2)
            else:
                break
        return gemm

    return MoEConfig(capped(cfg.gemm1, gated=True), capped(cfg.gemm2, gated=False))


def _check_lora_inputs(lora: MoELoRAInputs, x: torch.Tensor, w13: torch.Tensor, lora_path: str) -> None:
    if lora_path not in LORA_PATHS:
        raise ValueError(f"lora_path must be one of {LORA_PATHS}, got {lora_path!r}")
    num_experts, two_i, hidden = w13.shape
    slots, experts, two_r, lora_hidden = lora.gate_up_a.shape
    max_rank = two_r // 2
    expected = {
        "gate_up_a": (slots, num_experts, 2 * max_rank, hidden),
        "gate_up_b": (slots, num_experts, two_i, max_rank),
        "down_a": (slots, num_experts, max_rank, two_i // 2),
        "down_b": (slots, num_experts, hidden, max_rank),
    }
    for name, shape in expected.items():
        got = tuple(getattr(lora, name).shape)
        if got != shape:
            raise ValueError(
                f"LoRA buffer {name} must be {shape} for this layer (w13 {tuple(w13.shape)}), got {got}"
            )
        if getattr(lora, name).dtype != x.dtype:
            raise TypeError(
                f"LoRA buffer {name} must have x's dtype {x.dtype}, got {getattr(lora, name).dtype}"
            )
        if getattr(lora, name).device != x.device:
            raise ValueError(f"LoRA buffer {name} is on {getattr(lora, name).device}, x on {x.device}")
    if lora.token_slots.shape != (x.shape[0],) or lora.token_slots.dtype != torch.int32:
        raise ValueError(f"token_slots must be int32 ({x.shape[0]},), got {lora.token_slots.dtype} "
                         f"{tuple(lora.token_slots.shape)}")
    if lora.slot_ranks.shape != (slots,) or lora.slot_scalings.shape != (slots,):
        raise ValueError(f"slot_ranks and slot_scalings must be ({slots},)")
    if not 0 <= lora.max_rank <= max_rank:
        raise ValueError(f"max_rank {lora.max_rank} is outside the buffers' rank range [0, {max_rank}]")
