"""Gated activation of the GEMM1 output, for callers that keep GEMM1 and the activation apart.

Semantics:  out[t, n] = act(x[t, n]) * x[t, N + n]   for n < N, act = silu or exact (erf) gelu
Grid:       (T, cdiv(N, BLOCK_N))

``fused_experts`` fuses this into GEMM1's epilogue; the kernel is kept for the staged paths and for
engines that want the unfused op.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from triton_ops.gemm_tiles import _gated_activation, activation_args
from triton_ops.hostmath import cdiv, next_power_of_2
from triton_ops.launch import launch


@triton.jit
def _act_and_mul_kernel(
    # Pointers
    x_ptr,  # (T, 2N) fp16/bf16/fp32
    out_ptr,  # (T, N) same dtype
    # Sizes
    N,
    # Strides
    stride_xt,
    stride_ot,
    # Meta-parameters
    ACTIVATION: tl.constexpr,
    ACT_LIMIT: tl.constexpr,
    ACT_ALPHA: tl.constexpr,
    ACT_UP_OFFSET: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < N
    gate = tl.load(x_ptr + row * stride_xt + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xt + N + offs, mask=mask, other=0.0).to(tl.float32)
    out = _gated_activation(gate, up, ACTIVATION, ACT_LIMIT, ACT_ALPHA, ACT_UP_OFFSET)
    tl.store(out_ptr + row * stride_ot + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul(x: torch.Tensor, activation: Any = "silu", out: torch.Tensor | None = None) -> torch.Tensor:
    """``act(x[:, :N], x[:, N:])`` for x (T, 2N) (``activation``: a name or a
    ``moelora.activations.GatedActivation``, ``activation_args``); fp32 math, result in x's dtype."""
    act = activation_args(activation)
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be (tokens, 2*N), got shape {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    tokens, n = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((tokens, n), dtype=x.dtype, device=x.device)
    elif out.shape != (tokens, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be a row-major ({tokens}, {n}) {x.dtype} tensor, got {tuple(out.shape)}")
    if tokens == 0:
        return out
    block_n = min(1024, next_power_of_2(n))
    launch(
        _act_and_mul_kernel,
        (tokens, cdiv(n, block_n)),
        x_ptr=x,
        out_ptr=out,
        N=n,
        stride_xt=x.stride(0),
        stride_ot=out.stride(0),
        **act,
        BLOCK_N=block_n,
    )
    return out


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[:, :N]) * x[:, N:]`` for x (T, 2N)."""
    return act_and_mul(x, "silu", out)


def gelu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu(x[:, :N]) * x[:, N:]`` (exact erf gelu) for x (T, 2N)."""
    return act_and_mul(x, "gelu", out)
