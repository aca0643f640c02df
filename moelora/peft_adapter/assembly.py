"""The steps of :func:`moelora.peft_loader.read_peft_adapter` around its two file reads (the safetensors
header, then the tensor data): checking the arguments, the layers and experts, the shapes, ranks and
scalings (from the header alone), the tensor values, and turning the factors into per-layer
:class:`ReferenceLoRA` objects and an :class:`AdapterLoadReport`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moelora.adapter_weights import LoRAProjection, ReferenceLoRA
from moelora.peft_adapter.config import _is_int, _LoraSettings
from moelora.peft_adapter.formats import _PROJ_RANK, FORMAT_F1, ExpertParamLayout
from moelora.peft_adapter.fused import _f2_expert_modules, _F2Module, _resolve_f2
from moelora.peft_adapter.keys import _Classified, _Pair
from moelora.peft_adapter.messages import _fail
from moelora.peft_adapter.safetensors_file import _FileTensors, _TensorMeta
from moelora.peft_adapter.validation import (
    AdapterLoadReport,
    _batches,
    _check_finite,
    _check_positive_int,
    _compact,
    _live_experts_and_rank,
    _maybe_zero_components,
    _overflows,
    _value_bounds,
    arena_bytes_of,
)

# (layer, expert, proj), a, b (float32), scaling, module name, file key of this A, of this B, and whether a
# rank component may be exactly zero (:func:`_maybe_zero_components`)
_ModuleRow = tuple[tuple[int, int, str], torch.Tensor, torch.Tensor, float, str, str, str, bool]


# --------------------------------------------------------------------------------------------------
# Arguments, layers and experts
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ModelSizes:
    """The checked model sizes :func:`moelora.peft_loader._read` reads an adapter for."""

    num_experts: int
    hidden: int
    inter: int
    max_rank: int
    layer_ids: tuple[int, ...]
    # experts each fused parameter holds (LoRA rows of experts past num_experts are dropped)
    param_experts: dict[str, int]


def _check_read_args(
    num_experts: Any,
    hidden_size: Any,
    intermediate_size: Any,
    layer_ids: Any,
    max_rank: Any,
    dtype: Any,
    out_dtype: Any,
    layout: ExpertParamLayout,
) -> _ModelSizes:
    """The arguments of :func:`moelora.peft_loader.read_peft_adapter`, checked (ValueError for invalid
    ones: they are no adapter problems)."""
    n_exp = _check_positive_int("num_experts", num_experts)
    if layout.gate_up_experts is not None and (not _is_int(layout.gate_up_experts)
                                               or layout.gate_up_experts < n_exp):
        raise ValueError(f"layout.gate_up_experts must be an int >= num_experts={n_exp}, got "
                         f"{layout.gate_up_experts!r}")
    param_experts = {"gate_up_proj": layout.gate_up_experts or n_exp, "up_proj": n_exp, "down_proj": n_exp}
    hid = _check_positive_int("hidden_size", hidden_size)
    inter = _check_positive_int("intermediate_size", intermediate_size)
    max_r = _check_positive_int("max_rank", max_rank)
    for what, d in (("dtype", dtype), ("out_dtype", out_dtype)):
        if not isinstance(d, torch.dtype) or not d.is_floating_point:
            raise ValueError(f"{what} must be a floating-point torch.dtype, got {d!r}")
    if isinstance(layer_ids, (str, bytes)) or not isinstance(layer_ids, Iterable):
        raise ValueError(f"layer_ids must be a sequence of ints, got {layer_ids!r}")
    lids = tuple(layer_ids)
    if not lids or not all(_is_int(i) and i >= 0 for i in lids):
        raise ValueError(f"layer_ids must be non-empty non-negative ints, got {list(lids)!r}")
    return _ModelSizes(n_exp, hid, inter, max_r, lids, param_experts)


def _check_layers_and_experts(c: _Classified, sizes: _ModelSizes, w_file: Path) -> None:
    """Refuses expert LoRA weights of a layer that is no MoE layer of the model, or of an expert index
    past ``num_experts`` (naming the first offending key)."""
    valid_layers = set(sizes.layer_ids)
    n_exp = sizes.num_experts
    f1_fits = {lid for lid, _, _ in c.f1} <= valid_layers and max((e for _, e, _ in c.f1), default=-1) < n_exp
    for (lid, e, _), p in c.f1.items() if not f1_fits else ():  # to name the first offender
        if lid not in valid_layers:
            raise _fail(
                w_file,
                f"layer {lid} is not an MoE layer of this model (layer_ids {sorted(sizes.layer_ids)})",
                p.a,
            )
        if e >= n_exp:
            raise _fail(w_file, f"expert index {e} out of range: the model has num_experts={n_exp}", p.a)
    for (container, _), p in c.f2.items():
        lid = c.f2_layer[container]
        if lid not in valid_layers:
            raise _fail(
                w_file,
                f"layer {lid} is not an MoE layer of this model (layer_ids {sorted(sizes.layer_ids)})",
                p.a,
            )


# --------------------------------------------------------------------------------------------------
# Shapes, ranks and scalings, from the header alone
# --------------------------------------------------------------------------------------------------


@dataclass
class _ReadPlan:
    """What the safetensors header decides before any tensor data is read."""

    format: str
    ranks: dict[str, int]  # module name (F1) / parameter path (F2) -> rank
    scalings: dict[str, float]  # the same names -> scaling
    notes: list[str]
    # F1: (layer, proj) -> (its experts' lora_A keys, lora_B keys), read as a few strided batches
    f1_groups: dict[tuple[int, str], tuple[list[str], list[str]]]
    # F2: (container, depth) -> (param, swapped, r, s)
    f2_plan: dict[tuple[str, int], tuple[str, bool, int, float]]


def _plan_from_header(
    c: _Classified,
    metas: Mapping[str, _TensorMeta],
    settings: _LoraSettings,
    w_file: Path,
    sizes: _ModelSizes,
    layout: ExpertParamLayout,
) -> _ReadPlan:
    """Every expert module's shape checked against the model's sizes and the config's ranks, and its rank
    and scaling, from the header's shapes alone."""
    if c.f1:
        return _plan_f1(c, metas, settings, w_file, sizes)
    return _plan_f2(c, metas, settings, w_file, sizes, layout)


