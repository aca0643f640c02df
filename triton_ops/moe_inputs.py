"""Checks of a fused MoE call's inputs, shared by the Triton launch wrapper and the PyTorch path."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_gate_up_halves(w13: torch.Tensor) -> bool:
    """``w13`` given as a ``(E, 2, I, H)`` view: dim 1 picks the gate (0) or up (1) half. It reads layouts
    that no ``(E, 2I, H)`` view can (gpt-oss' interleaved columns, ``(E, H, 2I)`` storage: strides
    ``(2IH, 1, 2, 2I)``; an ungated up projection read as both halves: stride 0 on dim 1) with no copy."""
    return w13.dim() == 4 and w13.shape[1] == 2


def gate_up_dims(w13: torch.Tensor) -> tuple[int, int, int]:
    """``(E, 2I, H)`` of a gate/up weight: ``(E, 2I, H)`` itself or a ``(E, 2, I, H)`` halves view."""
    if is_gate_up_halves(w13):
        return int(w13.shape[0]), 2 * int(w13.shape[2]), int(w13.shape[3])
    return tuple(int(d) for d in w13.shape)


def expert_gate_up(w13: torch.Tensor, expert: int) -> torch.Tensor:
    """Expert ``expert``'s ``(2I, H)`` gate rows then up rows (a copy for a halves view)."""
    w = w13[expert]
    return w.reshape(-1, w.shape[-1]) if is_gate_up_halves(w13) else w


def check_moe_inputs(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    float_dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    weight_dtype: torch.dtype | None = None,
    values_per_element: int = 1,
) -> None:
    """Raises ValueError/TypeError that say what was expected for inconsistent MoE inputs.
    ``weight_dtype``: the experts' dtype where it is not x's (block-scaled FP8 weights, MXFP4's uint8);
    ``values_per_element``: weight values a stored element holds along K (MXFP4: 2, so w13 is
    (E, 2I, H / 2) and w2 (E, H, I / 2)).

    Expert ids are not range-checked (that would read the device): a pair whose id is outside
    ``[0, E)`` contributes nothing on every path."""
    for name, tensor in (("x", x), ("w13", w13), ("w2", w2), ("topk_weights", topk_weights),
                         ("topk_ids", topk_ids)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if (w13.dim() != 3 and not is_gate_up_halves(w13)) or w2.dim() != 3:
        raise ValueError(
            f"w13 must be (E, 2*I, H) and w2 (E, H, I); got {tuple(w13.shape)} and {tuple(w2.shape)}"
        )
    num_experts, two_i, hidden = gate_up_dims(w13)
    hidden *= values_per_element
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(
            f"x must be (num_tokens, H={hidden}) to match the experts' w13 (E, 2I, H) = {tuple(w13.shape)}, "
            f"got shape {tuple(x.shape)}"
        )
    if two_i % 2:
        raise ValueError(f"w13's second dim must be 2*I (gate rows then up rows), got {two_i}")
    w2_shape = (num_experts, hidden, two_i // 2 // values_per_element)
    if tuple(w2.shape) != w2_shape:
        layout = "(E, H, I)" if values_per_element == 1 else f"(E, H, I / {values_per_element})"
        raise ValueError(f"w2 must be {layout} = {w2_shape} to match w13 {tuple(w13.shape)}, got "
                         f"{tuple(w2.shape)}")
    if x.dtype not in float_dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in float_dtypes)
        raise TypeError(f"x must be one of {names}, got {x.dtype}")
    want = x.dtype if weight_dtype is None else weight_dtype
    if w13.dtype != want or w2.dtype != want:
        whose = "x's dtype" if weight_dtype is None else "dtype"
        raise TypeError(f"w13 and w2 must have {whose} {want}, got {w13.dtype} and {w2.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids must be (num_tokens={x.shape[0]}, top_k), got {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights {tuple(topk_weights.shape)} must have topk_ids' shape {tuple(topk_ids.shape)}"
        )
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be a float tensor, got {topk_weights.dtype}")
    for name, tensor in (("w13", w13), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device} but x is on {x.device}: all must share a device")
