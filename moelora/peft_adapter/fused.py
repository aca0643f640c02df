"""The fused-parameter (F2) layout: which fused expert parameter each PEFT wrapper adapts, in which
orientation the file stores it, and the per-expert modules cut out of the fused factors.

Per parameter ``(E, out, in)``::

    A (E*r, in)    expert-major:  A_e = A[e*r:(e+1)*r]
    B (out, E*r)   rank-major:    B_e = B[:, e::E]          delta_e = scaling * B_e @ A_e

PEFT 0.17.0 to 0.19.0 wrote ``A (E*r, out)``, ``B (in, E*r)`` (the same delta, transposed): then
``A_e = B[:, e::E].T`` and ``B_e = A[e*r:(e+1)*r].T``. The shapes decide the orientation; where they
cannot (``in == out``), the model's storage (:attr:`ExpertParamLayout.unflagged_transposed`) or the
config's ``peft_version`` does, and with neither the adapter is refused rather than guessed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from moelora.peft_adapter.config import _LoraSettings, _version_tuple
from moelora.peft_adapter.formats import _JETMOE_PARAMS, FORMAT_F2, FORMAT_F2_SWAPPED, ExpertParamLayout
from moelora.peft_adapter.keys import _first_key, _Pair
from moelora.peft_adapter.messages import _fail
from moelora.peft_adapter.paths import CONFIG_NAME
from moelora.peft_adapter.safetensors_file import _TensorMeta

# the sizes of each fused parameter (E, out, in) as named in messages: (in, out)
_F2_IO_NAMES = {"gate_up_proj": ("H", "2I"), "up_proj": ("H", "I"), "down_proj": ("I", "H")}


@dataclass(frozen=True)
class _F2Shapes:
    """What the shape checks of each F2 wrapper work with (:func:`_resolve_f2`'s arguments)."""

    w_file: Path
    f2: Mapping[tuple[str, int], _Pair]
    metas: Mapping[str, _TensorMeta]
    settings: _LoraSettings
    param_experts: Mapping[str, int]  # experts each fused parameter holds
    io: Mapping[str, tuple[int, int]]  # (in, out) features of each fused parameter, :func:`_f2_io`
    model_params: tuple[str, ...]  # the fused parameters the model's experts hold


def _f2_io(hid: int, inter: int) -> dict[str, tuple[int, int]]:
    """in/out features of each fused parameter (E, out, in)."""
    return {"gate_up_proj": (hid, 2 * inter), "up_proj": (hid, inter), "down_proj": (inter, hid)}


def _orientations(
    io: Mapping[str, tuple[int, int]], param: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...]
) -> set[bool]:
    """The layouts (swapped or not) in which lora_A / lora_B of these shapes adapt ``param``."""
    in_f, out_f = io[param]
    cand = set()
    if a_shape[1] == in_f and b_shape[0] == out_f:
        cand.add(False)
    if a_shape[1] == out_f and b_shape[0] == in_f:
        cand.add(True)
    return cand


def _resolve_f2(
    f2: dict[tuple[str, int], _Pair],
    f2_layer: dict[str, int],
    metas: Mapping[str, _TensorMeta],
    settings: _LoraSettings,
    w_file: Path,
    param_experts: Mapping[str, int],
    hid: int,
    inter: int,
    notes: list[str],
    layout: ExpertParamLayout,
) -> tuple[str, dict[tuple[str, int], tuple[str, bool]]]:
    """Which fused parameter each F2 wrapper adapts, and whether the file uses the old swapped layout.

    Works on the header's shapes alone (no tensor data). Returns the format string and
    ``(container, depth) -> (parameter name, swapped)``.
    """
    if not settings.target_parameters:
        first = _first_key(f2)
        raise _fail(
            w_file,
            "fused-parameter (F2) expert LoRA weights, but the config has no target_parameters "
            "to say which parameters they adapt: unknown expert layout",
            first,
        )
    # the parameters this model's experts hold: up_proj instead of gate_up_proj when ungated
    model_params = ("up_proj", "down_proj") if layout.up_only else ("gate_up_proj", "down_proj")
    ctx = _F2Shapes(w_file, f2, metas, settings, param_experts, _f2_io(hid, inter), model_params)
    assignment: dict[tuple[str, int], str] = {}
    candidates: dict[tuple[str, int], set[bool]] = {}
    for (container, depth), p in sorted(f2.items()):
        assert p.a is not None and p.b is not None
        targeted = _targeted_params(container, settings, model_params)
        param = _wrapper_param(ctx, container, depth, p, targeted)
        assignment[(container, depth)] = param
        candidates[(container, depth)] = _wrapper_orientations(ctx, container, depth, p, param, targeted)
    swapped = _decide_orientation(candidates, settings, w_file, notes, layout)
    fmt = FORMAT_F2_SWAPPED if swapped else FORMAT_F2
    return fmt, {k: (prm, swapped) for k, prm in assignment.items()}