def _plan_f1(
    c: _Classified,
    metas: Mapping[str, _TensorMeta],
    settings: _LoraSettings,
    w_file: Path,
    sizes: _ModelSizes,
) -> _ReadPlan:
    """:func:`_plan_from_header` for per-expert (F1) modules."""
    hid, inter = sizes.hidden, sizes.inter
    ranks: dict[str, int] = {}
    scalings: dict[str, float] = {}
    dims = {"gate": (hid, inter), "up": (hid, inter), "down": (inter, hid)}  # (in, out)
    # Without rank/alpha patterns every module has the config's rank and alpha, so one expected
    # (A, B) shape per projection decides all the checks below; any other case goes module by module.
    expected = {proj: ((settings.r, n_in), (n_out, settings.r)) for proj, (n_in, n_out) in dims.items()}
    uniform = not settings.rank_pattern and not settings.alpha_pattern and all(
        (metas[p.a].shape, metas[p.b].shape) == expected[proj] for (_, _, proj), p in c.f1.items()
    )
    if uniform:
        f1_mods = [c.f1_module[slot] for slot in c.f1]
        ranks = dict.fromkeys(f1_mods, settings.r)
        scalings = dict.fromkeys(f1_mods, settings.scaling(settings.r, settings.alpha))
    for (lid, e, proj), p in c.f1.items() if not uniform else ():
        assert p.a is not None and p.b is not None
        mod = c.f1_module[(lid, e, proj)]
        a_shape, b_shape = metas[p.a].shape, metas[p.b].shape
        _check_f1_sizes(w_file, p, proj, a_shape, b_shape, dims[proj])
        alpha = _f1_module_alpha(w_file, p, a_shape, b_shape, settings, mod)
        r = a_shape[0]
        ranks[mod], scalings[mod] = r, settings.scaling(r, alpha)
    f1_groups: dict[tuple[int, str], tuple[list[str], list[str]]] = {}
    for (lid, _, proj), p in c.f1.items():
        assert p.a is not None and p.b is not None
        group = f1_groups.get((lid, proj))
        if group is None:
            group = f1_groups[(lid, proj)] = ([], [])
        group[0].append(p.a)
        group[1].append(p.b)
    return _ReadPlan(FORMAT_F1, ranks, scalings, [], f1_groups, {})


