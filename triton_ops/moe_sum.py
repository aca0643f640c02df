"""Top-k combine of per-pair expert outputs.

Semantics:  out[t, :] = scale * sum_j x[t, j, :]     (fp32 accumulation, deterministic order)
Grid:       (M, cdiv(H, BLOCK_H))

At decode the same sum also runs inside GEMM2 (``finish_topk_sum_if_last``): the last GEMM2 program
of an N-tile column sums that column for every token, in the same order and precision as
``_moe_sum_kernel``, so the result is bit for bit the one of the separate launch it replaces.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops.hostmath import cdiv, next_power_of_2
from triton_ops.launch import launch


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
):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(top_k):
        acc += tl.load(x_ptr + token * stride_xm + j * stride_xk + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_om + offs, (acc * scale).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def finish_topk_sum_if_last(
    pairs_ptr,  # (numel, H) per-pair outputs of GEMM2, row p = t * top_k + j
    out_ptr,  # (num_tokens, H) same dtype, out
    counter_ptr,  # () int32 arrivals of this N-tile column; zero before the GEMM2 launch
    arrivals,  # programs of this column that reach this point (the used M blocks)
    offs_n,  # (BLOCK_N,) the column's output columns
    col_valid,  # (BLOCK_N,)
    num_tokens,
    top_k,
    stride_pm,
    stride_pn,
    stride_om,
    stride_on,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Called by every GEMM2 program of a column after it stored its rows: the last one to arrive sums
    the column for every token, out[t, n] = sum_j pairs[t * top_k + j, n] in fp32, j in order.

    The CTA barrier puts every thread's stores before the one arrival, whose release (acq_rel, GPU
    scope) publishes them; the last arrival's acquire makes every other program's rows visible to it,
    and it reads them from L2 (.cg), never from a possibly stale L1 line."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == arrivals - 1:
        cols = offs_n.to(tl.int64)
        for t0 in range(0, num_tokens, BLOCK_T):
            tokens = t0 + tl.arange(0, BLOCK_T)
            mask = (tokens < num_tokens)[:, None] & col_valid[None, :]
            acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
            for j in range(top_k):
                rows = (tokens * top_k + j).to(tl.int64)
                acc += tl.load(pairs_ptr + rows[:, None] * stride_pm + cols[None, :] * stride_pn, mask=mask,
                               other=0.0, cache_modifier=".cg").to(tl.float32)
            out_ptrs = out_ptr + tokens.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


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
    block_h = min(1024, next_power_of_2(hidden))
    launch(_moe_sum_kernel, (tokens, cdiv(hidden, block_h)),
        x_ptr=x,
        out_ptr=out,
        H=hidden,
        top_k=top_k,
        scale=float(routed_scaling_factor),
        stride_xm=x.stride(0),
        stride_xk=x.stride(1),
        stride_om=out.stride(0),
        BLOCK_H=block_h,
    )
    return out
