"""Block-scaled FP8 (W8A8) for the base experts: the weights' scales and the activations' quantization.

Semantics (DeepSeek-V3's fine-grained FP8, transformers' ``FineGrainedFP8`` and vLLM's block FP8):
    weights:      W[e, n, k] ~= W_q[e, n, k] * w_scale[e, n // block_n, k // block_k], W_q float8_e4m3fn
                  (``weight_scale_inv`` in the checkpoints: it multiplies, despite its name)
    activations:  per token t and group g of ``block_k`` columns, s[t, g] = max(|x[t, group g]|) / 448
                  (at least ``MIN_AMAX`` / 448), x_q[t, k] = clamp(x[t, k] / s[t, k // block_k], +-448)
                  rounded to float8_e4m3fn
    a GEMM:       y[t, n] = sum_g s[t, g] * w_scale[e, n // block_n, g] * sum_{k in g} x_q[t, k] W_q[e, n, k],
                  accumulated in fp32 (``fused_moe._gemm_k_loop`` with BLOCK_SCALED: BLOCK_K = block_k,
                  one dot per group, scaled as it is added)

The LoRA side stays in the activations' dtype (docs/design.md §1): the shrinks read the original x and the
unquantized intermediate h; only the base GEMMs read x_q and h_q.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton_ops.hostmath import cdiv
from triton_ops.launch import launch
from triton_ops.pdl import releasing_launch, wait_for_previous_kernel

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# The smallest amax a group's scale is made from: an all-zero group gets a tiny scale, not a zero one.
MIN_AMAX = 1e-10


@dataclass(frozen=True)
class BlockFp8Weights:
    """The scales of one layer's FP8 expert weights and their block shape.

    ``w13_scale``: (E, cdiv(2I, block_n), cdiv(H, block_k)) fp32; ``w2_scale``: (E, cdiv(H, block_n),
    cdiv(I, block_k)) fp32; ``block_shape``: (block_n, block_k), the checkpoint's ``weight_block_size``."""

    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    block_shape: tuple[int, int] = (128, 128)

    @classmethod
    def from_scales(cls, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                    block_size: tuple[int, int] | None = None, block_k: int = 128) -> BlockFp8Weights:
        """The FP8 scale layouts checkpoints use, as the block scales the kernels read (the same dequantized
        weights). Per expert and projection, a scale tensor (E, rows, cols) (or (E,) / (E, rows)) is:

        - block-scaled with ``block_size`` (block_n, block_k): (E, cdiv(N, block_n), cdiv(K, block_k));
        - per-tensor: one scale (rows = cols = 1);
        - per-channel: one per output row (rows = N, cols = 1);
        - per half of a gate/up weight (rows = 2: transformers' FP8Experts keeps two scale rows for
          ``gate_up_proj`` where its rows fit one block, or without ``block_size``).

        Both projections are brought to one block shape: block_n the largest that divides both row
        granularities (scales repeated per row block, a small copy), block_k the checkpoint's K block (else
        ``block_k``); scales constant along K repeat with stride 0, no copy. Activations are quantized per
        token and block_k group. ValueError names the scale that fits none of these."""
        found = []
        for name, weight, scale in (("w13_scale", w13, w13_scale), ("w2_scale", w2, w2_scale)):
            if not isinstance(scale, torch.Tensor) or not isinstance(weight, torch.Tensor):
                raise TypeError(f"{name} and its weight must be torch.Tensors, got {type(scale).__name__}")
            found.append((weight.shape, *_granularity(name, weight.shape, scale, block_size)))
        block_n = math.gcd(found[0][2], found[1][2])
        k_blocks = {gran_k for *_, gran_k in found if gran_k is not None}
        step = math.gcd(*k_blocks) if k_blocks else block_k
        if step not in (32, 64, 128, 256):
            raise ValueError(f"the scales' K blocks {sorted(k_blocks)} leave a K step of {step}: it must be "
                             "32, 64, 128 or 256")
        scales = []
        for (experts, n, k), scale, gran_n, gran_k in found:
            # Each new block of block_n rows (step columns) lies inside one of the checkpoint's blocks.
            row_of = torch.arange(cdiv(n, block_n), device=scale.device) * block_n // gran_n
            picked = scale.to(torch.float32)[:, row_of]
            if gran_k is None:
                scales.append(picked.expand(experts, row_of.numel(), cdiv(k, step)))
            else:
                col_of = torch.arange(cdiv(k, step), device=scale.device) * step // gran_k
                scales.append(picked[:, :, col_of])
        return cls(scales[0], scales[1], (block_n, step))

    def check(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Raises ValueError/TypeError naming what was expected when the weights and scales disagree."""
        if len(self.block_shape) != 2 or not all(isinstance(b, int) and b > 0 for b in self.block_shape):
            raise ValueError("block_shape must be two positive ints (block_n, block_k), "
                             f"got {self.block_shape}")
        block_n, block_k = self.block_shape
        if block_k not in (32, 64, 128, 256):
            raise ValueError(f"block_shape (block_n, block_k) = {self.block_shape}: block_k must be 32, 64, "
                             "128 or 256")
        for name, weight in (("w13", w13), ("w2", w2)):
            if weight.dtype != FP8_DTYPE:
                raise TypeError(f"block-scaled {name} must be float8_e4m3fn, got {weight.dtype}")
        for name, scale, weight in (("w13_scale", self.w13_scale, w13), ("w2_scale", self.w2_scale, w2)):
            if not isinstance(scale, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(scale).__name__}")
            want = (weight.shape[0], cdiv(weight.shape[1], block_n), cdiv(weight.shape[2], block_k))
            if tuple(scale.shape) != want:
                raise ValueError(f"{name} must be (E, cdiv(N, {block_n}), cdiv(K, {block_k})) = {want} for a "
                                 f"weight of shape {tuple(weight.shape)}, got {tuple(scale.shape)}")
            if scale.dtype != torch.float32:
                raise TypeError(f"{name} must be float32, got {scale.dtype}")
            if scale.device != weight.device:
                raise ValueError(f"{name} is on {scale.device}, its weight on {weight.device}")


def _granularity(name: str, weight_shape: torch.Size, scale: torch.Tensor, block_size: tuple[int, int] | None
                 ) -> tuple[torch.Tensor, int, int | None]:
    """``scale`` as (E, rows, cols), with the rows and the columns of the weight one of its scales covers
    (columns None: all of K). The layouts of ``BlockFp8Weights.from_scales``; ValueError for any other."""
    experts, n, k = weight_shape
    if scale.dim() > 3 or scale.dim() == 0 or scale.shape[0] != experts:
        raise ValueError(f"{name} must be (E,), (E, rows) or (E, rows, cols) with E = {experts}, got "
                         f"{tuple(scale.shape)}")
    scale = scale.reshape(experts, *scale.shape[1:], *(1,) * (3 - scale.dim()))
    rows, cols = scale.shape[1:]
    if block_size is not None and (rows, cols) == (cdiv(n, block_size[0]), cdiv(k, block_size[1])):
        return scale, block_size[0], block_size[1]
    gran_k = None if cols == 1 else (block_size[1] if block_size and cols == cdiv(k, block_size[1]) else 0)
    gran_n = {1: n, n: 1}.get(rows, n // 2 if rows == 2 and n % 2 == 0 else 0)
    if not gran_n or gran_k == 0:
        blocks = f", block-scaled {(cdiv(n, block_size[0]), cdiv(k, block_size[1]))}" if block_size else ""
        raise ValueError(f"{name} of shape {tuple(scale.shape)} fits no FP8 scale layout of a weight "
                         f"{tuple(weight_shape)}: per-tensor (E,), per-channel (E, {n}), per half (E, 2, 1)"
                         f"{blocks}")
    return scale, gran_n, gran_k


def uses_block_fp8(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether either expert weight is float8_e4m3fn (then the call needs ``fp8=``)."""
    return FP8_DTYPE in (w13.dtype, w2.dtype)


def check_block_fp8(w13: torch.Tensor, w2: torch.Tensor, fp8: object) -> None:
    """Raises ValueError/TypeError unless ``fp8`` is the :class:`BlockFp8Weights` of FP8 ``w13``/``w2``."""
    if fp8 is None:
        raise ValueError("float8_e4m3fn expert weights need their block scales: pass "
                         "fp8=triton_ops.fp8.BlockFp8Weights(w13_scale, w2_scale, block_shape)")
    if not isinstance(fp8, BlockFp8Weights):
        raise TypeError(f"fp8 must be a triton_ops.fp8.BlockFp8Weights, got {type(fp8).__name__}")
    fp8.check(w13, w2)


@triton.jit(do_not_specialize=["rows"])
def _quantize_groups_kernel(
    x_ptr,  # (rows, K) fp16/bf16/fp32
    stride_xm,
    q_ptr,  # (rows, K) float8_e4m3fn, out
    stride_qm,
    scale_ptr,  # (rows, cdiv(K, GROUP)) fp32, out
    stride_sm,
    rows, K,
    MIN_AMAX: tl.constexpr,
    FP8_MAX: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # a link of a dependent-launch chain (``dependent_fp8_decode``)
):
    """Semantics: the module docstring's activation quantization, for BLOCK_ROWS rows and one group.
    Grid: (cdiv(rows, BLOCK_ROWS), cdiv(K, GROUP))."""
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1)
    col = group * GROUP + tl.arange(0, GROUP)
    row_valid = row < rows
    mask = row_valid[:, None] & (col < K)[None, :]
    row64 = row.to(tl.int64)
    x = tl.load(x_ptr + row64[:, None] * stride_xm + col[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX)
    scale = amax / FP8_MAX
    q = tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row64[:, None] * stride_qm + col[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row64 * stride_sm + group, scale, mask=row_valid)


def quantize_fp8_groups(x: torch.Tensor, group: int, *, out: torch.Tensor | None = None,
                        scales: torch.Tensor | None = None, release_next: bool = False,
                        dependent: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q, s): x (rows, K) quantized per row and group of ``group`` columns (module docstring), x_q
    (rows, K) float8_e4m3fn and s (rows, cdiv(K, group)) fp32. One launch, no host sync.

    ``release_next`` (sm_90+): the launch lets the next one (launched dependently, waiting for it as its
    first instruction) be scheduled as soon as its programs start; ``dependent``: this launch is itself
    dependent on the one before it and waits for it first (``pdl.dependent_fp8_decode``)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D with contiguous rows, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    rows, k = x.shape
    if out is None:
        out = torch.empty((rows, k), dtype=FP8_DTYPE, device=x.device)
    if scales is None:
        scales = torch.empty((rows, cdiv(k, group)), dtype=torch.float32, device=x.device)
    if rows == 0:
        return out, scales
    block_rows = 16
    launch(_quantize_groups_kernel, (cdiv(rows, block_rows), cdiv(k, group)),
           x_ptr=x, stride_xm=x.stride(0), q_ptr=out, stride_qm=out.stride(0), scale_ptr=scales,
           stride_sm=scales.stride(0), rows=rows, K=k, MIN_AMAX=MIN_AMAX, FP8_MAX=FP8_MAX, GROUP=group,
           BLOCK_ROWS=block_rows,
           **releasing_launch(x.device, release_next, dependent=dependent))
    return out, scales
