"""What attach checks of an experts module before it swaps it: the activation it computes (probed from its
``act_fn``, or from an overridden ``_apply_gate``), whether the layer can serve it exactly (PEFT wrapping,
shapes, biases, dtypes, devices, FP8 scales; :func:`_check_supported`), and, for classes whose math was
not read, a numerical check of its forward against the layer's formula on random tokens
(:func:`_verify_math`). The per-family cases it reads are in :mod:`moelora.integrations.families`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from moelora.activations import GatedActivation
from moelora.integrations.families import (
    _FP8_EXPERTS_CLASS,
    _FP8_GATE_VARIANTS,
    _POOL_DTYPES,
    UnsupportedModelError,
    _dense_form,
    _dense_routing,
    _expert_biases,
    _expert_shape,
    _expert_weights,
    _gate_up_name,
    _halves_view,
    _identity_experts,
    _identity_term,
    _per_pair,
    _post_expert_norm,
    _raw_biases,
    _RoutedBlockExperts,
    _storage_of,
    _transposed,
)
from moelora.layer import fp8_scales_of
from moelora.torch_path import moe_lora_forward_torch

# --------------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------------


def _default_apply_gate() -> Any:
    try:
        from transformers.integrations.moe import _default_apply_gate as fn
    except Exception:  # pragma: no cover - older/newer transformers without it
        return None
    return fn


def _activation_of(name: str, module: nn.Module) -> str:
    """``"silu"``, ``"gelu"`` (exact) or ``"gelu_tanh"``, from what ``module.act_fn`` computes on a probe."""
    act = getattr(module, "act_fn", None)
    if not callable(act):
        raise UnsupportedModelError(f"experts module {name!r} ({type(module).__name__}) has no act_fn")
    probe = torch.linspace(-8.0, 8.0, 161, dtype=torch.float32)
    try:
        with torch.no_grad():
            y = act(probe)
    except Exception as exc:
        raise UnsupportedModelError(f"experts module {name!r}: its act_fn cannot be probed ({exc})") from exc
    if isinstance(y, torch.Tensor) and y.shape == probe.shape:
        for kind in ("silu", "gelu", "gelu_tanh"):
            if torch.allclose(y, GatedActivation(kind)(probe, torch.ones_like(probe)), rtol=1e-5, atol=1e-6):
                return kind
    raise UnsupportedModelError(
        f"experts module {name!r} ({type(module).__name__}) uses the activation {act!r}; the MoE LoRA layer "
        "implements SiLU, exact GELU and tanh GELU (and the clamped SwiGLUs, through _apply_gate)"
    )


def _number_attr(module: nn.Module, names: tuple[str, ...]) -> float | None:
    """The first of ``names`` that ``module`` holds as a finite number."""
    for attr in names:
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    return None


def _gate_of(name: str, module: nn.Module, apply_gate: Any, width: int) -> GatedActivation:
    """The :class:`GatedActivation` that the module's own ``_apply_gate`` computes, found by running it on
    ``width`` (2I) probe columns reaching past its clamp limit (gate and up halves in ``chunk(2)`` order,
    or alternating columns where the module interleaves them, gpt-oss), against the kinds its constants
    (``limit``/``swiglu_limit``, ``alpha``/``swiglu_alpha``) allow. UnsupportedModelError where none
    matches (a soft cap, another formula)."""
    where = f"experts module {name!r} ({type(module).__name__})"
    limit = _number_attr(module, ("limit", "swiglu_limit"))
    alpha = _number_attr(module, ("alpha", "swiglu_alpha"))
    candidates = []
    if limit is not None and limit > 0:
        for a in dict.fromkeys((alpha or 1.0, 1.0)):
            candidates += [GatedActivation("clamped_swiglu", limit, a, 1.0),
                           GatedActivation("clamped_swiglu", limit, a, 0.0)]
        candidates.append(GatedActivation("clamped_silu_after", limit))
    caps = [_number_attr(getattr(getattr(module, "act_fn", None), part, None), ("softcap",))
            for part in ("gate_softcap", "up_softcap")]
    if all(c is not None and c > 0 for c in caps):  # Inkling-2's soft-capped SwiGLU module
        candidates.append(GatedActivation("softcapped_swiglu", caps[0], up_limit=caps[1]))
    elif callable(getattr(module, "act_fn", None)):
        try:
            candidates.append(GatedActivation(_activation_of(name, module)))
        except UnsupportedModelError:
            pass
    gen = torch.Generator().manual_seed(0)
    scale = 2.0 * max([c for c in (limit, *caps) if c is not None and c > 0] or [4.0])
    probe = (torch.rand(64, width, generator=gen, dtype=torch.float32) * 2.0 - 1.0) * scale
    try:
        with torch.no_grad():
            want = apply_gate(module, probe)
    except Exception as exc:
        raise UnsupportedModelError(f"{where}: its _apply_gate cannot be probed ({exc})") from exc
    gate, up = probe[..., 0::2], probe[..., 1::2]
    if getattr(module, "is_concatenated", True):
        gate, up = probe.chunk(2, dim=-1)
    for candidate in candidates:
        got = candidate(gate, up)
        if isinstance(want, torch.Tensor) and want.shape == got.shape and torch.allclose(
                want.float(), got, rtol=1e-5, atol=1e-5 * float(got.abs().max().clamp_min(1.0))):
            return candidate
    raise UnsupportedModelError(
        f"{where} overrides _apply_gate with a gated activation moelora does not compute (tried "
        f"{', '.join(map(str, candidates)) or 'none: no limit/alpha constants and no act_fn'}): the layer "
        "computes act(gate) * up for SiLU/GELU/tanh GELU/ReLU and the clamped SwiGLUs"
    )


def _ungated_activation_of(name: str, module: nn.Module) -> GatedActivation:
    """Ungated experts (``down(act(up x))``) are served when ``act`` is the squared ReLU: ``relu(u) * u``
    with the up rows standing as the gate too."""
    act = getattr(module, "act_fn", None)
    probe = torch.linspace(-8.0, 8.0, 161, dtype=torch.float32)
    try:
        with torch.no_grad():
            y = act(probe) if callable(act) else None
    except Exception as exc:
        raise UnsupportedModelError(f"experts module {name!r}: its act_fn cannot be probed ({exc})") from exc
    if isinstance(y, torch.Tensor) and y.shape == probe.shape and torch.allclose(
            y, torch.relu(probe) ** 2, rtol=1e-5, atol=1e-6):
        return GatedActivation("relu")
    raise UnsupportedModelError(
        f"experts module {name!r} ({type(module).__name__}) has no gate (up -> act -> down) with the "
        f"activation {act!r}; ungated experts are served when act is the squared ReLU (relu(u) * u)"
    )


# --------------------------------------------------------------------------------------------------
# Whether the layer serves a module exactly
# --------------------------------------------------------------------------------------------------


def _check_supported(name: str, module: nn.Module, parent: nn.Module | None) -> str | GatedActivation:
    """Raises UnsupportedModelError naming the reason if ``module`` cannot be served exactly; returns its
    activation (a name, or the :class:`GatedActivation` its own ``_apply_gate`` computes)."""
    cls = type(module).__name__
    where = f"experts module {name!r} ({cls})"
    if parent is not None and (hasattr(parent, "lora_A") or type(parent).__name__ == "ParamWrapper"):
        raise UnsupportedModelError(
            f"{where} is wrapped by PEFT ({type(parent).__name__}); attach to the plain base model and load "
            "the adapters with handle.load_adapter instead"
        )
    if torch.nn.utils.parametrize.is_parametrized(module):
        raise UnsupportedModelError(
            f"{where} has parametrized tensors (a PEFT target_parameters LoRA?); attach to the plain base "
            "model"
        )
    if getattr(module, "has_post_expert_norm", False) and _post_expert_norm(module) is None:
        raise UnsupportedModelError(
            f"{where} applies a norm after each expert but holds no post_expert_norm module to run: the MoE "
            "LoRA layer computes sum_k w_k * norm(down(act(gate x, up x)))"
        )
    ungated = _gate_up_name(module) == "up_proj"
    default_gate = _default_apply_gate()
    custom_gate = getattr(type(module), "_apply_gate", default_gate)
    fp8_plain_gate = cls == _FP8_EXPERTS_CLASS and all(getattr(module, a, None) is None
                                                 for a in _FP8_GATE_VARIANTS)
    overridden = (default_gate is not None and custom_gate is not default_gate and not fp8_plain_gate
                  and not ungated)
    raw13, w2 = getattr(module, _gate_up_name(module)), module.down_proj
    halves = _halves_view(module)
    biases = [b for b in _raw_biases(module) if b is not None]
    transposed = _transposed(module)
    if cls == _FP8_EXPERTS_CLASS and (overridden or halves or biases or transposed):
        raise UnsupportedModelError(
            f"{where}: FP8 experts are served with bias-free [gate; up] weights stored (E, 2I, H) and the "
            "plain gate (not an FP8 gate variant: soft caps, a clamped SwiGLU; not interleaved, transposed "
            "or ungated)"
        )
    reshaped = halves or _transposed(module) or _identity_experts(module) or _post_expert_norm(module)
    if reshaped and any(type(t).__name__ == "DTensor" for t in (raw13, w2)):
        raise UnsupportedModelError(f"{where} stores its weights {_storage_of(module)} and is sharded by a "
                                  "parallel plan; moelora serves such experts unsharded")
    if biases and any(type(t).__name__ == "DTensor" for t in (raw13, w2)):
        raise UnsupportedModelError(f"{where} has expert biases and is sharded by a parallel plan; moelora "
                                  "serves experts with biases unsharded")
    e, two_i, h = _expert_shape(module)
    want13 = (e + _identity_experts(module), two_i // 2 if ungated else two_i, h)
    if _transposed(module):
        want13 = (want13[0], want13[2], want13[1])
    want2 = (e, two_i // 2, h) if _transposed(module) else (e, h, two_i // 2)
    if tuple(raw13.shape) != want13 or tuple(w2.shape) != want2:
        raise UnsupportedModelError(
            f"{where}: {_gate_up_name(module)} {tuple(raw13.shape)} and down_proj {tuple(w2.shape)} are not "
            f"{want13} and {want2} ({_storage_of(module)})"
        )
    for bias, shape in zip(_raw_biases(module), ((want13[0], two_i // 2 if ungated else two_i), (e, h)),
                           strict=True):
        if bias is not None and (tuple(bias.shape) != shape or bias.dtype != raw13.dtype
                                 or bias.device != raw13.device):
            raise UnsupportedModelError(f"{where}: an expert bias of shape {tuple(bias.shape)} "
                                        f"({bias.dtype}, {bias.device}); expected {shape} in the weights' "
                                        "dtype and device")
    fp8 = raw13.dtype == torch.float8_e4m3fn and w2.dtype == torch.float8_e4m3fn
    if fp8:
        try:
            fp8_scales_of(module, "gate_up_proj", "down_proj").check(raw13, w2)
        except (ValueError, TypeError) as exc:
            raise UnsupportedModelError(f"{where}: {exc}") from exc
    for pname, t in ((_gate_up_name(module), raw13), ("down_proj", w2)):
        if t.dtype not in _POOL_DTYPES and not fp8:
            raise UnsupportedModelError(
                f"{where}: {pname} has dtype {t.dtype} (quantised?); float32, float16 and bfloat16 are "
                "supported, and float8_e4m3fn with block scales (transformers' fine-grained FP8)"
            )
        if t.device.type == "meta":
            raise UnsupportedModelError(f"{where}: {pname} is on the meta device (offloaded?); load it first")
    if raw13.dtype != w2.dtype or raw13.device != w2.device:
        raise UnsupportedModelError(f"{where}: {_gate_up_name(module)} and down_proj differ in dtype or "
                                    "device")
    if ungated:
        return _ungated_activation_of(name, module)
    if overridden:
        return _gate_of(name, module, custom_gate, two_i)
    return _activation_of(name, module)


def _activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in beside its FP8 experts: its input embeddings' (else bfloat16)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    dtype = getattr(getattr(embeddings, "weight", None), "dtype", None)
    return dtype if dtype in _POOL_DTYPES else torch.bfloat16


# --------------------------------------------------------------------------------------------------
# The math, checked on random tokens
# --------------------------------------------------------------------------------------------------


def _verify_block(name: str, view: _RoutedBlockExperts, activation: str | GatedActivation,
                  x: torch.Tensor) -> None:
    """Refuses a routed block whose forward differs from its routing (``view.route``), the §1 experts and
    its output bias on ``x``."""
    w13, w2 = _expert_weights(view)
    where = f"MoE block {name!r} ({type(view.block).__name__})"
    try:
        with torch.no_grad():
            got = view.block(x[None])
            weights, ids = view.route(x)
            want = moe_lora_forward_torch(x, w13, w2, weights, ids, None, None, activation=activation)
            want = want + view.block.bias
    except Exception as exc:
        raise UnsupportedModelError(f"{where} could not be checked: its forward failed "
                                    f"({type(exc).__name__}: {exc})") from exc
    got = got[0] if isinstance(got, tuple) else got
    if not isinstance(got, torch.Tensor) or got.numel() != want.numel():
        raise UnsupportedModelError(f"{where} does not return the (1, M, H) hidden states")
    got, want = got.reshape(want.shape).float(), want.float()
    scale = float(want.abs().max()) + 1e-12
    err = float((got - want).abs().max())
    if err > (1e-4 if w13.dtype == torch.float32 else 3e-2) * scale:
        raise UnsupportedModelError(f"{where} does not compute its top-k softmax routing, "
                                    f"sum_k w_k * down(act(gate x) * up x) and its bias (max abs diff "
                                    f"{err:.3g} vs output scale {scale:.3g}); not supported")


def _verify_math(name: str, module: nn.Module, activation: str | GatedActivation) -> None:
    """Runs ``module`` and the §1 formula (no LoRA, rsf 1) on a few random tokens and refuses the module
    if they differ: its forward does something else (weights on the input, a scaling, ...)."""
    w13, w2 = _expert_weights(module)
    w13_bias, w2_bias = _expert_biases(module)
    e, h = w2.shape[0], w2.shape[1]
    routed = e + _identity_experts(module)  # identity experts' ids are routed too (LongCat-Flash)
    n, k = 8, min(2, routed)
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(n, h, generator=gen).to(device=w13.device, dtype=w13.dtype)
    ids = torch.rand(n, routed, generator=gen).topk(k, dim=1).indices.to(w13.device)
    weights = torch.rand(n, k, generator=gen).to(device=w13.device, dtype=w13.dtype)
    if isinstance(module, _RoutedBlockExperts):  # the whole block: its router, experts and output bias
        _verify_block(name, module, activation, x)
        return
    dense = _dense_form(module)
    if dense:  # every expert's stacked inputs; a token's rows of experts it is not routed to are zero
        x = x.repeat(e, 1) * (torch.rand(e * n, 1, generator=gen) < 0.5).to(device=x.device, dtype=x.dtype)
        weights, ids = _dense_routing(x, e)
    try:
        with torch.no_grad():
            got = module(x) if dense else module(x, ids, weights)

            def run(rows: torch.Tensor, w: torch.Tensor, pair_ids: torch.Tensor) -> torch.Tensor:
                return moe_lora_forward_torch(rows, w13, w2, w, pair_ids, None, None, activation=activation,
                                              w13_bias=w13_bias, w2_bias=w2_bias)

            norm = _post_expert_norm(module)
            want = run(x, weights, ids) if norm is None else _per_pair(run, x, ids, weights, norm)
            want = want + _identity_term(x, ids, weights, e)
    except Exception as exc:
        call = "forward(hidden_states)" if dense else "forward(hidden_states, top_k_index, top_k_weights)"
        raise UnsupportedModelError(
            f"experts module {name!r} ({type(module).__name__}) could not be checked: calling {call} failed "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        raise UnsupportedModelError(
            f"experts module {name!r} ({type(module).__name__}) does not return (M, H) from "
            "forward(hidden_states, top_k_index, top_k_weights)"
        )
    got, want = got.float(), want.float()
    scale = float(want.abs().max()) + 1e-12
    tol = 1e-4 if w13.dtype == torch.float32 else 3e-2
    err = float((got - want).abs().max())
    if err > tol * scale:
        raise UnsupportedModelError(
            f"experts module {name!r} ({type(module).__name__}) does not compute "
            f"sum_k w_k * down(act(gate x) * up x) (max abs diff {err:.3g} vs output scale {scale:.3g}); "
            "not supported"
        )
