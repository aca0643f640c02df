"""The fused MoE GEMM's building blocks (``@triton.jit`` helpers of ``_fused_moe_kernel``): the tile order,
a routed pair's rows, the K-loop with its inline LoRA shrink, the block-scaled FP8 dot, the routed weight
and bias, the row store, and the gated activations (with their codes and ``activation_args``, which the
other kernels that apply an activation share).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from triton_ops.lora_tiles import _dot
from triton_ops.mxfp4 import mxfp4_tile_kn

ACTIVATION_NONE = 0
ACTIVATION_SILU = 1
ACTIVATION_GELU = 2
ACTIVATION_GATED_RAW = 3
ACTIVATION_GELU_TANH = 4
ACTIVATION_CLAMPED_SWIGLU = 5
ACTIVATION_CLAMPED_SILU_AFTER = 6
ACTIVATION_RELU = 7
ACTIVATION_SOFTCAPPED_SWIGLU = 8
# kind -> code; the clamped kinds need their constants (moelora.activations.GatedActivation)
_ACTIVATION_CODES = {"silu": ACTIVATION_SILU, "gelu": ACTIVATION_GELU, "gelu_tanh": ACTIVATION_GELU_TANH,
                     "clamped_swiglu": ACTIVATION_CLAMPED_SWIGLU,
                     "clamped_silu_after": ACTIVATION_CLAMPED_SILU_AFTER, "relu": ACTIVATION_RELU,
                     "softcapped_swiglu": ACTIVATION_SOFTCAPPED_SWIGLU}


_PLAIN_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")


def activation_args(activation: Any) -> dict[str, Any]:
    """The kernels' meta-parameters (``ACTIVATION``, ``ACT_LIMIT``, ``ACT_ALPHA``, ``ACT_UP_OFFSET``) of a
    gated activation: a name of one without constants (``"silu"``, ``"gelu"``, ``"gelu_tanh"``) or an
    object with ``kind``, ``limit``, ``alpha`` and ``up_offset`` (``moelora.activations.GatedActivation``,
    which checks them). ValueError for anything else."""
    if isinstance(activation, str):
        if activation not in _PLAIN_ACTIVATIONS:
            raise ValueError(f"activation must be one of {_PLAIN_ACTIVATIONS} or a GatedActivation, got "
                             f"{activation!r}")
        return dict(ACTIVATION=_ACTIVATION_CODES[activation], ACT_LIMIT=0.0, ACT_ALPHA=1.0, ACT_UP_OFFSET=0.0)
    kind = getattr(activation, "kind", None)
    if kind not in _ACTIVATION_CODES:
        raise ValueError(f"activation must be one of {_PLAIN_ACTIVATIONS} or a GatedActivation of a kind in "
                         f"{sorted(_ACTIVATION_CODES)}, got {activation!r}")
    if kind == "softcapped_swiglu":  # the up cap rides in ACT_ALPHA (this kind has no alpha)
        return dict(ACTIVATION=ACTIVATION_SOFTCAPPED_SWIGLU, ACT_LIMIT=float(activation.limit),
                    ACT_ALPHA=float(activation.up_limit), ACT_UP_OFFSET=0.0)
    return dict(ACTIVATION=_ACTIVATION_CODES[kind], ACT_LIMIT=float(activation.limit),
                ACT_ALPHA=float(activation.alpha), ACT_UP_OFFSET=float(activation.up_offset))


@triton.jit
def _gated_activation(gate, up, ACTIVATION: tl.constexpr, ACT_LIMIT: tl.constexpr, ACT_ALPHA: tl.constexpr,
                      ACT_UP_OFFSET: tl.constexpr):
    """``moelora.activations.GatedActivation`` of fp32 ``gate`` and ``up`` (codes ``ACTIVATION_*``)."""
    if ACTIVATION == 1:
        return gate / (1.0 + tl.exp(-gate)) * up
    elif ACTIVATION == 2:
        return 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476)) * up
    elif ACTIVATION == 4:  # tanh(z) = 2 / (1 + exp(-2z)) - 1
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        return gate * (1.0 - 1.0 / (1.0 + tl.exp(2.0 * z))) * up
    elif ACTIVATION == 7:  # with gate = up (ungated experts): relu(u)^2
        return tl.maximum(gate, 0.0) * up
    elif ACTIVATION == 8:  # soft caps c * tanh(z / c), tanh(z) = 1 - 2 / (1 + exp(2z)); up cap in ACT_ALPHA
        gate_cap = ACT_LIMIT * (1.0 - 2.0 / (1.0 + tl.exp(2.0 * gate / ACT_LIMIT)))
        up_cap = ACT_ALPHA * (1.0 - 2.0 / (1.0 + tl.exp(2.0 * up / ACT_ALPHA)))
        return gate_cap / (1.0 + tl.exp(-gate)) * up_cap
    elif ACTIVATION == 5:
        g = tl.minimum(gate, ACT_LIMIT)
        u = tl.minimum(tl.maximum(up, -ACT_LIMIT), ACT_LIMIT)
        return g / (1.0 + tl.exp(-ACT_ALPHA * g)) * (u + ACT_UP_OFFSET)
    else:
        silu = tl.minimum(gate / (1.0 + tl.exp(-gate)), ACT_LIMIT)
        return silu * tl.minimum(tl.maximum(up, -ACT_LIMIT), ACT_LIMIT)


@triton.jit
def _grouped_tile(pid, max_padded, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program ``pid``'s (M block, N tile): GROUP_M blocks of M at a time walk the N tiles, so consecutive
    programs reuse the same weight tiles from L2."""
    num_pid_m = tl.cdiv(max_padded, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_pid_m = (pid // pids_per_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % pids_per_group) % group_size_m)
    pid_n = (pid % pids_per_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _direct_pair(expert_ids_ptr, pid_m, numel, num_experts, BLOCK_M: tl.constexpr):
    """DIRECT_PAIRS: block ``pid_m`` is routed pair ``pid_m`` alone, in row 0; ``expert_ids_ptr`` is the
    flat topk_ids. An id outside [0, E) runs on expert 0 (in bounds) and its row is stored as zero: a
    branch on the loaded id would hold every load behind it. Returns (expert, pair per row, null)."""
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    null_pair = (expert < 0) | (expert >= num_experts)
    expert = tl.where(null_pair, 0, expert)
    pair = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, numel)
    return expert, pair, null_pair


@triton.jit
def _store_rows(c_ptr, tile, pair, row_valid, cols, col_valid, stride_cm, stride_cn):
    """c[pair[m], cols[n]] = tile[m, n] for valid rows and columns, in c's dtype; int64 offsets."""
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + cols.to(tl.int64)[None, :] * stride_cn
    tl.store(c_ptrs, tile.to(c_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


@triton.jit
def _row_scale(topk_weights_ptr, pair, row_valid, scale, MUL_ROUTED_WEIGHT: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """(BLOCK_M,) fp32: ``scale`` times each pair's routed weight when MUL_ROUTED_WEIGHT."""
    row_scale = tl.zeros((BLOCK_M,), dtype=tl.float32) + scale
    if MUL_ROUTED_WEIGHT:
        row_scale *= tl.load(topk_weights_ptr + pair, mask=row_valid, other=0.0).to(tl.float32)
    return row_scale


@triton.jit
def _expert_bias(bias_ptr, expert, stride_bias_e, cols, col_valid):
    """(BLOCK_N,) fp32: expert ``expert``'s bias at ``cols`` (0 past N)."""
    return tl.load(bias_ptr + expert * stride_bias_e + cols, mask=col_valid, other=0.0).to(tl.float32)


@triton.jit
def _add_block_scaled_dot(
    acc,  # (BLOCK_M, BLOCK_N) fp32, or (BLOCK_N, BLOCK_M) with SWAP_AB
    a,  # (BLOCK_M, BLOCK_K) float8_e4m3fn, one scale group
    b,  # (BLOCK_K, BLOCK_N) float8_e4m3fn
    a_scale,  # (BLOCK_M,) fp32 the rows' scales of this group
    b_scale_ptrs,  # (BLOCK_N,) the columns' weight scales of this group; TILE_B_SCALE: the tile's one
    col_valid,  # (BLOCK_N,)
    TILE_B_SCALE: tl.constexpr,
    SWAP_AB: tl.constexpr = False,
):
    """``acc + (a @ b) * a_scale[m] * b_scale[n]``: one K step of the block-scaled product (with SWAP_AB
    its transpose, ``acc + (b^T @ a^T) * b_scale[n] * a_scale[m]``: see ``_gemm_k_loop``). With
    TILE_B_SCALE the tile has one weight scale, folded into the rows' scales (one multiply-add per
    element instead of two)."""
    if SWAP_AB:
        if TILE_B_SCALE:
            scaled = tl.dot(tl.trans(b), tl.trans(a)) * (a_scale * tl.load(b_scale_ptrs))[None, :]
        else:
            b_scale = tl.load(b_scale_ptrs, mask=col_valid, other=0.0)
            scaled = tl.dot(tl.trans(b), tl.trans(a)) * (b_scale[:, None] * a_scale[None, :])
    elif TILE_B_SCALE:
        scaled = tl.dot(a, b) * (a_scale * tl.load(b_scale_ptrs))[:, None]
    else:
        b_scale = tl.load(b_scale_ptrs, mask=col_valid, other=0.0)
        scaled = tl.dot(a, b) * (a_scale[:, None] * b_scale[None, :])
    return acc + scaled


@triton.jit
def _load_mxfp4_scales(
    scale_ptrs,  # (BLOCK_K / 32, BLOCK_N) pointers to a K step's E8M0 scales
    col_valid,  # (BLOCK_N,)
    k_left,  # K columns from the step's first on (<= 0: past K, nothing loaded)
    BLOCK_K: tl.constexpr,
):
    """A K step's (BLOCK_K / 32, BLOCK_N) uint8 scales; groups past K read 127 (2^0; their codes are
    zero)."""
    group_valid = tl.arange(0, BLOCK_K // 32) < k_left // 32
    return tl.load(scale_ptrs, mask=group_valid[:, None] & col_valid[None, :], other=127)


@triton.jit
def _mxfp4_dot(
    acc,  # (BLOCK_M, BLOCK_N) fp32, returned with the step's product added
    a,  # (BLOCK_M, BLOCK_K) the step's activations (rows and K past the end zero)
    b_ptrs,  # (BLOCK_K / 2, BLOCK_N) pointers to packed E2M1 bytes (two K rows a byte, the even one low)
    scales,  # (BLOCK_K / 32, BLOCK_N) uint8 the step's E8M0 scales (``_load_mxfp4_scales``)
    col_valid,  # (BLOCK_N,)
    k_left,  # K columns from this step's first on
    FP32_IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``acc + a @ b`` for one K step of an MXFP4 weight tile (``triton_ops.mxfp4``); rows past K (a
    multiple of 32) are zero. With fp16/bf16 activations Triton's scaled dot decodes the tile (a byte
    permute per value pair, the scale as the exponent) and, on sm_90, multiplies it as the register
    operand of a warpgroup MMA with the tokens as the MMA's N (docs/performance.md, 'MXFP4 base
    experts'). fp32 activations (the interpreter's tests) take the tile decoded in fp32."""
    if EVEN_K:
        packed = tl.load(b_ptrs, mask=col_valid[None, :], other=0)
    else:
        byte_valid = tl.arange(0, BLOCK_K // 2) < k_left // 2
        packed = tl.load(b_ptrs, mask=byte_valid[:, None] & col_valid[None, :], other=0)
    if a.dtype == tl.bfloat16:
        acc = tl.dot_scaled(a, None, "bf16", packed, tl.trans(scales), "e2m1", acc)
    elif a.dtype == tl.float16:
        acc = tl.dot_scaled(a, None, "fp16", packed, tl.trans(scales), "e2m1", acc)
    else:
        acc = _dot(a, mxfp4_tile_kn(packed, scales, BLOCK_K), acc, FP32_IEEE)
    return acc


@triton.jit
def _gemm_k_loop(
    a_ptrs,  # (BLOCK_M, BLOCK_K) pointers to the block's rows of a, at K offset 0
    b_ptrs,  # (BLOCK_K, BLOCK_N) pointers to the expert's weight tile (gate rows when gated)
    up_ptrs,  # (BLOCK_K, BLOCK_N) the up rows' tile (GATED)
    la_ptrs,  # (BLOCK_K, LORA_R) the main slot's LoRA A tile (INLINE_SHRINK)
    row_valid,  # (BLOCK_M,)
    col_valid,  # (BLOCK_N,)
    la_rank_valid,  # (LORA_R,) rank columns within the main slot's rank (INLINE_SHRINK)
    offs_k,  # (BLOCK_K,)
    a_scale_ptrs,  # (BLOCK_M,) the rows' FP8 scales of group 0 (BLOCK_SCALED)
    b_scale_ptrs,  # (BLOCK_N,) the columns' weight scales of group 0 (BLOCK_SCALED; TILE_B_SCALE: one)
    up_scale_ptrs,  # (BLOCK_N,) the up columns' (BLOCK_SCALED and GATED; TILE_B_SCALE: one)
    K, stride_ak, stride_bk, stride_la_k, lora_up_offset, stride_ask, stride_bsk,
    acc, acc_up, shrink_gate, shrink_up,  # fp32 accumulators, returned updated
    GATED: tl.constexpr,
    INLINE_SHRINK: tl.constexpr,
    BLOCK_SCALED: tl.constexpr,
    TILE_B_SCALE: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MXFP4: tl.constexpr = False,
    SWAP_AB: tl.constexpr = False,
):
    """The K-loop: ``acc += a @ b`` (and ``acc_up += a @ b_up`` when gated); with INLINE_SHRINK (LORA_FUSED)
    the block's main slot's LoRA shrink rides on the same a tile: ``shrink_gate/up += a @ A_gate/up``.
    With BLOCK_SCALED (FP8 a and b, ``triton_ops.fp8``; BLOCK_K is the scale group) each K step's dot is
    multiplied by its rows' and columns' scales as it is added. With MXFP4 (``triton_ops.mxfp4``) b's
    pointers are (BLOCK_K / 2, BLOCK_N) packed bytes and its scale pointers (BLOCK_K / 32, BLOCK_N) E8M0
    scales (``up_scale_ptrs`` the up rows'), each step's product taken by ``_mxfp4_dot``. With SWAP_AB
    (BLOCK_SCALED only) the loop accumulates the transposed products ``b^T @ a^T``, the weights the MMA's M
    and the block's rows its N, and transposes once after the loop: on sm_90 a 16-row block then runs
    warpgroup MMAs (FP8 natively) where ``a @ b`` takes 16x8 MMAs (FP8 through a conversion)."""
    if MXFP4:
        # The scales are a load of a few bytes a thread that Triton's pipeline does not stage: each step
        # loads the next step's, so their latency hides behind this step's dots instead of stalling it.
        scales = _load_mxfp4_scales(b_scale_ptrs, col_valid, K, BLOCK_K=BLOCK_K)
        up_scales = scales
        if GATED:
            up_scales = _load_mxfp4_scales(up_scale_ptrs, col_valid, K, BLOCK_K=BLOCK_K)
    if SWAP_AB:  # the transposed accumulators, (BLOCK_N, BLOCK_M)
        acc_t = tl.zeros((acc.shape[1], acc.shape[0]), dtype=tl.float32)
        acc_up_t = acc_t
    for k0 in range(0, K, BLOCK_K):
        k_valid = offs_k < K - k0
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_valid[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        if MXFP4:
            step_scales = scales
            b_scale_ptrs += (BLOCK_K // 32) * stride_bsk
            scales = _load_mxfp4_scales(b_scale_ptrs, col_valid, K - k0 - BLOCK_K, BLOCK_K=BLOCK_K)
            acc = _mxfp4_dot(acc, a, b_ptrs, step_scales, col_valid, K - k0, FP32_IEEE=FP32_IEEE,
                             EVEN_K=EVEN_K, BLOCK_K=BLOCK_K)
            if GATED:
                step_up_scales = up_scales
                up_scale_ptrs += (BLOCK_K // 32) * stride_bsk
                up_scales = _load_mxfp4_scales(up_scale_ptrs, col_valid, K - k0 - BLOCK_K, BLOCK_K=BLOCK_K)
                acc_up = _mxfp4_dot(acc_up, a, up_ptrs, step_up_scales, col_valid, K - k0,
                                    FP32_IEEE=FP32_IEEE, EVEN_K=EVEN_K, BLOCK_K=BLOCK_K)
                up_ptrs += (BLOCK_K // 2) * stride_bk
        else:
            if EVEN_K:
                b = tl.load(b_ptrs, mask=col_valid[None, :], other=0.0)
            else:
                b = tl.load(b_ptrs, mask=k_valid[:, None] & col_valid[None, :], other=0.0)
            if BLOCK_SCALED:
                a_scale = tl.load(a_scale_ptrs, mask=row_valid, other=0.0)
                if SWAP_AB:
                    acc_t = _add_block_scaled_dot(acc_t, a, b, a_scale, b_scale_ptrs, col_valid, TILE_B_SCALE,
                                                  SWAP_AB=True)
                else:
                    acc = _add_block_scaled_dot(acc, a, b, a_scale, b_scale_ptrs, col_valid, TILE_B_SCALE)
            else:
                acc = _dot(a, b, acc, FP32_IEEE)
            if GATED:
                if EVEN_K:
                    b_up = tl.load(up_ptrs, mask=col_valid[None, :], other=0.0)
                else:
                    b_up = tl.load(up_ptrs, mask=k_valid[:, None] & col_valid[None, :], other=0.0)
                if BLOCK_SCALED:
                    if SWAP_AB:
                        acc_up_t = _add_block_scaled_dot(acc_up_t, a, b_up, a_scale, up_scale_ptrs, col_valid,
                                                         TILE_B_SCALE, SWAP_AB=True)
                    else:
                        acc_up = _add_block_scaled_dot(acc_up, a, b_up, a_scale, up_scale_ptrs, col_valid,
                                                       TILE_B_SCALE)
                    up_scale_ptrs += stride_bsk
                else:
                    acc_up = _dot(a, b_up, acc_up, FP32_IEEE)
                up_ptrs += BLOCK_K * stride_bk
            if BLOCK_SCALED:
                a_scale_ptrs += stride_ask
                b_scale_ptrs += stride_bsk
        if INLINE_SHRINK:
            if EVEN_K:
                la_mask = la_rank_valid[None, :]
            else:
                la_mask = k_valid[:, None] & la_rank_valid[None, :]
            shrink_gate = _dot(a, tl.load(la_ptrs, mask=la_mask, other=0.0), shrink_gate, FP32_IEEE)
            if GATED:
                shrink_up = _dot(a, tl.load(la_ptrs + lora_up_offset, mask=la_mask, other=0.0), shrink_up,
                                 FP32_IEEE)
            la_ptrs += BLOCK_K * stride_la_k
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += (BLOCK_K // 2 if MXFP4 else BLOCK_K) * stride_bk
    if SWAP_AB:
        acc += tl.trans(acc_t)
        if GATED:
            acc_up += tl.trans(acc_up_t)
    return acc, acc_up, shrink_gate, shrink_up