_F1_DIM_NAMES = {"gate": ("H", "I"), "up": ("H", "I"), "down": ("I", "H")}  # (in, out)


def _check_f1_sizes(
    w_file: Path, p: _Pair, proj: str, a_shape: Sequence[int], b_shape: Sequence[int], in_out: tuple[int, int]
) -> None:
    """Refuses a per-expert module whose A columns or B rows are not the model's (in, out) features."""
    in_f, out_f = in_out
    in_n, out_n = _F1_DIM_NAMES[proj]
    if a_shape[1] != in_f:
        raise _fail(
            w_file,
            f"lora_A of {proj} has shape {a_shape}, expected (r, {in_n}={in_f}): "
            "hidden/intermediate size mismatch with the model",
            p.a,
        )
    if b_shape[0] != out_f:
        raise _fail(
            w_file,
            f"lora_B of {proj} has shape {b_shape}, expected ({out_n}={out_f}, r): "
            "hidden/intermediate size mismatch with the model",
            p.b,
        )


def _f1_module_alpha(w_file: Path, p: _Pair, a_shape: Sequence[int], b_shape: Sequence[int],
                     settings: _LoraSettings, mod: str) -> float:
    """A per-expert module's alpha, after checking that its A and B agree on the rank and that the config
    (``r`` / ``rank_pattern``) gives the module that rank."""
    r = a_shape[0]
    if b_shape[1] != r:
        raise _fail(
            w_file,
            f"rank mismatch: lora_A {a_shape} has rank {r} but lora_B {b_shape} has rank {b_shape[1]}",
            p.b,
        )
    cfg_r, alpha = settings.rank_alpha(mod)
    if r != cfg_r:
        raise _fail(
            w_file,
            f"rank {r} in the file but the config gives module {mod!r} rank {cfg_r} (r / rank_pattern)",
            p.a,
        )
    return alpha


def _plan_f2(
    c: _Classified,
    metas: Mapping[str, _TensorMeta],
    settings: _LoraSettings,
    w_file: Path,
    sizes: _ModelSizes,
    layout: ExpertParamLayout,
) -> _ReadPlan:
    """:func:`_plan_from_header` for fused-parameter (F2) wrappers: the parameter and orientation of each
    (:func:`_resolve_f2`), and its rank (lora_A rows / experts) checked against the config's."""
    notes: list[str] = []
    ranks: dict[str, int] = {}
    scalings: dict[str, float] = {}
    f2_plan: dict[tuple[str, int], tuple[str, bool, int, float]] = {}
    param_experts = sizes.param_experts
    fmt, f2_params = _resolve_f2(c.f2, c.f2_layer, metas, settings, w_file, param_experts, sizes.hidden,
                                 sizes.inter, notes, layout)
    for (container, depth), (param, swapped) in f2_params.items():
        p = c.f2[(container, depth)]
        assert p.a is not None and p.b is not None
        rows = metas[p.a].shape[0]
        r = rows // param_experts[param]
        pname = f"{container}.{param}"
        cfg_r, alpha = settings.rank_alpha(pname)
        if r != cfg_r:
            raise _fail(
                w_file,
                f"lora_A has {rows} rows = num_experts ({param_experts[param]}) x rank {r}, but the "
                f"config gives {pname!r} rank {cfg_r} (r / rank_pattern): rank or num_experts mismatch "
                "with the model",
                p.a,
            )
        s = settings.scaling(r, alpha)
        ranks[pname], scalings[pname] = r, s
        f2_plan[(container, depth)] = (param, swapped, r, s)
    return _ReadPlan(fmt, ranks, scalings, notes, {}, f2_plan)


# --------------------------------------------------------------------------------------------------
# Tensor data: values, per-module factors, layers
# --------------------------------------------------------------------------------------------------


