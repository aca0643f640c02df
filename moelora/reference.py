"""Slow, obviously-correct PyTorch oracle for the MoE + multi-LoRA math (docs/design.md §1, §2).

Every fast path in moelora (staged Triton kernels, all-in-one kernels, the layer) is tested against
the functions here. They favour clarity over speed: explicit Python loops over tokens and top-k
slots, fp32 (or fp64) arithmetic on the CPU, no fusion, no padding tricks.

The contract, for token ``t`` with adapter ``a`` (or none) and routed experts ``e_k`` with weights
``w_k``::

    W'    = W + s · B · A                 for each of gate, up, down of expert e, adapter a
    g     = W'_gate x      u = W'_up x
    h     = act(g) ⊙ u                    act = silu (or exact-erf gelu)
    y_k   = W'_down h
    out_t = rsf · Σ_k w_k · y_k           rsf = routed_scaling_factor

The LoRA delta of gate/up enters *before* the activation; it is not a separate FFN added at the end.
A token with no adapter (slot ``-1``) gets exactly the base output.

Routing helpers (:func:`softmax_topk`, :func:`grouped_topk`) reproduce Mixtral/Qwen3-MoE and
DeepSeek-V3 routing so tests and benchmarks can build realistic ``topk_weights`` / ``topk_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moelora.activations import GatedActivation, as_gated_activation
from moelora.adapter_weights import LoRAProjection, ReferenceLoRA

__all__ = [
    "LoRAProjection",
    "ReferenceLoRA",
    "reference_moe",
    "reference_moe_no_combine",
    "reference_moe_from_pool",
    "softmax_topk",
    "grouped_topk",
]



# --------------------------------------------------------------------------------------------------
# MoE forward
# --------------------------------------------------------------------------------------------------


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64 (for tight tests), otherwise float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _cpu(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=dtype)


def _convert_projections(
    projs: dict[int, LoRAProjection], in_features: int, out_features: int, dtype: torch.dtype, what: str,
    device: torch.device | str = "cpu",
) -> dict[int, LoRAProjection]:
    """Checks shapes and moves one module's LoRA weights to ``device`` (default the CPU) in the compute
    dtype."""
    out = {}
    for e, p in projs.items():
        r = p.a.shape[0]
        if p.a.dim() != 2 or p.a.shape[1] != in_features:
            raise ValueError(f"{what} expert {e}: A must be (r, {in_features}), got {tuple(p.a.shape)}")
        if p.b.dim() != 2 or tuple(p.b.shape) != (out_features, r):
            raise ValueError(f"{what} expert {e}: B must be ({out_features}, {r}), got {tuple(p.b.shape)}")
        out[int(e)] = LoRAProjection(p.a.detach().to(device=device, dtype=dtype),
                                     p.b.detach().to(device=device, dtype=dtype), float(p.scaling))
    return out


def _lora_delta(proj: LoRAProjection | None, v: torch.Tensor) -> torch.Tensor | None:
    """``s · B (A v)``, in PEFT's order (A first, then B, then the scaling); None if no LoRA."""
    if proj is None or proj.rank == 0:
        return None
    return (proj.b @ (proj.a @ v)) * proj.scaling


def _token_slots(token_adapter: Sequence[int] | torch.Tensor | None, m: int, n_adapters: int) -> list[int]:
    if token_adapter is None:
        return [-1] * m
    slots = (
        token_adapter.detach().cpu().reshape(-1).tolist()
        if isinstance(token_adapter, torch.Tensor)
        else [int(s) for s in token_adapter]
    )
    if len(slots) != m:
        raise ValueError(f"token_adapter has {len(slots)} entries for {m} tokens")
    for t, s in enumerate(slots):
        if not -1 <= s < n_adapters:
            raise ValueError(f"token {t}: adapter index {s} out of range [-1, {n_adapters})")
    return slots


