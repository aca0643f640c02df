"""Top-k combine of per-pair expert outputs.

Semantics:  out[t, :] = scale * sum_j x[t, j, :]     (fp32 accumulation, deterministic order)
Grid:       (M, cdiv(H, BLOCK_H))
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops.pdl import programmatic_launch, wait_for_previous_kernel


@triton.jit
def _moe_sum_kernel(
    # Pointers
    x_ptr,  # (M, top_k, H) fp16/bf16/fp32
    out_ptr,  # (M, H) same dtype
    # Sizes
    H,
    top_k,
    scale,
    # Strides
    stride_xm,
    stride_xk,
    stride_om,
    # Meta-parameters
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(top_k):
        acc += tl.load(x_ptr + token * stride_xm + j * stride_xk + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_om + offs, (acc * scale).to(out_ptr.dtype.element_ty), mask=mask)


def moe_sum_reduce(
    x: torch.Tensor, routed_scaling_factor: float = 1.0, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum x (M, top_k, H) over top_k, times ``routed_scaling_factor``; returns (M, H) in x's dtype."""
    if x.dim() != 3:
        raise ValueError(f"x must be (tokens, top_k, hidden), got shape {tuple(x.shape)}")
    if x.stride(2) != 1:
        x = x.contiguous()
    tokens, top_k, hidden = x.shape
    if out is None:
        out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    elif out.shape != (tokens, hidden) or out.stride(1) != 1:
        raise ValueError(f"out must be a row-major ({tokens}, {hidden}) tensor, got {tuple(out.shape)}")
    if tokens == 0:
        return out
    block_h = min(1024, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(tokens, triton.cdiv(hidden, block_h))](
        x_ptr=x,
        out_ptr=out,
        H=hidden,
        top_k=top_k,
        scale=float(routed_scaling_factor),
        stride_xm=x.stride(0),
        stride_xk=x.stride(1),
        stride_om=out.stride(0),
        BLOCK_H=block_h,
        **programmatic_launch(x.device),
    )
    return out
