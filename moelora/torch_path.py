"""Vectorised PyTorch MoE + multi-LoRA forward on the pool layout (the path used for CPU tensors).

Same math as :func:`moelora.reference.reference_moe` (docs/design.md §1), but without Python loops over
tokens: one iteration per expert that has (token, k) pairs, with the base GEMMs of all its pairs done
as one matmul and the LoRA of all its pairs done at once.

Inside an expert, the ``u`` distinct slots its pairs use are gathered from the pool's arena (or
dense buffers) in the dense layout (``u <= L``). The shrink multiplies every pair by the A of all
``u`` slots in one GEMM and keeps the pair's own block; the expand places each pair's rank vector in
its slot's block of a zero ``(n, u·R)`` matrix and multiplies by the ``u`` B's laid side by side, so
each pair only ever sees its own adapter. Rank rows past a slot's rank gather as zeros, so using all
``R`` rank columns is exact.
Pairs of tokens with slot ``-1`` are not touched at all: such a token gets exactly the base output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from moelora.activations import GatedActivation, as_gated_activation
from moelora.batch_info import MoELoRABatchInfo
from moelora.pool import DenseLoRA, LoRALayerBuffers

if TYPE_CHECKING:
    from triton_ops.fp8 import BlockFp8Weights

__all__ = ["dequantize_fp8_blocks", "fp8_group_roundtrip", "moe_lora_forward_torch", "quantize_fp8_blocks"]

def _check_buffers(buffers: LoRALayerBuffers | DenseLoRA, num_experts: int, hidden: int, inter: int) -> int:
    """Checks the buffer shapes against the base weights; returns the slot count."""
    if isinstance(buffers, LoRALayerBuffers):
        w = buffers.gate_up_a
        got = (w.num_experts, w.cols, buffers.gate_up_b.cols, buffers.down_a.cols)
        if got != (num_experts, hidden, 2 * inter, inter):
            raise ValueError(f"the pool's buffers hold E={got[0]}, H={got[1]}, I={got[3]} but the base "
                             f"weights have E={num_experts}, H={hidden}, I={inter}")
        return w.num_slots
    if not isinstance(buffers, DenseLoRA):
        raise TypeError(f"buffers must be the pool's LoRALayerBuffers or a DenseLoRA, got "
                        f"{type(buffers).__name__}")
    if buffers.gate_up_a.dim() != 4:
        raise ValueError(f"gate_up_a must be (L, E, 2R, H), got {tuple(buffers.gate_up_a.shape)}")
    n_slots, _, two_r, _ = buffers.gate_up_a.shape
    r = two_r // 2
    expected = {
        "gate_up_a": (buffers.gate_up_a, (n_slots, num_experts, 2 * r, hidden)),
        "gate_up_b": (buffers.gate_up_b, (n_slots, num_experts, 2 * inter, r)),
        "down_a": (buffers.down_a, (n_slots, num_experts, r, inter)),
        "down_b": (buffers.down_b, (n_slots, num_experts, hidden, r)),
    }
    for name, (buf, shape) in expected.items():
        if tuple(buf.shape) != shape:
            raise ValueError(
                f"LoRA buffer {name} must be {shape} for these base weights, got {tuple(buf.shape)}"
            )
    return n_slots


def _expert_lora(buffers: LoRALayerBuffers | DenseLoRA, slots: torch.Tensor, e: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate_up_a (u, 2R, H), gate_up_b (u, 2I, R), down_a (u, R, I), down_b (u, H, R) of expert ``e`` for
    the ``u`` slots ``slots``, in the dense layout."""
    if isinstance(buffers, LoRALayerBuffers):
        return tuple(t[:, 0] for t in buffers.dense(slots, [e]).tensors())
    return tuple(t[slots, e] for t in buffers.tensors())