def _check_tensor_values(
    w_file: Path, data: _FileTensors, factor_keys: Sequence[str], dtype: torch.dtype
) -> dict[str, bool]:
    """Refuses a factor holding NaN or Inf; returns, per file tensor, whether it may overflow ``dtype``
    (its modules are cast to find out exactly; a module is a part of its file tensor, so no other module
    can)."""
    bounds = _value_bounds(data.regions, data.tensors)  # one reduction per region
    value_ranges = list(set(bounds.values()))  # a few: most tensors share their region's
    if not all(math.isfinite(lo) and math.isfinite(hi) for lo, hi in value_ranges):
        for k in factor_keys:
            _check_finite(w_file, k, bounds.get(k))
    overflows = dict(
        zip(value_ranges, _overflows([max(-lo, hi) for lo, hi in value_ranges], dtype), strict=True)
    )
    if any(overflows.values()):
        return {k: overflows[value_range] for k, value_range in bounds.items()}
    return dict.fromkeys(bounds, False)


def _module_rows(
    c: _Classified, plan: _ReadPlan, data: _FileTensors, sizes: _ModelSizes, layout: ExpertParamLayout
) -> Iterable[_ModuleRow]:
    """Per module ``(a, b, scaling, ...)`` in float32, in (layer, expert, projection) order."""
    if c.f1:
        return _f1_module_rows(c, data, plan.scalings)
    modules = _f2_expert_modules(c.f2, c.f2_layer, plan.f2_plan, data.tensors, sizes.param_experts,
                                 sizes.num_experts, sizes.inter, layout)
    return _f2_module_rows(modules)


def _f1_module_rows(
    c: _Classified, data: _FileTensors, scalings: Mapping[str, float]
) -> Iterable[_ModuleRow]:
    """:func:`_module_rows` of per-expert (F1) modules: whole file tensors."""
    # to float32 (``.float()``), whole batches of file tensors at a time: one layer's experts' lora_A
    # (lora_B) of one projection lie at a constant stride in the file
    tensors = data.tensors
    f32, f32_batches = tensors, data.batches
    if any(view.dtype != torch.float32 for _, view in data.batches):
        f32, f32_batches = dict(tensors), []
        for keys, view in data.batches:
            if view.dtype != torch.float32:
                view = view.float()
                f32.update(zip(keys, view.unbind(0), strict=True))
            f32_batches.append((keys, view))
    a_keys = {p.a for p in c.f1.values()}
    maybe = _maybe_zero_components(
        [batch for batch in f32_batches if batch[0][0] in a_keys],
        [batch for batch in f32_batches if batch[0][0] not in a_keys],
    )
    # generated as consumed: no per-module objects beyond the result's
    return (
        (slot, f32[p.a], f32[p.b], scalings[mod], mod, p.a, p.b, p.a in maybe or p.b in maybe)
        for slot, p in c.f1.items()
        for mod in (c.f1_module[slot],)
    )


def _f2_module_rows(modules: Mapping[tuple[int, int, str], _F2Module]) -> Iterable[_ModuleRow]:
    """:func:`_module_rows` of the experts cut out of fused-parameter (F2) factors."""
    ordered = sorted(modules.items(), key=lambda kv: (kv[0][0], kv[0][1], _PROJ_RANK[kv[0][2]]))
    kinds = [(slot[0], slot[2]) for slot, _ in ordered]
    maybe = _maybe_zero_components(
        _batches([m[0] for _, m in ordered], kinds), _batches([m[1] for _, m in ordered], kinds)
    )
    return ((slot, *m, i in maybe) for i, (slot, m) in enumerate(ordered))


@dataclass
class _Layers:
    """The adapter's per-layer LoRAs and what building them found."""

    layers: dict[int, ReferenceLoRA]
    experts_per_layer: dict[int, set[int]]
    max_rank: int  # largest effective rank
    dropped_components: int  # exactly-zero rank components dropped
    zero_modules: int  # modules all zero (left out)


