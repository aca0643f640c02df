"""MXFP4 weights (OCP microscaling, gpt-oss' experts): 4-bit E2M1 values, one power-of-two scale per 32.

Semantics:  W[n, k] = e2m1(code[n, k]) * 2^(scale[n, k // 32] - 127)
            code[n, k] is the low nibble of ``blocks[n, k // 2]`` for even k, the high nibble for odd k;
            e2m1(c) = (-1)^(c >> 3) * {0, 0.5, 1, 1.5, 2, 3, 4, 6}[c & 7]; scale is E8M0 (an unbiased
            exponent + 127; 255 is NaN). Every value is exact in fp32; in bf16 too unless the scale pushes
            it past bf16's range.
Layouts:    ``blocks`` (..., N, K / 2) uint8 and ``scales`` (..., N, K / 32) uint8: rows are the output
            features, packed along K (the reduction), as gpt-oss stores ``*_blocks`` (..., N, K / 32, 16).

The jit helpers decode a tile where it is loaded (``mxfp4_tile``); the GEMMs' K-loops read the packed
bytes through ``tl.dot_scaled`` (``gemm_tiles._mxfp4_dot``); ``dequantize_mxfp4`` writes a dense copy (for
checks and for paths that take dense weights).
Grid of ``_dequantize_kernel``: (cdiv(rows, BLOCK_R), cdiv(K, BLOCK_K)), one tile of rows x K each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton_ops.hostmath import cdiv
from triton_ops.launch import launch

MXFP4_GROUP = 32  # values per E8M0 scale


def untuned_block_k(block_k: int) -> int:
    """An MXFP4 GEMM's K step from a bf16 tile's: whole scale groups, and at most 128 (sm_90,
    ``resource_report.py``: a decoded 16x64x256 tile reaches 255 registers and spills, 16x64x128 none)."""
    return min(128, max(MXFP4_GROUP, block_k))


@triton.jit
def e2m1_to_fp32(codes):
    """fp32 values of 4-bit E2M1 codes (int32, 0..15), built from their bits: sign, a 2-bit exponent of
    bias 1 (0: the subnormal 0 or 0.5) and a 1-bit mantissa."""
    sign = (codes >> 3) & 1
    exponent = (codes >> 1) & 3
    mantissa = codes & 1
    # Normal codes: 2^(e-1) * (1 + m/2) is fp32 exponent e + 126 with the mantissa's top bit m. The
    # subnormal 0.5 (e 0, m 1) is exponent 126; zero is all zero bits.
    float_exponent = tl.where(exponent > 0, exponent + 126, mantissa * 126)
    float_mantissa = tl.where(exponent > 0, mantissa << 22, 0)
    return ((sign << 31) | (float_exponent << 23) | float_mantissa).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_to_fp32(scales):
    """fp32 2^(s - 127) of E8M0 scales (int32, 0..255): exponent bits s; s = 0 is the subnormal 2^-127,
    s = 255 NaN."""
    bits = tl.where(scales == 0, 1 << 22, scales << 23)
    bits = tl.where(scales == 255, 0x7FC00000, bits)  # a quiet NaN
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_tile(packed, scales, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 (BLOCK_R, BLOCK_K) tile of ``packed`` (BLOCK_R, BLOCK_K // 2) uint8 bytes and ``scales``
    (BLOCK_R, BLOCK_K // 32) uint8: low nibbles are the even columns, high nibbles the odd ones."""
    bytes_ = packed.to(tl.int32)
    values = tl.join(e2m1_to_fp32(bytes_ & 15), e2m1_to_fp32(bytes_ >> 4))  # (R, K/2, 2): k = 2i + j
    values = tl.reshape(values, (BLOCK_R, BLOCK_K // 32, 32))
    values = values * e8m0_to_fp32(scales.to(tl.int32))[:, :, None]
    return tl.reshape(values, (BLOCK_R, BLOCK_K))


@triton.jit
def mxfp4_tile_kn(packed, scales, BLOCK_K: tl.constexpr):
    """A GEMM's fp32 (BLOCK_K, BLOCK_N) weight tile from ``packed`` (BLOCK_K // 2, BLOCK_N) bytes (K rows 2i
    in the low nibbles, 2i + 1 in the high ones) and ``scales`` (BLOCK_K // 32, BLOCK_N). The GEMMs take
    fp16/bf16 activations' products through ``tl.dot_scaled`` instead (``gemm_tiles._mxfp4_dot``)."""
    bytes_ = packed.to(tl.int32)
    block_n: tl.constexpr = packed.shape[1]
    values = tl.join(e2m1_to_fp32(bytes_ & 15), e2m1_to_fp32(bytes_ >> 4))  # (K/2, N, 2)
    factor = e8m0_to_fp32(scales.to(tl.int32))
    values = tl.reshape(tl.permute(values, (0, 2, 1)), (BLOCK_K // 32, 32, block_n))  # k = 2i + j
    return tl.reshape(values * factor[:, None, :], (BLOCK_K, block_n))


@triton.jit(do_not_specialize=["rows"])
def _dequantize_kernel(
    blocks_ptr,  # (rows, K / 2) uint8
    scales_ptr,  # (rows, K / 32) uint8
    out_ptr,  # (rows, K) float16 / bfloat16 / float32
    rows,
    K,
    stride_br, stride_sr, stride_or,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_valid = offs_r < rows
    offs_r = offs_r.to(tl.int64)
    k0 = tl.program_id(1) * BLOCK_K
    offs_byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    offs_group = k0 // 32 + tl.arange(0, BLOCK_K // 32)  # one scale per 32 values (MXFP4_GROUP)
    packed = tl.load(blocks_ptr + offs_r[:, None] * stride_br + offs_byte[None, :],
                     mask=row_valid[:, None] & (offs_byte < K // 2)[None, :], other=0)
    scales = tl.load(scales_ptr + offs_r[:, None] * stride_sr + offs_group[None, :],
                     mask=row_valid[:, None] & (offs_group < K // 32)[None, :], other=127)
    values = mxfp4_tile(packed, scales, BLOCK_R, BLOCK_K)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_r[:, None] * stride_or + offs_k[None, :], values.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & (offs_k < K)[None, :])


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``blocks`` and ``scales`` as (rows, K / 2) and (rows, K / 32) uint8 views (gpt-oss' (..., N, G, 16)
    blocks and (..., N, G) scales accepted), checked against each other; ValueError/TypeError otherwise."""
    if not isinstance(blocks, torch.Tensor) or not isinstance(scales, torch.Tensor):
        raise TypeError(f"MXFP4 blocks and scales must be tensors, got {type(blocks).__name__} and "
                        f"{type(scales).__name__}")
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() >= 2 and blocks.shape[-1] == MXFP4_GROUP // 2 and blocks.dim() == scales.dim() + 1:
        blocks = blocks.flatten(-2)  # gpt-oss' (..., N, G, 16)
    if blocks.dim() < 2 or blocks.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"MXFP4 blocks (..., N, K/2) and scales (..., N, K/32) must share their leading "
                         f"dims, got {tuple(blocks.shape)} and {tuple(scales.shape)}")
    if blocks.shape[-1] != scales.shape[-1] * (MXFP4_GROUP // 2):
        raise ValueError(f"MXFP4 blocks hold 16 bytes per scale (32 values), got {blocks.shape[-1]} bytes "
                         f"for {scales.shape[-1]} scales a row")
    if blocks.device != scales.device:
        raise ValueError(f"MXFP4 blocks on {blocks.device} and scales on {scales.device}")
    return blocks.reshape(-1, blocks.shape[-1]), scales.reshape(-1, scales.shape[-1])


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
                     ) -> torch.Tensor:
    """The dense (..., N, K) ``dtype`` weights that MXFP4 ``blocks`` (..., N, K / 2) (or gpt-oss'
    (..., N, K / 32, 16)) and ``scales`` (..., N, K / 32) encode (module docstring)."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    lead = scales.shape[:-1]
    flat_blocks, flat_scales = check_mxfp4(blocks, scales)
    rows, K = flat_blocks.shape[0], flat_blocks.shape[1] * 2
    flat_blocks, flat_scales = flat_blocks.contiguous(), flat_scales.contiguous()
    out = torch.empty(rows, K, dtype=dtype, device=flat_blocks.device)
    if rows and K:
        block_r, block_k = 16, 64
        launch(_dequantize_kernel, (cdiv(rows, block_r), cdiv(K, block_k)), blocks_ptr=flat_blocks,
               scales_ptr=flat_scales, out_ptr=out, rows=rows, K=K, stride_br=flat_blocks.stride(0),
               stride_sr=flat_scales.stride(0), stride_or=out.stride(0), BLOCK_R=block_r, BLOCK_K=block_k)
    return out.view(*lead, K)


@dataclass(frozen=True)
class Mxfp4Weights:
    """The E8M0 scales of MXFP4 experts whose packed E2M1 blocks are ``fused_experts``' ``w13`` / ``w2``:
    ``w13`` (E, 2I, H / 2) uint8 (or an (E, 2, I, H / 2) halves view, gpt-oss' interleaved gate/up rows read
    in place) with ``w13_scale`` of its rows' shape and H / 32 columns (the same view of the scales), and
    ``w2`` (E, H, I / 2) with ``w2_scale`` (E, H, I / 32). The GEMMs decode them in their K-loops."""

    w13_scale: torch.Tensor
    w2_scale: torch.Tensor


def check_mxfp4_experts(w13: torch.Tensor, w2: torch.Tensor, mxfp4: Mxfp4Weights) -> None:
    """Raises ValueError/TypeError unless ``w13`` / ``w2`` are uint8 E2M1 blocks and ``mxfp4`` holds their
    uint8 scales, one per 32 values, on their device."""
    if not isinstance(mxfp4, Mxfp4Weights):
        raise TypeError(f"mxfp4 must be a triton_ops.mxfp4.Mxfp4Weights, got {type(mxfp4).__name__}")
    for name, blocks, scale in (("w13", w13, mxfp4.w13_scale), ("w2", w2, mxfp4.w2_scale)):
        if blocks.dtype != torch.uint8:
            raise TypeError(f"MXFP4 {name} must be uint8 E2M1 blocks (two values a byte), got {blocks.dtype}")
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.uint8:
            got = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
            raise TypeError(f"MXFP4 {name}_scale must be uint8 E8M0 scales, got {got}")
        expected = (*blocks.shape[:-1], blocks.shape[-1] * 2 // MXFP4_GROUP)
        if blocks.shape[-1] % (MXFP4_GROUP // 2) or tuple(scale.shape) != expected:
            raise ValueError(f"MXFP4 {name}_scale must be {expected} (a scale per 32 values of {name} "
                             f"{tuple(blocks.shape)}, 16 bytes each), got {tuple(scale.shape)}")
        if scale.device != blocks.device:
            raise ValueError(f"MXFP4 {name}_scale is on {scale.device}, {name} on {blocks.device}")


_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4_torch(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
                           ) -> torch.Tensor:
    """``dequantize_mxfp4`` in PyTorch ops, for devices Triton does not run on (the layer's torch path):
    (..., N, K / 2) blocks (any strides) and (..., N, K / 32) scales to (..., N, K) ``dtype``. Decoded a
    slice of the leading dim at a time, so the temporaries stay a few times one slice's output."""
    out = torch.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), dtype=dtype, device=blocks.device)
    if blocks.dim() < 3:
        return _decode_mxfp4_torch(blocks, scales, out)
    for i in range(blocks.shape[0]):
        _decode_mxfp4_torch(blocks[i], scales[i], out[i])
    return out


def _decode_mxfp4_torch(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2).int()
    group_scales = scales.repeat_interleave(MXFP4_GROUP, dim=-1)
    values = torch.ldexp(table[codes], group_scales.float() - 127)
    out.copy_(values.masked_fill_(group_scales == 255, float("nan")))
    return out