def fp8_group_roundtrip(v: torch.Tensor, group: int) -> torch.Tensor:
    """``v`` (n, K) quantized to float8_e4m3fn per row and group of ``group`` columns and scaled back, in
    ``v``'s dtype: what a block-scaled GEMM multiplies (``triton_ops.fp8``'s activation quantization)."""
    from triton_ops.fp8 import FP8_DTYPE, FP8_MAX, MIN_AMAX

    n, k = v.shape
    padded = F.pad(v.float(), (0, -k % group)).view(n, -1, group)
    scale = padded.abs().amax(dim=2, keepdim=True).clamp_min(MIN_AMAX) / FP8_MAX
    q = (padded / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return (q.float() * scale).view(n, -1)[:, :k].to(v.dtype)


def dequantize_fp8_blocks(weight: torch.Tensor, scale: torch.Tensor, block_shape: tuple[int, int],
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight`` (..., N, K) float8_e4m3fn times its block scales ``scale`` (..., cdiv(N, bn), cdiv(K, bk)),
    in ``dtype``."""
    block_n, block_k = block_shape
    n, k = weight.shape[-2:]
    full = scale.to(dtype).repeat_interleave(block_n, dim=-2).repeat_interleave(block_k, dim=-1)
    return weight.to(dtype) * full[..., :n, :k]


def quantize_fp8_blocks(weight: torch.Tensor, block_shape: tuple[int, int] = (128, 128)
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (..., N, K) as float8_e4m3fn with one fp32 scale per (block_n, block_k) block (the
    checkpoints' ``weight_scale_inv`` layout): scale = amax(block) / 448. One (N, K) matrix at a time, so
    the fp32 working copy is one matrix's, not the whole tensor's."""
    from triton_ops.fp8 import FP8_DTYPE

    block_n, block_k = block_shape
    n, k = weight.shape[-2:]
    lead = weight.shape[:-2]
    out = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scales = torch.empty((*lead, -(-n // block_n), -(-k // block_k)), dtype=torch.float32,
                         device=weight.device)
    flat_w, flat_out = weight.reshape(-1, n, k), out.view(-1, n, k)
    flat_scales = scales.view(-1, *scales.shape[-2:])
    for i in range(flat_w.shape[0]):
        flat_out[i], flat_scales[i] = _quantize_matrix(flat_w[i], block_n, block_k)
    return out, scales


def _quantize_matrix(weight: torch.Tensor, block_n: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    from triton_ops.fp8 import FP8_DTYPE, FP8_MAX, MIN_AMAX

    n, k = weight.shape
    padded = F.pad(weight.float(), (0, -k % block_k, 0, -n % block_n))
    blocks = padded.view(padded.shape[0] // block_n, block_n, padded.shape[1] // block_k, block_k)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(MIN_AMAX) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(padded.shape)[:n, :k], scale


def _expert_weight(weight: torch.Tensor, e: int, fp8: BlockFp8Weights | None, scale_name: str,
                   dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Expert ``e``'s weight in ``dtype`` on ``device``, dequantized when block-scaled."""
    if fp8 is None:
        return weight[e].to(device=device, dtype=dtype).reshape(-1, weight.shape[-1])  # halves view: (2I, H)
    scale = getattr(fp8, scale_name)[e]
    return dequantize_fp8_blocks(weight[e], scale, fp8.block_shape, dtype).to(device)


def _shrink(v: torch.Tensor, a: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Per pair ``A[slot] @ v``: ``v (n, K)``, ``a (u, R', K)`` -> ``(n, R')``, one GEMM over all u slots."""
    u, rr, k = a.shape
    allv = (v @ a.reshape(u * rr, k).T).view(-1, u, rr)
    return allv[torch.arange(v.shape[0], device=v.device), local]


def _expand(t: torch.Tensor, b: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Per pair ``B[slot] @ t``: ``t (n, R)``, ``b (u, N, R)`` -> ``(n, N)``, one GEMM.

    ``t`` is placed in its slot's block of a zero ``(n, u, R)`` array, so the other slots' B columns
    are multiplied by exact zeros.
    """
    u, nout, r = b.shape
    n = t.shape[0]
    padded = t.new_zeros(n, u, r)
    padded[torch.arange(n, device=t.device), local] = t
    return padded.view(n, u * r) @ b.permute(1, 0, 2).reshape(nout, u * r).T


def moe_lora_forward_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    buffers: LoRALayerBuffers | DenseLoRA | None,
    batch: MoELoRABatchInfo | None,
    *,
    routed_scaling_factor: float = 1.0,
    activation: str | GatedActivation = "silu",
    apply_router_weight_on_input: bool = False,
    fp8: BlockFp8Weights | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """MoE layer output with per-token LoRA adapters from the pool, ``(M, H)`` in ``x.dtype``.

    For token ``t`` with slot ``a = batch.token_slots[t]`` (``-1`` = none) and its (expert ``e``,
    weight ``w``) pairs (docs/design.md §1)::

        xin = w · x_t if apply_router_weight_on_input else x_t
        gu  = w13[e] xin + b13[e] + s_a · [B_gate(A_gate xin); B_up(A_up xin)]     (before the activation)
        h   = act(gu[:I]) ⊙ gu[I:]
        y   = w2[e] h + b2[e] + s_a · B_down(A_down h)                             (on the activated h)
        out_t = rsf · Σ_k (w · y  or  y with the weight on the input)

    ``b13 (E, 2I)`` / ``b2 (E, H)`` are ``w13_bias`` / ``w2_bias`` (zero when None).
    ``A/B`` come from ``buffers`` (one layer's :class:`LoRALayerBuffers`, or a :class:`DenseLoRA`) at
    slot ``a``, ``s_a`` from
    ``batch.slot_scalings``. ``buffers=None``, ``batch=None`` or a batch without adapters gives the
    base MoE. A pair whose expert id is outside ``[0, E)`` contributes nothing. Computed in float32
    (float64 if ``x`` is float64) on ``x``'s device; inputs are checked as on the Triton path.

    Shapes: ``x (M, H)``, ``w13 (E, 2I, H)`` (or its ``(E, 2, I, H)`` halves view), ``w2 (E, H, I)``,
    ``topk_weights/topk_ids (M, k)``; any strides.

    ``fp8``: the block scales of float8_e4m3fn ``w13`` / ``w2``. The base products then use the
    dequantized weights and x and h as the Triton path quantizes them (per token and ``block_k`` group;
    h rounded to x's dtype first, as the Triton path stores it); the LoRA terms read x and h unquantized.
    """
    # Imported here: the triton_ops package loads its kernels, which must wait for TRITON_INTERPRET.
    from triton_ops.fp8 import FP8_DTYPE, check_block_fp8, uses_block_fp8
    from triton_ops.moe_inputs import FLOAT_DTYPES, check_moe_inputs, gate_up_dims

    block_scaled = fp8 is not None or uses_block_fp8(w13, w2)
    check_moe_inputs(x, w13, w2, topk_weights, topk_ids, float_dtypes=(*FLOAT_DTYPES, torch.float64),
                     weight_dtype=FP8_DTYPE if block_scaled else None)
    if block_scaled:
        check_block_fp8(w13, w2, fp8)
    m, hidden = x.shape
    num_experts, two_i, _ = gate_up_dims(w13)
    inter = two_i // 2
    activation = as_gated_activation(activation)

    if batch is not None and (batch.num_tokens != m or batch.token_slots.numel() != m):
        raise ValueError(f"batch describes {batch.num_tokens} tokens but x has {m}")
    use_lora = buffers is not None and batch is not None and batch.has_lora
    n_slots = 0
    if buffers is not None:
        n_slots = _check_buffers(buffers, num_experts, hidden, inter)

    dev = x.device
    cdtype = torch.float64 if torch.float64 in (x.dtype, w13.dtype, w2.dtype) else torch.float32
    top_k = topk_ids.shape[1]
    out = torch.zeros(m, hidden, dtype=cdtype, device=dev)
    if m == 0 or top_k == 0:
        return out.to(x.dtype)

    xf = x.to(cdtype)
    x_base = xf  # what the base GEMM1 multiplies
    if block_scaled:
        x_base = fp8_group_roundtrip(x, fp8.block_shape[1]).to(cdtype)
    flat_ids = topk_ids.reshape(-1).to(device=dev, dtype=torch.long)
    flat_w = topk_weights.reshape(-1).to(device=dev, dtype=cdtype)
    flat_tok = torch.arange(m, device=dev).repeat_interleave(top_k)
    valid = (flat_ids >= 0) & (flat_ids < num_experts)
    # Pairs sorted by expert (stable); pairs outside [0, E) sort last and are never used.
    order = torch.argsort(flat_ids.masked_fill(~valid, num_experts), stable=True)
    counts = torch.bincount(flat_ids[valid], minlength=num_experts).tolist()

    pair_slots = scalings = None
    if use_lora:
        assert buffers is not None and batch is not None
        token_slots = batch.token_slots.to(device=dev, dtype=torch.long)
        if int(token_slots.min()) < -1 or int(token_slots.max()) >= n_slots:
            raise ValueError(f"batch.token_slots holds a slot outside [-1, {n_slots})")
        pair_slots = token_slots[flat_tok]
        scalings = batch.slot_scalings.to(device=dev, dtype=cdtype)

    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        tok = flat_tok[pairs]
        w = flat_w[pairs]
        xin, xin_base = xf[tok], x_base[tok]
        if apply_router_weight_on_input:
            xin, xin_base = xin * w[:, None], xin_base * w[:, None]

        gu = xin_base @ _expert_weight(w13, e, fp8, "w13_scale", cdtype, dev).T  # (n, 2I), all pairs at once
        if w13_bias is not None:
            gu = gu + w13_bias[e].to(device=dev, dtype=cdtype)

        sel = None
        if pair_slots is not None:
            slots = pair_slots[pairs]
            sel = (slots >= 0).nonzero().squeeze(1)
            if sel.numel() == 0:
                sel = None
        if sel is not None:
            assert buffers is not None and scalings is not None
            s_sel = slots[sel]
            uniq, local = torch.unique(s_sel, return_inverse=True)
            weights_of = _expert_lora(buffers, uniq.to(buffers.gate_up_a.device), e)
            gua, gub, da, db = (t.to(device=dev, dtype=cdtype) for t in weights_of)
            big_r = gua.shape[1] // 2
            scale = scalings[s_sel][:, None]

            a1 = _shrink(xin[sel], gua, local)  # (n', 2R): [A_gate x ; A_up x]
            d_gate = _expand(a1[:, :big_r], gub[:, :inter], local)
            d_up = _expand(a1[:, big_r:], gub[:, inter:], local)
            gu[sel] = gu[sel] + torch.cat([d_gate, d_up], dim=1) * scale  # before the activation

        h = activation(gu[:, :inter], gu[:, inter:])
        h_base = h
        if block_scaled:
            h_base = fp8_group_roundtrip(h.to(x.dtype), fp8.block_shape[1]).to(cdtype)
        y = h_base @ _expert_weight(w2, e, fp8, "w2_scale", cdtype, dev).T  # (n, H)
        if w2_bias is not None:
            y = y + w2_bias[e].to(device=dev, dtype=cdtype)

        if sel is not None:
            assert buffers is not None
            y[sel] = y[sel] + _expand(_shrink(h[sel], da, local), db, local) * scale  # on the activated h

        if not apply_router_weight_on_input:
            y = y * w[:, None]
        out.index_add_(0, tok, y)

    if routed_scaling_factor != 1.0:
        out = out * routed_scaling_factor
    return out.to(x.dtype)