def check_moe_shapes(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> tuple[int, int, int, int]:
    """ValueError saying what was expected for inconsistent MoE inputs; returns (M, H, E, I)."""
    if x.dim() != 2:
        raise ValueError(f"x must be (M, H), got {tuple(x.shape)}")
    m, hidden = x.shape
    if w13.dim() != 3 or w13.shape[2] != hidden or w13.shape[1] % 2:
        raise ValueError(f"w13 must be (E, 2I, {hidden}), got {tuple(w13.shape)}")
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(f"w2 must be ({num_experts}, {hidden}, {inter}), got {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != m or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_ids/topk_weights must both be (M={m}, k), got {tuple(topk_ids.shape)} "
            f"and {tuple(topk_weights.shape)}"
        )
    return m, hidden, num_experts, inter


def _used_adapters(adapters: list[ReferenceLoRA | None], slots: list[int], hidden: int, inter: int,
                   dtype: torch.dtype, device: torch.device | str) -> dict[int, ReferenceLoRA]:
    """Slot -> adapter, converted to ``dtype`` on ``device``: only the adapters some token uses are checked
    and converted (a None adapter means no delta)."""
    used = {}
    for s in sorted(set(slots) - {-1}):
        lora = adapters[s]
        if lora is not None:
            used[s] = ReferenceLoRA(
                gate=_convert_projections(lora.gate, hidden, inter, dtype, f"adapter {s} gate", device),
                up=_convert_projections(lora.up, hidden, inter, dtype, f"adapter {s} up", device),
                down=_convert_projections(lora.down, inter, hidden, dtype, f"adapter {s} down", device),
            )
    return used


def _check_ids_and_activation(topk_ids: torch.Tensor, activation: str | GatedActivation) -> GatedActivation:
    """Raises on non-integer expert ids or an unknown activation; returns the activation. Ids outside
    [0, E) are valid input: such a pair contributes nothing (docs/design.md §4)."""
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    return as_gated_activation(activation)


def reference_moe_no_combine(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    adapters: Sequence[ReferenceLoRA | None] | None = None,
    token_adapter: Sequence[int] | torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    apply_router_weight_on_input: bool = False,
    activation: str | GatedActivation = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-(token, k) weighted expert outputs, before the top-k sum.

    Shapes: ``x (M, H)``, ``w13 (E, 2I, H)`` (rows ``[0, I)`` gate, ``[I, 2I)`` up), ``w2 (E, H, I)``,
    ``topk_weights (M, k)``, ``topk_ids (M, k)``. ``adapters[token_adapter[t]]`` is token ``t``'s
    adapter; ``token_adapter[t] == -1`` (or ``adapters is None``) means no adapter.

    Returns ``(M, k, H)`` with, for token ``t``, slot ``k``, expert ``e = topk_ids[t, k]``,
    ``w = topk_weights[t, k]``::

        xin = w · x_t  if apply_router_weight_on_input  else x_t
        g   = W_gate[e] xin + b_gate[e] + s_g B_g (A_g xin)    u = W_up[e] xin + b_up[e] + s_u B_u (A_u xin)
        h   = act(g) ⊙ u
        y   = W_down[e] h + b_down[e] + s_d B_d (A_d h)

    with the biases ``w13_bias (E, 2I)`` (gate then up) and ``w2_bias (E, H)`` zero when None.
        out[t, k] = rsf · y      if apply_router_weight_on_input
                    rsf · w · y  otherwise

    ``s B (A v)`` is ``(W + s B A) v`` written the way PEFT computes it. An expert id outside ``[0, E)``
    (an expert filtered out, e.g. by expert parallelism, or a router bug) contributes zeros.

    Arithmetic is float32 on the CPU (float64 if ``x``, ``w13`` or ``w2`` is float64); the result is
    returned in that dtype on ``x``'s device.
    """
    m, hidden, num_experts, inter = check_moe_shapes(x, w13, w2, topk_weights, topk_ids)
    activation = _check_ids_and_activation(topk_ids, activation)

    dtype = _compute_dtype(x, w13, w2)
    adapters = list(adapters) if adapters is not None else []
    slots = _token_slots(token_adapter, m, len(adapters))
    top_k = topk_ids.shape[1]

    xs = _cpu(x, dtype)
    weights = _cpu(topk_weights, dtype)
    ids = topk_ids.detach().cpu().tolist()

    # Expert weights are converted lazily, one expert at a time: a real layer's w13/w2 can be far
    # larger in fp32 than the experts a test batch actually touches.
    expert_cache: dict[int, tuple[torch.Tensor, ...]] = {}

    def expert(e: int) -> tuple[torch.Tensor, ...]:
        if e not in expert_cache:
            w13_e = _cpu(w13[e], dtype)
            b13_e = _cpu(w13_bias[e], dtype) if w13_bias is not None else torch.zeros(2 * inter, dtype=dtype)
            b2_e = _cpu(w2_bias[e], dtype) if w2_bias is not None else torch.zeros(hidden, dtype=dtype)
            expert_cache[e] = (w13_e[:inter], w13_e[inter:], _cpu(w2[e], dtype), b13_e, b2_e)
        return expert_cache[e]

    lora_cache = _used_adapters(adapters, slots, hidden, inter, dtype, "cpu")

    out = torch.zeros(m, top_k, hidden, dtype=dtype)
    for t in range(m):
        lora = lora_cache.get(slots[t])
        for k in range(top_k):
            e = ids[t][k]
            if not 0 <= e < num_experts:
                continue
            w = weights[t, k]
            w_gate, w_up, w_down, b13, b2 = expert(e)
            xin = xs[t] * w if apply_router_weight_on_input else xs[t]

            g = w_gate @ xin + b13[:inter]
            u = w_up @ xin + b13[inter:]
            if lora is not None:
                dg = _lora_delta(lora.gate.get(e), xin)
                du = _lora_delta(lora.up.get(e), xin)
                g = g if dg is None else g + dg  # the gate/up delta enters BEFORE the activation
                u = u if du is None else u + du
            h = activation(g, u)

            y = w_down @ h + b2
            if lora is not None:
                dd = _lora_delta(lora.down.get(e), h)  # uses the activated h (base + LoRA)
                y = y if dd is None else y + dd

            if not apply_router_weight_on_input:
                y = y * w
            out[t, k] = y * routed_scaling_factor
    return out.to(x.device)


def reference_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    adapters: Sequence[ReferenceLoRA | None] | None = None,
    token_adapter: Sequence[int] | torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    apply_router_weight_on_input: bool = False,
    activation: str | GatedActivation = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """MoE layer output with per-token LoRA adapters, ``(M, H)``.

    ``out_t = rsf · Σ_k w_k · y_k`` with ``y_k = W'_down (act(W'_gate x_t) ⊙ W'_up x_t)`` and
    ``W' = W + s · B · A`` of token ``t``'s adapter (docs/design.md §1). With
    ``apply_router_weight_on_input`` the weight scales the input instead:
    ``out_t = rsf · Σ_k y_k(w_k · x_t)``.

    This is the top-k sum of :func:`reference_moe_no_combine` (see it for shapes, dtypes and the
    per-slot math).
    """
    per_slot = reference_moe_no_combine(
        x,
        w13,
        w2,
        topk_weights,
        topk_ids,
        adapters=adapters,
        token_adapter=token_adapter,
        routed_scaling_factor=routed_scaling_factor,
        apply_router_weight_on_input=apply_router_weight_on_input,
        activation=activation,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
    )
    return per_slot.sum(dim=1)


def reference_moe_grouped(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    adapters: Sequence[ReferenceLoRA | None] | None = None,
    token_adapter: Sequence[int] | torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    apply_router_weight_on_input: bool = False,
    activation: str | GatedActivation = "silu",
    combine: bool = True,
) -> torch.Tensor:
    """:func:`reference_moe`'s math, an (expert, adapter) group of routed pairs at a time, on ``x``'s
    device, ``(M, H)`` (``(M, k, H)`` per pair with ``combine=False``, as :func:`reference_moe_no_combine`):
    for big test batches on the GPU, where the per-pair loop of :func:`reference_moe` (one CPU matvec a
    pair, each reading its expert's weights again) takes minutes at real model shapes.

    Each group's rows are stacked into one matrix, so an expert's weights are read once per group. Same
    arguments and same per-pair formula as :func:`reference_moe_no_combine`; float32 (float64 if ``x``,
    ``w13`` or ``w2`` is float64), TF32 off on the GPU. Agrees with :func:`reference_moe` to float32
    rounding, not bit for bit (matrix products sum in another order; tests/test_reference.py).
    """
    m, hidden, num_experts, inter = check_moe_shapes(x, w13, w2, topk_weights, topk_ids)
    activation = _check_ids_and_activation(topk_ids, activation)
    dtype, device = _compute_dtype(x, w13, w2), x.device
    adapters = list(adapters) if adapters is not None else []
    slots = _token_slots(token_adapter, m, len(adapters))
    top_k = topk_ids.shape[1]
    loras = _used_adapters(adapters, slots, hidden, inter, dtype, device)

    # Group key per routed pair: expert * (adapters + 1) + slot + 1; pairs outside [0, E) skip.
    ids = topk_ids.to(device=device, dtype=torch.int64).reshape(-1)
    pair_slots = torch.tensor(slots, device=device, dtype=torch.int64).repeat_interleave(top_k)
    keys = torch.where((ids >= 0) & (ids < num_experts), ids * (len(adapters) + 1) + pair_slots + 1, -1)
    xs = x.detach().to(dtype)
    weights = topk_weights.detach().to(device=device, dtype=dtype).reshape(-1, 1)
    out = torch.zeros(m * top_k, hidden, dtype=dtype, device=device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # a true fp32 oracle on the GPU too
    try:
        for key in torch.unique(keys[keys >= 0]).tolist():
            e, slot = divmod(key, len(adapters) + 1)
            pairs = (keys == key).nonzero(as_tuple=True)[0]
            lora = loras.get(slot - 1)
            w = weights[pairs]
            w13_e = w13[e].to(dtype)
            xin = xs[pairs // top_k]
            xin = xin * w if apply_router_weight_on_input else xin
            g = xin @ w13_e[:inter].T
            u = xin @ w13_e[inter:].T
            if lora is not None:
                g = _add_lora_rows(g, lora.gate.get(e), xin)  # the gate/up delta enters BEFORE the activation
                u = _add_lora_rows(u, lora.up.get(e), xin)
            h = activation(g, u)
            y = _add_lora_rows(h @ w2[e].to(dtype).T, lora.down.get(e) if lora else None, h)  # activated h
            out[pairs] = (y if apply_router_weight_on_input else y * w) * routed_scaling_factor
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    out = out.reshape(m, top_k, hidden)
    return out.sum(dim=1) if combine else out


def _add_lora_rows(y: torch.Tensor, proj: LoRAProjection | None, v: torch.Tensor) -> torch.Tensor:
    """``y + s · B (A v)`` for each row ``v`` of ``v (n, in)``, in PEFT's order (A first, then B, then the
    scaling); ``y`` as it is without a LoRA."""
    if proj is None or proj.rank == 0:
        return y
    return y + ((v @ proj.a.T) @ proj.b.T) * proj.scaling


def reference_moe_from_pool(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    token_slots: Sequence[int] | torch.Tensor,
    gate_up_a: torch.Tensor,
    gate_up_b: torch.Tensor,
    down_a: torch.Tensor,
    down_b: torch.Tensor,
    slot_ranks: Sequence[int] | torch.Tensor,
    slot_scalings: Sequence[float] | torch.Tensor,
    routed_scaling_factor: float = 1.0,
    *,
    apply_router_weight_on_input: bool = False,
    activation: str | GatedActivation = "silu",
) -> torch.Tensor:
    """:func:`reference_moe` on adapters stored in the pool layout of docs/design.md §2, ``(M, H)``.

    Buffers (``L`` slots, ``R`` = max rank)::

        gate_up_a (L, E, 2R, H)   rows [0, R) gate A, rows [R, 2R) up A
        gate_up_b (L, E, 2I, R)   rows [0, I) gate B, rows [I, 2I) up B
        down_a    (L, E, R, I)
        down_b    (L, E, H, R)

    Slot ``a`` with rank ``r = slot_ranks[a]`` and scaling ``s = slot_scalings[a]`` is, for expert e::

        gate: A = gate_up_a[a, e, :r],       B = gate_up_b[a, e, :I, :r]
        up:   A = gate_up_a[a, e, R:R+r],    B = gate_up_b[a, e, I:, :r]
        down: A = down_a[a, e, :r],          B = down_b[a, e, :, :r]

    Rows/columns beyond ``r`` are never read, so whatever they hold cannot leak into the result.
    ``token_slots[t] == -1`` means no adapter. The math itself is :func:`reference_moe`'s.
    """
    if gate_up_a.dim() != 4:
        raise ValueError(f"gate_up_a must be (L, E, 2R, H), got {tuple(gate_up_a.shape)}")
    n_slots, num_experts, two_r, hidden = gate_up_a.shape
    max_rank = two_r // 2
    inter = w13.shape[1] // 2
    expected = {
        "gate_up_a": (gate_up_a, (n_slots, num_experts, 2 * max_rank, hidden)),
        "gate_up_b": (gate_up_b, (n_slots, num_experts, 2 * inter, max_rank)),
        "down_a": (down_a, (n_slots, num_experts, max_rank, inter)),
        "down_b": (down_b, (n_slots, num_experts, hidden, max_rank)),
    }
    for name, (buf, shape) in expected.items():
        if tuple(buf.shape) != shape:
            raise ValueError(f"{name} must be {shape}, got {tuple(buf.shape)}")

    ranks = [int(r) for r in (slot_ranks.tolist() if isinstance(slot_ranks, torch.Tensor) else slot_ranks)]
    scalings = [
        float(s)
        for s in (slot_scalings.tolist() if isinstance(slot_scalings, torch.Tensor) else slot_scalings)
    ]
    if len(ranks) != n_slots or len(scalings) != n_slots:
        raise ValueError(f"slot_ranks and slot_scalings must have L={n_slots} entries")

    adapters: list[ReferenceLoRA] = []
    for a, (r, s) in enumerate(zip(ranks, scalings, strict=True)):
        if not 0 <= r <= max_rank:
            raise ValueError(f"slot {a}: rank {r} out of range [0, {max_rank}]")
        lora = ReferenceLoRA()
        if r > 0:
            for e in range(num_experts):
                lora.gate[e] = LoRAProjection(gate_up_a[a, e, :r], gate_up_b[a, e, :inter, :r], s)
                lora.up[e] = LoRAProjection(
                    gate_up_a[a, e, max_rank : max_rank + r], gate_up_b[a, e, inter:, :r], s
                )
                lora.down[e] = LoRAProjection(down_a[a, e, :r], down_b[a, e, :, :r], s)
        adapters.append(lora)

    return reference_moe(
        x,
        w13,
        w2,
        topk_weights,
        topk_ids,
        adapters=adapters,
        token_adapter=token_slots,
        routed_scaling_factor=routed_scaling_factor,
        apply_router_weight_on_input=apply_router_weight_on_input,
        activation=activation,
    )


# --------------------------------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------------------------------


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral / Qwen3-MoE routing.

    ``p = softmax(logits)`` in float32; ``ids = topk(p, top_k)`` (largest first);
    ``w = p[ids]``, and with ``renormalize`` (Mixtral, Qwen3 ``norm_topk_prob``) ``w /= Σ w``.

    Args:
        router_logits: ``(M, E)``.
        top_k: experts per token.
        renormalize: rescale each token's weights to sum to 1.

    Returns:
        ``(topk_weights (M, top_k) float32, topk_ids (M, top_k) int32)``.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    n_group: int,
    topk_group: int,
    e_score_correction_bias: torch.Tensor | None = None,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring_func: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 group-limited routing, as transformers' ``DeepseekV3TopkRouter.forward`` computes it.

    In float32, for each token::

        scores  = sigmoid(logits)            (softmax(logits) with scoring_func="softmax")
        choice  = scores + bias              (bias only steers the SELECTION)
        group score   = sum of the 2 largest `choice` values in each of the n_group groups
        keep the topk_group best groups, set `choice` of every other expert to -inf
        ids     = topk(choice, top_k)        (largest first)
        w       = scores[ids]                (UNbiased scores)
        w      /= (Σ w + 1e-20)              if norm_topk_prob
        w      *= routed_scaling_factor

    Like transformers, this applies ``routed_scaling_factor`` to the weights. Apply it exactly once:
    either here (then pass ``routed_scaling_factor=1.0`` to the MoE) or in the MoE (then pass 1.0
    here); the result is the same number. DeepSeek-V2's "group_limited_greedy" (max per group,
    softmax scores) is a different rule and is not reproduced here.

    Args:
        router_logits: ``(M, E)``, ``E`` divisible by ``n_group``, at least 2 experts per group.
        top_k: experts per token, at most ``topk_group * E / n_group``.
        n_group: number of expert groups.
        topk_group: groups kept per token.
        e_score_correction_bias: ``(E,)`` selection bias (None = zeros).
        norm_topk_prob: renormalise the selected weights to sum to 1.
        routed_scaling_factor: multiplies the final weights.
        scoring_func: ``"sigmoid"`` (DeepSeek-V3) or ``"softmax"``.

    Returns:
        ``(topk_weights (M, top_k) float32, topk_ids (M, top_k) int32)``.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be (M, E), got {tuple(router_logits.shape)}")
    m, num_experts = router_logits.shape
    if num_experts % n_group:
        raise ValueError(f"E={num_experts} is not divisible by n_group={n_group}")
    per_group = num_experts // n_group
    if per_group < 2:
        raise ValueError("grouped_topk scores groups by their top-2 experts: need >= 2 experts per group")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    if not 1 <= top_k <= topk_group * per_group:
        raise ValueError(f"top_k={top_k} must be in [1, topk_group * E / n_group = {topk_group * per_group}]")

    logits = router_logits.float()
    if scoring_func == "sigmoid":
        scores = logits.sigmoid()
    elif scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        raise ValueError(f"scoring_func must be 'sigmoid' or 'softmax', got {scoring_func!r}")

    scores_for_choice = scores
    if e_score_correction_bias is not None:
        scores_for_choice = scores + e_score_correction_bias.to(device=scores.device, dtype=torch.float32)

    group_scores = scores_for_choice.view(m, n_group, per_group).topk(2, dim=-1).values.sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    expert_mask = group_mask.unsqueeze(-1).expand(m, n_group, per_group).reshape(m, num_experts)
    masked_choice = scores_for_choice.masked_fill(~expert_mask, float("-inf"))

    ids = torch.topk(masked_choice, k=top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)