def _targeted_params(container: str, settings: _LoraSettings, model_params: tuple[str, ...]) -> list[str]:
    """The fused parameters of ``container`` that ``target_parameters`` names, in registration order."""
    leaf = container.rpartition(".")[2]
    if leaf in _JETMOE_PARAMS:  # one parameter, ``weight``, per container
        return [_JETMOE_PARAMS[leaf]] if any(
            f"{container}.weight" == t or f"{container}.weight".endswith("." + t)
            for t in settings.target_parameters) else []
    return [
        prm
        for prm in model_params
        if any(
            f"{container}.{prm}" == t or f"{container}.{prm}".endswith("." + t)
            for t in settings.target_parameters
        )
    ]


def _wrapper_param(ctx: _F2Shapes, container: str, depth: int, p: _Pair, targeted: list[str]) -> str:
    """The parameter the wrapper ``depth`` levels down on ``container`` adapts: PEFT nests in registration
    order, the first registered (gate_up_proj) innermost, i.e. deepest."""
    w_file, settings, model_params = ctx.w_file, ctx.settings, ctx.model_params
    if not targeted:
        raise _fail(
            w_file,
            f"fused-parameter LoRA weights on {container!r}, but target_parameters "
            f"{settings.target_parameters} names none of its parameters {list(model_params)}",
            p.a,
        )
    if depth >= len(targeted):
        raise _fail(
            w_file,
            f"unknown expert layout: {depth} nested base_layer wrappers on {container!r} (a LoRA for "
            f"{depth + 1} fused parameters) but target_parameters {settings.target_parameters} in "
            f"{CONFIG_NAME} adapts only {targeted} there",
            p.a,
        )
    return targeted[len(targeted) - 1 - depth]


def _wrapper_orientations(
    ctx: _F2Shapes, container: str, depth: int, p: _Pair, param: str, targeted: list[str]
) -> set[bool]:
    """The orientations (swapped or not) the shapes of one wrapper's lora_A / lora_B allow for ``param``;
    refuses factors that disagree on the rank axis, an expert count that does not divide it, and shapes
    that fit ``param`` in neither orientation (naming the config as wrong where they fit the other
    parameter)."""
    w_file, settings, io = ctx.w_file, ctx.settings, ctx.io
    assert p.a is not None and p.b is not None
    a_shape, b_shape = ctx.metas[p.a].shape, ctx.metas[p.b].shape
    in_f, out_f = io[param]
    in_n, out_n = _F2_IO_NAMES[param]
    if a_shape[0] != b_shape[1]:
        raise _fail(
            w_file,
            f"rank mismatch: lora_A {a_shape} and lora_B {b_shape} of {param} "
            "must share the num_experts x rank axis",
            p.b,
        )
    n_exp = ctx.param_experts[param]
    if a_shape[0] % n_exp:
        raise _fail(
            w_file,
            f"lora_A of {param} has {a_shape[0]} rows, not a multiple of num_experts={n_exp}: "
            "the adapter was made for a model with another number of experts",
            p.a,
        )
    cand = _orientations(io, param, a_shape, b_shape)
    other = next(prm for prm in ctx.model_params if prm != param)
    if not cand and _orientations(io, other, a_shape, b_shape):
        # The shapes of gate_up_proj ({H, 2I}) and down_proj ({I, H}) never coincide, so tensors that
        # fit the other parameter mean the config's target_parameters, not the model sizes, is wrong.
        o_in, o_out = io[other]
        o_in_n, o_out_n = _F2_IO_NAMES[other]
        if len(targeted) == 1:
            why = f"it targets only {param} on this experts module"
        else:
            place = "outer" if depth == 0 else "inner"
            why = (
                f"it targets {targeted} here, and PEFT nests the {param} LoRA as the {place} wrapper "
                f"(...experts{'.base_layer' * depth}.lora_A/B)"
            )
        present = sum(1 for c, _ in ctx.f2 if c == container)
        absent = (
            f"; the file holds a LoRA for {other} only on {container!r}, none for {param}"
            if present < len(targeted)
            else ""
        )
        raise _fail(
            w_file,
            f"target_parameters in {CONFIG_NAME} ({settings.target_parameters}) disagrees with the "
            f"tensors: {why}, so these should be the {param} LoRA (E, {out_n}={out_f}, {in_n}={in_f}), "
            f"but lora_A {a_shape} and lora_B {b_shape} are shaped for {other} "
            f"(E, {o_out_n}={o_out}, {o_in_n}={o_in}){absent}",
            p.a,
        )
    if not cand:
        raise _fail(
            w_file,
            f"wrong shapes for {param} (E, {out_n}={out_f}, {in_n}={in_f}): lora_A {a_shape}, "
            "lora_B "
            f"{b_shape}; expected lora_A (E*r, {in_n}={in_f}) and lora_B ({out_n}={out_f}, E*r) "
            "(hidden/intermediate size mismatch with the model?)",
            p.a,
        )
    return cand