def _build_layers(
    module_rows: Iterable[_ModuleRow],
    over_keys: Mapping[str, bool],
    w_file: Path,
    max_r: int,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    factors_own_memory: bool,
) -> _Layers:
    """Per-layer :class:`ReferenceLoRA` of ``out_dtype`` factors: exactly-zero rank components dropped,
    the effective rank checked against ``max_r`` and, where ``over_keys`` says a file tensor may, the
    cast to ``dtype`` checked for overflow. ``factors_own_memory``: the factors are whole file tensors
    (F1) in memory of their own, kept without a copy; otherwise they are cloned out of fused tensors."""
    built = _Layers({}, {}, 0, 0, 0)
    for (lid, e, proj), a, b, s, mod, key_a, key_b, may_drop in module_rows:
        layer = built.layers.get(lid)
        if layer is None:
            layer = built.layers[lid] = ReferenceLoRA()
            built.experts_per_layer[lid] = set()
        built.experts_per_layer[lid].add(e)
        if may_drop:
            ac, bc = _compact(a, b)
            built.dropped_components += a.shape[0] - ac.shape[0]
        else:
            ac, bc = a, b
        r_eff = int(ac.shape[0])
        if r_eff > max_r:
            extra = f" (rank {a.shape[0]} in the file)" if r_eff != a.shape[0] else ""
            raise _fail(w_file, f"module {mod}: rank {r_eff}{extra} exceeds max_rank {max_r}", key_a)
        if r_eff == 0:
            built.zero_modules += 1
            continue
        built.max_rank = max(built.max_rank, r_eff)
        if over_keys.get(key_a, True) or over_keys.get(key_b, True):
            _check_cast(w_file, mod, ac, bc, key_a, key_b, dtype)
        # F1 factors are whole file tensors, in memory of their own (``_read_safetensors``): no copy
        # unless the dtype changes. F2 factors are slices of fused tensors (gate and up share one A).
        # (a tensor already in out_dtype skips ``to``, which would return it, at a cost per call)
        a_out = (ac if ac.dtype == out_dtype else ac.to(out_dtype)).contiguous()
        b_out = (bc if bc.dtype == out_dtype else bc.to(out_dtype)).contiguous()
        if not factors_own_memory:
            a_out, b_out = a_out.clone(), b_out.clone()
        getattr(layer, proj)[e] = LoRAProjection(a_out, b_out, float(s))
    return built


def _check_cast(
    w_file: Path, mod: str, a: torch.Tensor, b: torch.Tensor, key_a: str, key_b: str, dtype: torch.dtype
) -> None:
    """Refuses a module whose A or B is no longer finite cast to ``dtype``."""
    for what, t, key in (("A", a.to(dtype), key_a), ("B", b.to(dtype), key_b)):
        if not bool(torch.isfinite(t).all()):
            dname = str(dtype).removeprefix("torch.")
            raise _fail(w_file, f"module {mod}: LoRA {what} overflows {dname}", key)


def _load_report(
    adir: Path,
    plan: _ReadPlan,
    built: _Layers,
    ignored: dict[str, str],
    settings: _LoraSettings,
    sizes: _ModelSizes,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> AdapterLoadReport:
    """The :class:`AdapterLoadReport` of a read adapter (``pool_bytes`` in the pool's ``dtype``)."""
    notes = plan.notes
    if built.dropped_components:
        notes.append(
            f"{built.dropped_components} exactly-zero rank components dropped ({built.zero_modules} modules "
            f"all zero); largest effective rank {built.max_rank}"
        )
    return AdapterLoadReport(
        path=str(adir),
        format=plan.format,
        ranks=plan.ranks,
        scalings=plan.scalings,
        layers=sorted(built.layers),
        experts_per_layer={lid: sorted(es) for lid, es in sorted(built.experts_per_layer.items())},
        ignored_keys=ignored,
        pool_bytes=sum(arena_bytes_of(len(experts), rank, sizes.hidden, sizes.inter, dtype)
                       for experts, rank in map(_live_experts_and_rank, built.layers.values())),
        max_rank=built.max_rank,
        pool_max_rank=sizes.max_rank,
        dtype=str(out_dtype).removeprefix("torch."),
        peft_version=settings.peft_version,
        notes=notes,
    )
