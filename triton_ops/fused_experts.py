"""The base fused MoE: alignment, GEMM1 with the gated activation in its epilogue, GEMM2, top-k combine.

Semantics:  out[t] = rsf * sum_j w[t, j] * W2[e_j] @ (act(W13[e_j, :I] @ x[t]) * (W13[e_j, I:] @ x[t]))
            with e_j = topk_ids[t, j]; with apply_router_weight_on_input, w scales x before GEMM1 instead.
Launches:   moe_align_block_size (3) -> GEMM1+activation -> GEMM2 (routed weight, rsf) -> top-k sum
            (the sum is skipped for top_k == 1 and for no_combine, where GEMM2 writes the output).
            Decode (<= 128 routed pairs): the alignment is one launch. One token: no alignment
            (``decode_direct_pairs``) and the top-k sum at the end of GEMM2 (``fused_topk_sum``), so the
            base layer is GEMM1 -> GEMM2.

No step reads a device value on the host, so a call with a fixed token count can be captured in a CUDA
graph. Very large batches are processed in chunks of ``moe_chunk_tokens`` tokens (default
32768) to bound the intermediate buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from triton_ops import overrides
from triton_ops.configs import (
    MAX_SHARED_BYTES,
    MoEConfig,
    device_name,
    get_moe_config,
    pipeline_smem_bytes,
    tuned_moe_config,
)
from triton_ops.decode_shrink import (
    decode_shrink_block_k,
    decode_shrink_splits,
    moe_align_with_gate_up_shrink,
    one_token_down_shrink,
    one_token_down_splits,
)
from triton_ops.fp8 import FP8_DTYPE, BlockFp8Weights, check_block_fp8, quantize_fp8_groups, uses_block_fp8
from triton_ops.fused_moe import (
    LoRAOperands,
    TopkSumOperands,
    activation_args,
    invoke_fused_moe_kernel,
)
from triton_ops.hostmath import cdiv
from triton_ops.launch import active_cache, not_replayable
from triton_ops.lora_weights import LoRAWeights, lora_weights
from triton_ops.moe_align import (
    SINGLE_PROGRAM_MAX_PAIRS,
    adapter_max_padded,
    align_by_adapter,
    max_padded_size,
    moe_align_block_size,
)
from triton_ops.moe_inputs import check_moe_inputs, gate_up_dims
from triton_ops.moe_lora import (
    moe_lora_a,
    moe_lora_down_b,
    moe_lora_down_combine,
    moe_lora_gate_up_b,
    shrink_block_k,
    shrink_k_splits,
    shrink_row_programs,
)
from triton_ops.moe_sum import moe_sum_reduce
from triton_ops.mxfp4 import Mxfp4Weights, check_mxfp4_experts, untuned_block_k
from triton_ops.pdl import (
    decode_shrink_overlap,
    dependent_fp8_decode,
    prefill_shrink_overlap,
)
from triton_ops.plan import (  # noqa: F401  (the launch rules, importable from here as before)
    ADAPTER_BLOCK_M,
    LONG_K_SLOT_GROUP_MIN_K,
    MAX_DECODE_DOWN_PARTIALS,
    MAX_DOWN_PARTIALS,
    ONE_SPLIT_SHRINK_MANY_PASSES,
    ONE_SPLIT_SHRINK_MANY_PASSES_MIN_PAIRS,
    ONE_SPLIT_SHRINK_MAX_PASSES,
    ONE_SPLIT_SHRINK_MIN_ROW_PROGRAMS,
    ONE_TOKEN_SHRINK_MIN_SPLITS,
    PREFILL_OVERLAP_SPLIT_SUM_MIN_PAIRS,
    PREFILL_OVERLAP_SPLIT_SUM_MIN_RANK,
    SLOT_PROGRAM_OVER_ONE_PASS_MAX_PAIRS,
    SLOT_PROGRAM_OVER_ONE_PASS_MIN_ADAPTERS,
    SLOT_PROGRAM_SHRINK_MIN_ADAPTERS,
    SPARSE_ALIGN_MIN_EXPERT_BYTES,
    decode_direct_pairs,
    decode_down_partials_limit,
    expand_whole_rows,
    fp8_lora_takes_bf16_tiles,
    fused_topk_sum,
    lora_by_adapter,
    lora_ext_expand,
    lora_rank_block,
    one_split_shrink,
    one_token_shrink_splits,
    overlap_through_split_sum,
    slot_program_shrink,
    sm_count,
    sparse_routing_aligns,
)
from triton_ops.shrink_reduce import pack_shrink_partials, reduce_shrink_splits, reduce_splits_pays

LORA_PATHS = ("fused", "split", "staged")


@dataclass(frozen=True)
class MoELoRAInputs:
    """One layer's adapter buffers (docs/design.md §2) plus the batch's slot per token.

    ``max_rank`` is the largest real rank among the slots this batch uses (known on the host): it sets
    the rank tile, so a batch of rank-8 adapters in a max-rank-64 pool does rank-8 (tile 16) work.
    """

    token_slots: torch.Tensor  # (M,) int32, -1 = no adapter
    # LoRAWeights (the pool's block tables), or dense tensors: gate_up_a (L, E, 2R, H), gate_up_b
    # (L, E, 2I, R), down_a (L, E, R, I), down_b (L, E, H, R)
    gate_up_a: torch.Tensor | LoRAWeights
    gate_up_b: torch.Tensor | LoRAWeights
    down_a: torch.Tensor | LoRAWeights
    down_b: torch.Tensor | LoRAWeights
    slot_ranks: torch.Tensor  # (L,) int32
    slot_scalings: torch.Tensor  # (L,) fp32
    max_rank: int
    # Distinct adapters in the batch (host-known; 0 = unknown). Only a launch hint: how many slots the
    # kernels set side by side per pass (one adapter: one, so no stacked tile is wasted).
    num_adapters: int = 0
    # Whether every token slot is known to lie in [-1, L) and every slot rank in [0, the buffers' rank]
    # (a pool's batch): the kernels then index the slot tables with them as they are. Otherwise
    # ``fused_experts`` first maps slots outside [0, L) to -1 (no adapter) and clamps the ranks, in two
    # device operations (no host sync), so no id or rank a caller passes makes a kernel read out of bounds.
    slots_checked: bool = False

def _chunk_tokens() -> int:
    forced = overrides.count("moe_chunk_tokens")
    return max(1, forced) if forced is not None else 32768


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    inplace: bool = False,
    activation: Any = "silu",
    apply_router_weight_on_input: bool = False,
    routed_scaling_factor: float = 1.0,
    no_combine: bool = False,
    config: MoEConfig | None = None,
    lora: MoELoRAInputs | None = None,
    lora_path: str = "fused",
    sparse_routing: bool = False,
    fp8: BlockFp8Weights | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    mxfp4: Mxfp4Weights | None = None,
) -> torch.Tensor:
    """Runs the routed experts of one MoE layer (see the module docstring for the math).

    Args:
        x: (M, H) float16/bfloat16/float32 activations.
        w13: (E, 2I, H), rows [0, I) gate and [I, 2I) up, or a (E, 2, I, H) halves view
            (``moe_inputs.is_gate_up_halves``); w2: (E, H, I); same dtype as x; any strides.
        topk_weights: (M, top_k) routing weights (float32; other float dtypes are upcast).
        topk_ids: (M, top_k) int32/int64 expert ids in [0, E) (not checked on the device).
        inplace: write the result into x and return x.
        activation: the gated activation: "silu", "gelu" (exact), "gelu_tanh" or a
            ``moelora.activations.GatedActivation`` (the clamped SwiGLUs; ``activation_args``).
        apply_router_weight_on_input: scale x by the routing weight before GEMM1 (top_k == 1 models).
        routed_scaling_factor: rsf, multiplies the combined output.
        no_combine: return (M, top_k, H) per-pair outputs rsf * w * y instead of their sum.
        config: force a launch config (default: ``triton_ops.configs.get_moe_config``); on the split LoRA
            path its LoRA tiles for the rank tile and ``lora.num_adapters`` when it has them.
        lora: per-token adapter deltas (docs/design.md §1: gate/up before the activation, down after it).
        lora_path: "fused" (shrinks in the GEMM K-loops, expands in their epilogues: the base path's
            launches), "split" (each shrink once per pair by ``moe_lora_a``, expands in the GEMM
            epilogues: two more launches, no recomputation across N tiles; at decode the gate/up
            shrink rides in the alignment's launch and, up to ``MAX_DOWN_PARTIALS`` GEMM1 N tiles, the
            down shrink in GEMM1's epilogue, so decode has the base path's launches (one token past that
            many: a GEMV launch between the GEMMs, ``one_token_down_shrink``, still no alignment); where
            many N tiles would each re-sum a shrink's split-K partials, ``reduce_shrink_splits`` sums them
            once first, or ``pack_shrink_partials`` packs them for ``lora_ext_expand``) or "staged"
            (separate shrink / gate_up+act / down+combine kernels, seed 002's interface).
        sparse_routing: many pairs name experts outside [0, E) (an expert-parallel rank, whose ids of other
            ranks' experts are -1): where experts are large (``sparse_routing_aligns``) one token is aligned
            too, so those pairs take null blocks that read nothing, instead of a GEMM program each.
        fp8: the block scales of float8_e4m3fn ``w13`` / ``w2`` (``triton_ops.fp8``): both GEMMs then
            read x and the activated intermediate quantized per token and ``block_k`` group (one launch
            each), while the LoRA shrinks read them unquantized; lora_path "split" or "staged".
        w13_bias, w2_bias: (E, 2I) and (E, H) expert biases in x's dtype (gpt-oss): gu = W13 x + b13 before
            the activation, y = W2 h + b2 inside the routed weight (each with its LoRA delta).
        mxfp4: the E8M0 scales of MXFP4 experts (``triton_ops.mxfp4.Mxfp4Weights``): ``w13`` and ``w2`` are
            then their packed uint8 E2M1 blocks, (E, 2I, H / 2) and (E, H, I / 2), which the GEMMs decode
            in their K-loops (x and the LoRA stay in x's dtype; every LoRA path).
    """
    block_scaled = fp8 is not None or uses_block_fp8(w13, w2)
    if mxfp4 is not None:
        if block_scaled:
            raise ValueError("pass fp8= or mxfp4=, not both: the experts are in one format")
        check_moe_inputs(x, w13, w2, topk_weights, topk_ids, weight_dtype=torch.uint8, values_per_element=2)
        check_mxfp4_experts(w13, w2, mxfp4)
    else:
        check_moe_inputs(x, w13, w2, topk_weights, topk_ids, weight_dtype=FP8_DTYPE if block_scaled else None)
    if block_scaled:
        check_block_fp8(w13, w2, fp8)
        if lora is not None and lora_path == "fused":
            raise ValueError("FP8 experts take lora_path 'split' or 'staged': the fused path's shrink rides "
                             "on the GEMM's a tiles, the FP8 copy of x, and the LoRA must read x itself "
                             "(docs/design.md §1)")
    activation_args(activation)  # raises for an unknown one
    _check_biases(w13, w2, x, w13_bias, w2_bias)
    if inplace and no_combine:
        raise ValueError("inplace and no_combine cannot be combined: the outputs have different shapes")
    if lora is not None:
        lora = _check_lora_inputs(lora, x, w13, lora_path)
        if lora_path == "staged" and no_combine:
            raise ValueError("no_combine needs lora_path='fused': the staged down kernel sums the top-k")

    # The kernels address x and the outputs as row-major: any other layout is copied (and, in place,
    # copied back at the end).
    strided_target = x if inplace and not x.is_contiguous() else None
    if not x.is_contiguous():
        x = x.contiguous()

    num_tokens, hidden = x.shape
    num_experts, two_i, _ = gate_up_dims(w13)
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
        # input of the base path's fused epilogue and come out bit for bit equal to it (docs/design.md §1).
        gemm1_raw = torch.empty((chunk * top_k, two_i), dtype=torch.float32, device=x.device)
    scale_block_n, scale_block_k = fp8.block_shape if block_scaled else (0, 0)
    gemm1_quant = gemm2_quant = {}
    if mxfp4 is not None:  # the GEMMs' scale operands; nothing else changes for packed weights
        gemm1_quant, gemm2_quant = dict(b_scale=mxfp4.w13_scale), dict(b_scale=mxfp4.w2_scale)
    if block_scaled:
        # The GEMMs' copies of x and of the activated intermediate; the LoRA shrinks read the originals.
        x_q = torch.empty_like(x, dtype=FP8_DTYPE)
        x_scale = torch.empty((num_tokens, cdiv(hidden, scale_block_k)), dtype=torch.float32, device=x.device)
        h_q = torch.empty((chunk * top_k, intermediate), dtype=FP8_DTYPE, device=x.device)
        h_scale = torch.empty((chunk * top_k, cdiv(intermediate, scale_block_k)), dtype=torch.float32,
                              device=x.device)

    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        rows = end - start
        plan = _chunk_plan(rows, top_k, num_experts, hidden, intermediate, x.dtype, x.device, lora=lora,
                           lora_path=lora_path, config=config, combine=pair_out is not None,
                           sparse_routing=sparse_routing, scale_block_k=scale_block_k,
                           mxfp4=mxfp4 is not None)
        cfg = plan.config
        chunk_ids = topk_ids[start:end]
        chunk_weights = topk_weights[start:end].reshape(-1)
        if not chunk_weights.is_contiguous():
            chunk_weights = chunk_weights.contiguous()
        pairs = rows * top_k
        if block_scaled:
            # Before any launch GEMM1 may be scheduled early after: GEMM1 reads x_q before a late wait.
            quantize_fp8_groups(x[start:end], scale_block_k, out=x_q[start:end], scales=x_scale[start:end],
                                release_next=plan.fp8_chain)
        if lora is not None:
            chunk_slots = lora.token_slots[start:end]
        if plan.decode_shrink:
            shrunk_gate_up = torch.empty((pairs, plan.gate_up_splits, 2 * rank_block), dtype=torch.float32,
                                         device=x.device)
            alignment = moe_align_with_gate_up_shrink(
                chunk_ids, cfg.block_m, num_experts, x[start:end], lora.gate_up_a, chunk_slots,
                lora.slot_ranks, rank_block=rank_block, out=shrunk_gate_up, align=not plan.direct,
                release_next=plan.decode_overlap, dependent=plan.fp8_chain)
        elif not plan.direct:
            # with the run starts where the LoRA launches split each expert's run by adapter
            alignment = moe_align_block_size(chunk_ids, cfg.block_m, num_experts, with_starts=plan.by_adapter)
        if plan.direct:
            align = dict(direct_ids=chunk_ids.reshape(-1))
        else:
            align = dict(zip(("sorted_ids", "expert_ids", "num_post_padded"), alignment[:3], strict=True))
        topk_sum = None
        if plan.fused_sum:
            topk_sum = TopkSumOperands(
                out=out[start:end],
                counters=torch.empty((cdiv(hidden, cfg.gemm2.block_n),), dtype=torch.int32,
                                     device=x.device),
                top_k=top_k)

        chunk_activated = activated[: rows * top_k]
        gemm1_a = x[start:end]
        if block_scaled:
            gemm1_a = x_q[start:end]
            gemm1_quant = dict(a_scale=x_scale[start:end], b_scale=fp8.w13_scale, scale_block_n=scale_block_n)
            gemm2_quant = dict(a_scale=h_scale[:pairs], b_scale=fp8.w2_scale, scale_block_n=scale_block_n)
        gemm1_lora = gemm2_lora = None
        if lora is not None:
            common = dict(slot_ranks=lora.slot_ranks, slot_scalings=lora.slot_scalings, top_k=top_k,
                          rank_block=rank_block, token_slots=chunk_slots, num_adapters=lora.num_adapters)
            gemm1_lora = LoRAOperands(lora_a=lora.gate_up_a, lora_b=lora.gate_up_b, **common)
            gemm2_lora = LoRAOperands(lora_a=lora.down_a, lora_b=lora.down_b, **common)
        gemm1_weights = chunk_weights if apply_router_weight_on_input else None
        if (split or staged) and not plan.decode_shrink:
            shrunk_gate_up = torch.empty((pairs, plan.gate_up_splits, 2 * rank_block),
                                         dtype=torch.float32, device=x.device)
        if split or staged:
            shrunk_down = torch.empty((pairs, plan.down_splits, rank_block), dtype=torch.float32,
                                      device=x.device)
        if plan.down_in_gemm1:
            gemm1_lora.down_a, gemm1_lora.down_shrunk = lora.down_a, shrunk_down
            gemm2_lora.shrunk = shrunk_down
        # The LoRA launches' alignment: the GEMMs' expert blocks, or one adapter's rows a block (so its
        # shrinks stack no slots side by side: one adapter a block).
        # On pairs grouped by adapter the LoRA launches take each pair's group slot (``top_k`` 1): on the
        # staged path, where they are all the LoRA launches, no slot for an expert its adapter does not
        # train (a pool's arena), so those pairs cost them nothing.
        lora_align, lora_block_m = align, cfg.block_m
        lora_slots, lora_top_k = (chunk_slots, top_k) if lora is not None else (None, top_k)
        shrink_adapters = lora.num_adapters if lora is not None else 0
        if plan.by_adapter:
            lora_block_m, shrink_adapters, lora_top_k = ADAPTER_BLOCK_M, 1, 1
            table = lora.gate_up_a.blocks if staged and lora.gate_up_a.zero_unit_empty else None
            *grouped, lora_slots = align_by_adapter(chunk_ids, chunk_slots, lora_block_m, num_experts,
                                                    lora.slot_ranks.numel(), expert_alignment=alignment,
                                                    untrained_table=table)
            lora_align = dict(zip(("sorted_ids", "expert_ids", "num_post_padded"), grouped, strict=True))
        if (split or staged) and not plan.decode_shrink:
            moe_lora_a(x[start:end], lora.gate_up_a, lora_slots, lora.slot_ranks, **lora_align,
                       num_adapters=shrink_adapters, block_m=lora_block_m, top_k=lora_top_k, x_row_div=top_k,
                       rank_block=rank_block, gated=True, slot_programs=plan.slot_programs,
                       out=shrunk_gate_up, release_next=plan.gate_up_overlap)
        if split:
            gemm1_lora = _with_epilogue_shrink(gemm1_lora, shrunk_gate_up, pack=plan.pack_gate_up,
                                               reduce=plan.reduce_gate_up, release_next=plan.gate_up_overlap,
                                               dtype=x.dtype)
        if staged:
            invoke_fused_moe_kernel(gemm1_a, w13, gemm1_raw[:pairs], topk_weights=gemm1_weights,
                                    a_row_div=top_k, config=cfg.gemm1, activation="gated_raw", bias=w13_bias,
                                    **align, **gemm1_quant)
            moe_lora_gate_up_b(gemm1_raw[:pairs], shrunk_gate_up, lora.gate_up_b, lora_slots,
                               lora.slot_ranks, lora.slot_scalings, **lora_align, block_m=lora_block_m,
                               top_k=lora_top_k,
                               rank_block=rank_block, activation=activation, topk_weights=gemm1_weights,
                               out=chunk_activated, whole_rows=expand_whole_rows(plan.by_adapter))
        else:
            invoke_fused_moe_kernel(
                gemm1_a,
                w13,
                chunk_activated,
                topk_weights=gemm1_weights,
                a_row_div=top_k,
                config=cfg.gemm1,
                activation=activation,
                lora=gemm1_lora,
                zero_counters=topk_sum,
                bias=w13_bias,
                late_wait=plan.gemm1_late_wait,
                dependent=plan.fp8_chain and lora is None,
                **align,
                **gemm1_quant,
            )
        gemm2_a = chunk_activated
        if block_scaled:
            # Before the down shrink's launch: a GEMM2 launched early (late_wait) reads h_q before its wait.
            gemm2_a, _ = quantize_fp8_groups(chunk_activated, scale_block_k, out=h_q[:pairs],
                                             scales=h_scale[:pairs], dependent=plan.fp8_chain)

        if plan.down_gemv:
            one_token_down_shrink(chunk_activated, lora.down_a, chunk_ids, chunk_slots, lora.slot_ranks,
                                  rank_block=rank_block, out=shrunk_down, release_next=plan.decode_overlap)
            gemm2_lora.shrunk = shrunk_down
        elif split and not plan.down_in_gemm1:
            moe_lora_a(chunk_activated, lora.down_a, lora_slots, lora.slot_ranks, **lora_align,
                       num_adapters=shrink_adapters, block_m=lora_block_m, top_k=lora_top_k, x_row_div=1,
                       rank_block=rank_block, gated=False, slot_programs=plan.slot_programs,
                       out=shrunk_down, release_next=plan.down_overlap)
            gemm2_lora = _with_epilogue_shrink(gemm2_lora, shrunk_down, pack=plan.pack_down,
                                               reduce=plan.reduce_down, release_next=plan.down_overlap,
                                               dtype=x.dtype)
        if no_combine:
            target = out[start:end].view(rows * top_k, hidden)
        elif top_k == 1:
            target = out[start:end]
        else:
            target = pair_out[: rows * top_k]
        invoke_fused_moe_kernel(
            gemm2_a,
            w2,
            target,
            topk_weights=None if apply_router_weight_on_input else chunk_weights,
            a_row_div=1,
            config=cfg.gemm2,
            scale=routed_scaling_factor,
            lora=None if staged else gemm2_lora,
            topk_sum=topk_sum,
            bias=w2_bias,
            late_wait=plan.gemm2_late_wait,
            dependent=plan.fp8_chain,
            **align,
            **gemm2_quant,
        )
        if staged:
            moe_lora_a(chunk_activated, lora.down_a, lora_slots, lora.slot_ranks, **lora_align,
                       num_adapters=shrink_adapters, block_m=lora_block_m, top_k=lora_top_k, x_row_div=1,
                       rank_block=rank_block, gated=False,
                       out=shrunk_down)
        if staged and plan.by_adapter:  # each pair's delta into GEMM2's rows, before the top-k sum
            moe_lora_down_b(target, shrunk_down, lora.down_b, lora_slots, lora.slot_ranks,
                            lora.slot_scalings, **lora_align, block_m=lora_block_m, top_k=lora_top_k,
                            rank_block=rank_block,
                            topk_weights=None if apply_router_weight_on_input else chunk_weights,
                            routed_scaling_factor=routed_scaling_factor,
                            whole_rows=expand_whole_rows(plan.by_adapter))
        if pair_out is not None and topk_sum is None:
            moe_sum_reduce(target.view(rows, top_k, hidden), 1.0, out=out[start:end])
        if staged and not plan.by_adapter:
            moe_lora_down_combine(shrunk_down, lora.down_b, chunk_slots, chunk_ids.contiguous(),
                                  None if apply_router_weight_on_input else chunk_weights.view(rows, top_k),
                                  lora.slot_ranks, lora.slot_scalings, out[start:end], rank_block=rank_block,
                                  routed_scaling_factor=routed_scaling_factor)
    if strided_target is not None:
        return strided_target.copy_(out)
    return out


def _check_biases(w13: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, w13_bias: torch.Tensor | None,
                  w2_bias: torch.Tensor | None) -> None:
    """Raises ValueError/TypeError unless the biases are (E, 2I) / (E, H) in x's dtype on x's device."""
    for name, bias, expected in (("w13_bias", w13_bias, gate_up_dims(w13)[:2]),
                                 ("w2_bias", w2_bias, w2.shape[:2])):
        if bias is None:
            continue
        if tuple(bias.shape) != tuple(expected) or bias.device != x.device:
            raise ValueError(f"{name} must be {tuple(expected)} on {x.device}, got {tuple(bias.shape)} on "
                             f"{bias.device}")
        if bias.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {bias.dtype}")
        if bias.stride(1) != 1:
            raise ValueError(f"{name} must have contiguous rows, got strides {bias.stride()}")


@dataclass(frozen=True)
class ChunkPlan:
    """Every launch decision of one chunk of ``fused_experts``: a function of host-known sizes only (token
    count, top-k, shapes, dtype, device, LoRA path, rank tile, adapter count), never of device values.

    Attributes:
        config: the GEMM tiles (tuned lookup or ``config=``; with LoRA tiles for the split/fused paths).
        direct: one decode token: each routed pair is a GEMM block of its own, no alignment.
        decode_shrink: split path at decode: GEMM1's shrink rides in the alignment's launch (or, direct,
            is that launch).
        decode_overlap: GEMM1 (and a down GEMV's GEMM2) streams its base weights while the decode shrink
            launch before it runs (``late_wait``).
        down_in_gemm1: GEMM2's shrink is written by GEMM1's epilogue, one partial per GEMM1 N tile.
        down_gemv: one token whose down shrink does not fit GEMM1's epilogue: a GEMV launch between the GEMMs.
        fused_sum: GEMM2's last program per column sums the top-k (no top-k sum launch).
        gate_up_splits, down_splits: K splits of the two shrinks' fp32 partials (their second dim).
        slot_programs: the prefill shrink runs a program per slot group of each block.
        pack_gate_up, pack_down: the GEMM takes its shrink packed and expands a slot range
            (``lora_ext_expand``).
        reduce_gate_up, reduce_down: the split-K partials are summed once before the GEMM.
        gate_up_overlap, down_overlap: the shrink launch before a GEMM (and its split sum) releases it early.
        gemm1_late_wait, gemm2_late_wait: the GEMM is launched dependently, waiting after its K-loop.
        by_adapter: the shrinks (and on the staged path the expands) run on pairs grouped by (expert,
            adapter) (``lora_by_adapter``), the GEMMs on the expert blocks.
        fp8_chain: one token's FP8 quantizations are links of a dependent-launch chain
            (``dependent_fp8_decode``): x quantization -> GEMM1 -> h quantization -> GEMM2, with adapters
            (split path) x quantization -> gate/up shrink (GEMM1 after it as before) -> ... .
    """

    config: MoEConfig
    direct: bool
    decode_shrink: bool = False
    decode_overlap: bool = False
    down_in_gemm1: bool = False
    down_gemv: bool = False
    fused_sum: bool = False
    gate_up_splits: int = 1
    down_splits: int = 1
    slot_programs: bool = False
    pack_gate_up: bool = False
    pack_down: bool = False
    reduce_gate_up: bool = False
    reduce_down: bool = False
    gate_up_overlap: bool = False
    down_overlap: bool = False
    gemm1_late_wait: bool = False
    gemm2_late_wait: bool = False
    by_adapter: bool = False
    fp8_chain: bool = False


def plan_chunk(rows: int, top_k: int, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
               device: torch.device, *, lora: MoELoRAInputs | None, lora_path: str,
               config: MoEConfig | None, combine: bool, sparse_routing: bool = False,
               scale_block_k: int = 0, mxfp4: bool = False) -> ChunkPlan:
    """The launch decisions of one ``fused_experts`` chunk of ``rows`` tokens (see :class:`ChunkPlan`).
    ``combine``: the routed pairs' outputs are summed over the top-k (not ``no_combine``, top_k > 1).
    ``sparse_routing``: where ``sparse_routing_aligns``, no direct pairs (and so no fused top-k sum):
    other ranks' pairs are null blocks. ``scale_block_k``: block-scaled FP8 GEMMs, whose K step is the
    scale group (``triton_ops.fp8``). ``mxfp4``: MXFP4 weights, whose K steps span whole scale groups (32)."""
    split = lora is not None and lora_path == "split"
    staged = lora is not None and lora_path == "staged"
    rank_block = lora_rank_block(lora.max_rank) if lora is not None else 0
    num_adapters = lora.num_adapters if lora is not None else 0
    elem_bytes = dtype.itemsize
    mxfp4_tuned = False
    if config is not None:
        cfg = config.for_lora(rank_block, num_adapters) if split else config
    else:
        # FP8 GEMMs read their own tuned files (dtype "fp8_w8a8"), else the heuristic's tiles.
        bf16_tiles = not scale_block_k or (split and fp8_lora_takes_bf16_tiles(rows))
        tiles_dtype = dtype if bf16_tiles else FP8_DTYPE
        mxfp4_tuned = mxfp4 and tuned_moe_config(rows, num_experts, intermediate, torch.uint8,
                                                 device_name(device)) is not None
        if mxfp4_tuned:
            tiles_dtype = torch.uint8  # the MXFP4 GEMMs' own tuned file (dtype "mxfp4_w4a16")
        cfg = get_moe_config(rows, num_experts, hidden, intermediate, top_k, tiles_dtype, device, lora=split,
                             rank_block=rank_block if split else 0, num_adapters=num_adapters if split else 0)
    if lora is not None and lora_path == "fused":
        cfg = _with_lora_tiles(cfg, rank_block=rank_block, elem_bytes=elem_bytes)
    if scale_block_k:
        cfg = replace(cfg, gemm1=replace(cfg.gemm1, block_k=scale_block_k),
                      gemm2=replace(cfg.gemm2, block_k=scale_block_k))
    if mxfp4 and not mxfp4_tuned:
        cfg = replace(cfg, gemm1=replace(cfg.gemm1, block_k=untuned_block_k(cfg.gemm1.block_k)),
                      gemm2=replace(cfg.gemm2, block_k=untuned_block_k(cfg.gemm2.block_k)))
    pairs = rows * top_k
    align_sparse = sparse_routing and sparse_routing_aligns(hidden, intermediate, elem_bytes)
    direct = (not staged and not align_sparse and pairs <= SINGLE_PROGRAM_MAX_PAIRS
              and decode_direct_pairs(rows))
    fused_sum = combine and not staged and not align_sparse and fused_topk_sum(rows, top_k)
    fp8_chain = (bool(scale_block_k) and direct and (lora is None or split)
                 and dependent_fp8_decode(device))
    if lora is None or lora_path == "fused":
        return ChunkPlan(config=cfg, direct=direct, fused_sum=fused_sum, fp8_chain=fp8_chain)

    # Decode on the split path: GEMM1's shrink rides in the alignment's launch (or, for one token, whose
    # GEMMs need no alignment, is that launch).
    decode_shrink = split and pairs <= SINGLE_PROGRAM_MAX_PAIRS
    gemm1_n_tiles = cdiv(intermediate, cfg.gemm1.block_n)
    # GEMM2's shrink in GEMM1's epilogue (one partial per GEMM1 N tile) instead of its own launch. GEMM2
    # sums (rows, tiles, rank_block) fp32 partials: bounded by tiles x rank, not tiles alone.
    partial_width = gemm1_n_tiles * rank_block
    down_in_gemm1 = decode_shrink and (
        partial_width <= MAX_DOWN_PARTIALS * 16
        or (pairs <= 32 and partial_width <= decode_down_partials_limit() * 16))
    decode_overlap = decode_shrink and direct and decode_shrink_overlap(device)
    down_gemv = split and direct and not down_in_gemm1
    # Aligned batches: each GEMM streams its base weights while the moe_lora_a shrink launch before it
    # (and the split-sum launch after that shrink, ``overlap_through_split_sum``) runs. At decode only
    # GEMM2 has one (when the down shrink does not fit GEMM1's epilogue): the gate/up shrink rides in the
    # alignment's launch.
    shrink_launch_overlap = split and not direct and prefill_shrink_overlap(device)

    max_padded = pairs * cfg.block_m if direct else max_padded_size(pairs, num_experts, cfg.block_m)
    # Past decode, how the shrinks cover K: split (summed later), one pass, or a program per slot.
    prefill_split, longest_k = split and not decode_shrink, max(hidden, intermediate)
    one_pass = prefill_split and one_split_shrink(
        pairs, rank_block, num_adapters, shrink_row_programs(max_padded, cfg.block_m), longest_k)
    slot_programs = prefill_split and slot_program_shrink(num_adapters, longest_k, pairs, one_pass)
    block_k = shrink_block_k(dtype)
    # The shrinks (and the staged expands) on pairs grouped by adapter: one adapter a block, so no slot
    # programs, and K splits counted on that alignment's many more row programs.
    by_adapter = (staged or prefill_split) and lora_by_adapter(num_adapters)
    if by_adapter:
        one_pass = slot_programs = False
        max_padded = adapter_max_padded(pairs, num_experts, lora.slot_ranks.numel(), ADAPTER_BLOCK_M)
    shrink_block = ADAPTER_BLOCK_M if by_adapter else cfg.block_m
    if one_pass or slot_programs:  # one partial a pair either way
        gate_up_splits = down_shrink_splits = 1
    else:
        gate_up_splits = shrink_k_splits(max_padded, shrink_block, hidden, block_k)
        down_shrink_splits = shrink_k_splits(max_padded, shrink_block, intermediate, block_k)
    if decode_shrink:
        gate_up_splits = decode_shrink_splits(pairs, hidden, decode_shrink_block_k(dtype))
        if rows == 1:  # the same splits with or without the alignment: the same bits
            gate_up_splits = one_token_shrink_splits(pairs, gate_up_splits, pairs * gemm1_n_tiles,
                                                     sm_count(device))
    if down_in_gemm1:
        down_splits = gemm1_n_tiles
    elif down_gemv:
        down_splits = one_token_down_splits(pairs, intermediate, rank_block, decode_shrink_block_k(dtype))
    else:
        down_splits = down_shrink_splits

    overlap_through_sum = overlap_through_split_sum(pairs, rank_block)
    # The GEMMs' tiles are one byte an element with FP8 experts.
    gemm_bytes = 1 if scale_block_k else elem_bytes
    pack_gate_up = split and not decode_shrink and lora_ext_expand(
        cfg.gemm1, gated=True, num_adapters=num_adapters, K=hidden, elem_bytes=gemm_bytes,
        block_scaled=bool(scale_block_k))
    reduce_gate_up = (split and not decode_shrink and not pack_gate_up
                      and reduce_splits_pays(gate_up_splits, gemm1_n_tiles))
    gate_up_overlap = (shrink_launch_overlap and not decode_shrink
                       and (overlap_through_sum or not (reduce_gate_up or pack_gate_up)))
    pack_down = reduce_down = down_overlap = False
    if split and not down_in_gemm1 and not down_gemv:
        pack_down = not decode_shrink and lora_ext_expand(
            cfg.gemm2, gated=False, num_adapters=num_adapters, K=intermediate, elem_bytes=gemm_bytes,
            block_scaled=bool(scale_block_k))
        reduce_down = not decode_shrink and not pack_down and reduce_splits_pays(
            down_splits, cdiv(hidden, cfg.gemm2.block_n))
        down_overlap = shrink_launch_overlap and (overlap_through_sum or not (reduce_down or pack_down))
    return ChunkPlan(
        config=cfg, direct=direct, decode_shrink=decode_shrink, decode_overlap=decode_overlap,
        down_in_gemm1=down_in_gemm1, down_gemv=down_gemv, fused_sum=fused_sum, gate_up_splits=gate_up_splits,
        down_splits=down_splits, slot_programs=slot_programs, pack_gate_up=pack_gate_up, pack_down=pack_down,
        reduce_gate_up=reduce_gate_up, reduce_down=reduce_down, gate_up_overlap=gate_up_overlap,
        down_overlap=down_overlap, gemm1_late_wait=decode_overlap or gate_up_overlap,
        gemm2_late_wait=(down_gemv and decode_overlap) or down_overlap,
        by_adapter=by_adapter,
        fp8_chain=fp8_chain,
    )


def _chunk_plan(rows: int, top_k: int, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
                device: torch.device, *, lora: MoELoRAInputs | None, lora_path: str, config: MoEConfig | None,
                combine: bool, sparse_routing: bool, scale_block_k: int = 0, mxfp4: bool = False
                ) -> ChunkPlan:
    """``plan_chunk``, made once per key in the active ``LaunchCache`` (its owner's calls repeat it), else
    every call."""
    args = (rows, top_k, num_experts, hidden, intermediate, dtype, device)
    kwargs = dict(lora=lora, lora_path=lora_path, config=config, combine=combine,
                  sparse_routing=sparse_routing, scale_block_k=scale_block_k, mxfp4=mxfp4)
    cache = active_cache()
    if cache is None:
        return plan_chunk(*args, **kwargs)
    lora_key = None if lora is None else (lora_path, lora_rank_block(lora.max_rank), lora.num_adapters)
    return cache.plan(("chunk", *args, lora_key, config, combine, sparse_routing, scale_block_k, mxfp4),
                      lambda: plan_chunk(*args, **kwargs))


def _with_epilogue_shrink(operands: LoRAOperands, partials: torch.Tensor, *, pack: bool, reduce: bool,
                          release_next: bool, dtype: torch.dtype) -> LoRAOperands:
    """``operands``, given in place the shrink its GEMM's epilogue reads from the split-K ``partials`` a
    ``moe_lora_a`` launch wrote: packed (``pack_shrink_partials``, for ``lora_ext_expand``), summed once
    (``reduce_shrink_splits``), or as they are. ``release_next``: the launch that packs or sums releases the
    GEMM after it (the shrink overlap)."""
    slots, top_k = operands.token_slots, operands.top_k
    if pack:
        operands.packed = pack_shrink_partials(partials, slots, operands.slot_scalings, slot_row_div=top_k,
                                               dtype=dtype, release_next=release_next)
        return operands
    if reduce:
        partials = reduce_shrink_splits(partials, slots, slot_row_div=top_k, release_next=release_next)
    operands.shrunk = partials
    return operands


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


def _check_lora_inputs(lora: MoELoRAInputs, x: torch.Tensor, w13: torch.Tensor, lora_path: str
                       ) -> MoELoRAInputs:
    """Checks ``lora`` against the layer; returns it with every buffer as :class:`LoRAWeights`."""
    if lora_path not in LORA_PATHS:
        raise ValueError(f"lora_path must be one of {LORA_PATHS}, got {lora_path!r}")
    num_experts, two_i, _ = gate_up_dims(w13)
    hidden = x.shape[1]  # w13's last dim is half of it for MXFP4 experts
    weights = {name: lora_weights(getattr(lora, name), kind=kind) for name, kind in
               (("gate_up_a", "gated_a"), ("gate_up_b", "b"), ("down_a", "a"), ("down_b", "b"))}
    slots, max_rank = weights["gate_up_a"].num_slots, weights["gate_up_a"].max_rank
    expected_cols = {"gate_up_a": hidden, "gate_up_b": two_i, "down_a": two_i // 2, "down_b": hidden}
    for name, w in weights.items():
        if (w.num_slots, w.num_experts, w.max_rank, w.cols) != (slots, num_experts, max_rank,
        expected_cols[name]):
            raise ValueError(
                f"LoRA buffer {name} must hold {slots} slots x {num_experts} experts of rank {max_rank} over "
                f"{expected_cols[name]} columns for this layer (w13 {tuple(w13.shape)}), got {w.num_slots} "
                f"slots x {w.num_experts} experts of rank {w.max_rank} over {w.cols} columns"
            )
        if w.dtype != x.dtype:
            raise TypeError(f"LoRA buffer {name} must have x's dtype {x.dtype}, got {w.dtype}")
        if w.device != x.device or w.blocks.device != x.device:
            raise ValueError(f"LoRA buffer {name} is on {w.device}, x on {x.device}")
        if w.blocks.dtype != torch.int32 or w.blocks.stride(1) != 1:
            raise ValueError(f"LoRA buffer {name}'s block table must be int32 with unit stride along the "
                             f"experts, got {w.blocks.dtype} strides {w.blocks.stride()}")
    if lora.token_slots.shape != (x.shape[0],) or lora.token_slots.dtype != torch.int32:
        raise ValueError(f"token_slots must be int32 ({x.shape[0]},), got {lora.token_slots.dtype} "
                         f"{tuple(lora.token_slots.shape)}")
    if lora.slot_ranks.shape != (slots,) or lora.slot_scalings.shape != (slots,):
        raise ValueError(f"slot_ranks and slot_scalings must be ({slots},)")
    if not 0 <= lora.max_rank <= max_rank:
        raise ValueError(f"max_rank {lora.max_rank} is outside the buffers' rank range [0, {max_rank}]")
    checked = {}
    if not lora.slots_checked:
        not_replayable()  # torch operations, which a launch trace would skip
        slots_in = (lora.token_slots >= 0) & (lora.token_slots < slots)
        checked = dict(token_slots=torch.where(slots_in, lora.token_slots, -1),
                       slot_ranks=lora.slot_ranks.clamp(0, max_rank), slots_checked=True)
    if not checked and all(getattr(lora, name) is w for name, w in weights.items()):
        return lora
    return replace(lora, **weights, **checked)