def _decide_orientation(
    candidates: Mapping[tuple[str, int], set[bool]],
    settings: _LoraSettings,
    w_file: Path,
    notes: list[str],
    layout: ExpertParamLayout,
) -> bool:
    """Whether the file holds the swapped (PEFT 0.17-0.19.0) layout: decided by the wrappers whose shapes
    allow one orientation only, else by the model's storage, else by ``peft_version``; the way it was
    decided is added to ``notes``."""
    decided = [c for c in candidates.values() if len(c) == 1]
    swapped_set = {next(iter(c)) for c in decided}
    if len(swapped_set) > 1:
        raise _fail(
            w_file,
            "inconsistent fused-parameter layouts: some tensors are in PEFT >= 0.19.1 orientation "
            "(A (E*r, in)), others in the PEFT 0.17-0.19.0 one (A (E*r, out))",
        )
    if swapped_set:
        swapped = swapped_set.pop()
        notes.append("F2 orientation decided by the tensor shapes")
    elif layout.unflagged_transposed:
        swapped = True
        notes.append("F2 orientation decided by the model's storage ((E, in, out) without is_transposed)")
    else:
        ver = _version_tuple(settings.peft_version)
        if ver is None:
            raise _fail(
                settings.file,
                "cannot tell the fused-parameter LoRA orientation: the shapes fit both the PEFT >= 0.19.1 "
                "layout and the swapped PEFT 0.17-0.19.0 one (in_features == out_features) and the config "
                "has no readable "
                'peft_version; add "peft_version" (the PEFT version that saved the adapter) to the config',
                "peft_version",
            )
        swapped = (0, 17) <= ver[:2] and ver < (0, 19, 1)
        notes.append(
            f"F2 orientation decided by peft_version {settings.peft_version!r} (shapes are ambiguous)"
        )
    return swapped


# one expert's projection cut out of the fused factors: a (r, in), b (out, r) (float32 views), scaling,
# module name, file key of this A, file key of this B
_F2Module = tuple[torch.Tensor, torch.Tensor, float, str, str, str]


def _f2_expert_modules(
    f2: Mapping[tuple[str, int], _Pair],
    f2_layer: Mapping[str, int],
    f2_plan: Mapping[tuple[str, int], tuple[str, bool, int, float]],
    tensors: Mapping[str, torch.Tensor],
    param_experts: Mapping[str, int],
    n_exp: int,
    inter: int,
    layout: ExpertParamLayout,
) -> dict[tuple[int, int, str], _F2Module]:
    """``(layer, expert, proj) -> module`` for the first ``n_exp`` experts of every planned wrapper
    (``f2_plan``: ``(container, depth) -> (param, swapped, r, scaling)``), cut out of the file's fused
    factors in float32. gate_up_proj gives gate and up (its B rows split as ``[gate; up]``, or alternating
    with ``layout.gate_up_interleaved``) sharing one A; an ungated up_proj gives the same LoRA as gate and
    up (``relu(u) * u``)."""
    modules: dict[tuple[int, int, str], _F2Module] = {}
    for (container, depth), (param, swapped, r, s) in f2_plan.items():
        p = f2[(container, depth)]
        assert p.a is not None and p.b is not None
        lid = f2_layer[container]
        pname = f"{container}.{param}"
        a, b = tensors[p.a].float(), tensors[p.b].float()
        # expert-major A: (E, r, A cols); rank-major B: (B rows, r, E). Current PEFT: A cols = in,
        # B rows = out. PEFT 0.17-0.19.0 (swapped): A cols = out, B rows = in, delta transposed.
        a3 = a.reshape(param_experts[param], r, a.shape[1])
        b3 = b.reshape(b.shape[0], r, param_experts[param])
        keys = (p.b, p.a) if swapped else (p.a, p.b)  # file keys of our (A, B)
        for e in range(n_exp):  # an identity expert's rows (past n_exp) are never read: dropped
            if swapped:
                a_e, b_e = b3[:, :, e].T, a3[e].T  # (r, in), (out, r)
            else:
                a_e, b_e = a3[e], b3[:, :, e]
            if param == "gate_up_proj":
                gate_b, up_b = ((b_e[0::2], b_e[1::2]) if layout.gate_up_interleaved
                                else (b_e[:inter], b_e[inter:]))
                modules[(lid, e, "gate")] = (a_e, gate_b, s, f"{pname}[expert {e} gate]", *keys)
                modules[(lid, e, "up")] = (a_e, up_b, s, f"{pname}[expert {e} up]", *keys)
            elif param == "up_proj":  # ungated: relu(u) * u, u read as both gate and up
                modules[(lid, e, "gate")] = (a_e, b_e, s, f"{pname}[expert {e}]", *keys)
                modules[(lid, e, "up")] = (a_e, b_e, s, f"{pname}[expert {e}]", *keys)
            else:
                modules[(lid, e, "down")] = (a_e, b_e, s, f"{pname}[expert {e}]", *keys)
    return modules
