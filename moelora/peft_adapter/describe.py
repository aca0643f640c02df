"""What a PEFT adapter holds, read from its config and safetensors header alone (no model sizes, no
tensor data): :func:`describe_peft_adapter` and its :class:`AdapterSummary`."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moelora.adapter_weights import AdapterLoadError
from moelora.peft_adapter.assembly import _f1_module_alpha
from moelora.peft_adapter.config import (
    _MAX_CONFIG_DEPTH,
    _load_json,
    _LoraSettings,
    _nesting_depth,
    _parse_config,
    _version_tuple,
)
from moelora.peft_adapter.formats import (
    _F1_MODULE,
    _F2_MODULE,
    _F2_PARAMS,
    _PROJ_ORDER,
    FORMAT_F1,
    FORMAT_F2,
    FORMAT_F2_SWAPPED,
    ExpertParamLayout,
)
from moelora.peft_adapter.fused import _resolve_f2
from moelora.peft_adapter.keys import _Classified, _classify_keys
from moelora.peft_adapter.messages import _brief, _fail
from moelora.peft_adapter.paths import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    _check_files,
    _nested_adapter_hint,
    check_adapter_path,
)
from moelora.peft_adapter.safetensors_file import _read_safetensors_header, _TensorMeta


class AdapterInputError(AdapterLoadError):
    """The path names no readable PEFT adapter: no such directory, no ``adapter_config.json`` /
    ``adapter_model.safetensors`` in it, or a config that is not a JSON object. There is nothing to
    describe (``moelora inspect`` reports it as a usage error, exit code 2)."""


@dataclass
class AdapterSummary:
    """What :func:`describe_peft_adapter` reads from an adapter directory alone, sizes inferred.

    Attributes:
        path: the adapter directory.
        format: :data:`FORMAT_F1`, :data:`FORMAT_F2` or :data:`FORMAT_F2_SWAPPED`; ``"<F2> or <F2 swapped>"``
            when only the model could tell (see ``size_candidates``).
        layout: in words, e.g. ``per-expert modules (target_modules), Mixtral naming: w1 = gate, ...``.
        module_names: the expert LoRA modules with layer / expert ids folded, e.g.
            ``model.layers.{L}.mlp.experts.{e}.{down_proj,gate_proj,up_proj}``.
        layers: layer ids holding expert LoRA weights (the MoE layers the adapter touches).
        experts_per_layer: layer id -> expert ids with LoRA weights (F2: all ``num_experts``).
        projections: layer id -> the projections (``gate``, ``up``, ``down``) adapted there.
        num_experts: the expert count the tensors imply (F2: lora_A rows / r); ``None`` for per-expert
            (F1) adapters, whose files cannot say how many experts the model has.
        min_experts: the model has at least this many experts (F1: largest expert id + 1).
        hidden_size: ``H`` as the tensor shapes imply it; ``None`` when ambiguous (``size_candidates``).
        intermediate_size: ``I`` (the per-expert FFN width), likewise.
        size_candidates: ``(H, I, format)`` each consistent with the file when the shapes and
            ``peft_version`` cannot decide between the current and the PEFT 0.17-0.19.0 F2 layout.
        ranks: module name (F1) / parameter path (F2), named as in :class:`AdapterLoadReport` -> rank in the
            file (equal to the config's, ``rank_pattern`` applied).
        alphas: the same names -> alpha (``alpha_pattern`` applied).
        scalings: the same names -> ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA).
        pattern_modules: the names whose rank or alpha comes from ``rank_pattern`` / ``alpha_pattern``.
        max_rank: the largest rank in the file (exactly-zero components are only found when the data is
            read: :func:`read_peft_adapter` reports the effective rank).
        r, lora_alpha, use_rslora, rank_pattern, alpha_pattern, peft_version: from the config.
        base_model: ``base_model_name_or_path`` (``None`` when absent or empty).
        base_model_class: ``auto_mapping.base_model_class`` (``None`` when absent).
        ignored_keys: safetensors key -> why it is not served (attention, shared experts, dense MLPs, ...).
        file_bytes: size of ``adapter_model.safetensors``.
        lora_bytes: bytes of the expert LoRA factors in it.
        ignored_bytes: bytes of the ignored tensors.
        dtypes: safetensors dtypes of the expert LoRA factors.
        notes: how a size or the layout was decided, and what the adapter alone cannot tell.
    """

    path: str
    format: str
    layout: str
    module_names: list[str]
    layers: list[int]
    experts_per_layer: dict[int, list[int]]
    projections: dict[int, list[str]]
    num_experts: int | None
    min_experts: int
    hidden_size: int | None
    intermediate_size: int | None
    size_candidates: list[tuple[int, int, str]]
    ranks: dict[str, int]
    alphas: dict[str, float]
    scalings: dict[str, float]
    pattern_modules: list[str]
    max_rank: int
    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    peft_version: str | None
    base_model: str | None
    base_model_class: str | None
    ignored_keys: dict[str, str]
    file_bytes: int
    lora_bytes: int
    ignored_bytes: int
    dtypes: list[str]
    notes: list[str] = field(default_factory=list)


def _fold_ids(name: str, match: re.Match, groups: Sequence[str], folded: Sequence[str]) -> str:
    """``name`` with the spans of the regex ``groups`` replaced by ``folded`` (e.g. a layer id by ``{L}``)."""
    out, pos = [], 0
    for g, text in sorted(zip(groups, folded, strict=True), key=lambda gt: match.start(gt[0])):
        out += [name[pos : match.start(g)], text]
        pos = match.end(g)
    return "".join([*out, name[pos:]])


def _join_templates(templates: Mapping[str, set[str]]) -> list[str]:
    """``{"a.{e}": {"w1", "w2"}}`` -> ``["a.{e}.{w1,w2}"]``."""
    return [
        f"{t}.{next(iter(leaves))}" if len(leaves) == 1 else f"{t}.{{{','.join(sorted(leaves))}}}"
        for t, leaves in sorted(templates.items())
    ]


def _describe_f1(c: _Classified, metas: Mapping[str, _TensorMeta], settings: _LoraSettings, w_file: Path):
    """Ranks, alphas, (H, I) and the naming of a per-expert adapter; refuses what no model could load."""
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    # size name -> {value: first key giving it}; gate/up: A (r, H), B (I, r); down: A (r, I), B (H, r)
    seen: dict[str, dict[int, str]] = {"H": {}, "I": {}}
    dim_names = {"gate": ("H", "I"), "up": ("H", "I"), "down": ("I", "H")}
    templates: dict[str, set[str]] = {}
    for slot, p in c.f1.items():
        assert p.a is not None and p.b is not None
        mod = c.f1_module[slot]
        a_shape, b_shape = metas[p.a].shape, metas[p.b].shape
        r = a_shape[0]
        ranks[mod], alphas[mod] = r, _f1_module_alpha(w_file, p, a_shape, b_shape, settings, mod)
        in_n, out_n = dim_names[slot[2]]
        seen[in_n].setdefault(a_shape[1], p.a)
        seen[out_n].setdefault(b_shape[0], p.b)
        m = _F1_MODULE.match(mod)
        assert m is not None
        head = _fold_ids(mod, m, ("layer", "expert", "proj"), ("{L}", "{e}", "")).removesuffix(".")
        templates.setdefault(head, set()).add(m.group("proj"))
    for size, values in seen.items():
        if len(values) > 1:
            found = ", ".join(f"{v} (from {k!r})" for v, k in list(values.items())[:3])
            raise _fail(
                w_file,
                f"the per-expert LoRA tensors disagree on {size}: {found}; no model fits them all",
                next(iter(values.values())),
            )
    leaves = {leaf for ls in templates.values() for leaf in ls}
    if leaves & {"w1", "w2", "w3"}:
        layout = "per-expert modules (target_modules), Mixtral naming: w1 = gate, w3 = up, w2 = down"
    else:
        layout = "per-expert modules (target_modules): " + ", ".join(sorted(leaves))
    hid = next(iter(seen["H"]))
    inter = next(iter(seen["I"]))
    return ranks, alphas, hid, inter, layout, _join_templates(templates)


# one (H, I) the F2 tensors fit: H, I, format, (container, depth) -> (param, swapped), notes of the fit
_F2Fit = tuple[int, int, str, dict[tuple[str, int], tuple[str, bool]], list[str]]


def _describe_f2(
    c: _Classified, metas: Mapping[str, _TensorMeta], settings: _LoraSettings, w_file: Path, notes: list[str]
):
    """Format, (H, I) candidates, E, ranks and alphas of a fused-parameter adapter.

    Each (H, I) the first wrapper's shapes allow (it adapts gate_up_proj or down_proj, in the current or
    the PEFT 0.17-0.19.0 orientation) is put to the loader's own :func:`_resolve_f2`; those it accepts
    for every wrapper remain. The model's true sizes are always among them, so this refuses only what no
    model could load.
    """
    # ungated experts (up_proj, no gate_up_proj) are told by the config's targets
    param_layout = ExpertParamLayout(up_only=any(t.rpartition(".")[2] == "up_proj"
                                                 for t in settings.target_parameters))
    fits = _f2_size_fits(c, metas, settings, w_file, param_layout)
    h, i, fmt, assignment, candidates = _choose_f2_fit(fits, settings, notes)
    ranks, alphas, num_experts, templates, projections = _describe_f2_params(
        c, metas, settings, w_file, assignment
    )
    params = sorted({prm for prm, _ in assignment.values()}, key=_F2_PARAMS.index)
    layout = f"fused expert parameters (target_parameters): {', '.join(params)}"
    if len(params) == 2:
        layout += " (gate_up_proj LoRA in the inner ...experts.base_layer wrapper)"
    return fmt, layout, templates, num_experts, h, i, candidates, ranks, alphas, projections


def _f2_size_fits(
    c: _Classified,
    metas: Mapping[str, _TensorMeta],
    settings: _LoraSettings,
    w_file: Path,
    layout: ExpertParamLayout,
) -> list[_F2Fit]:
    """The (H, I) hypotheses of the first wrapper's shapes that :func:`_resolve_f2` accepts for every
    wrapper; refuses the adapter (with the telling refusal) when none does."""
    first = next(iter(c.f2.values()))
    assert first.a is not None and first.b is not None
    a_cols, b_rows = metas[first.a].shape[1], metas[first.b].shape[0]
    hyps: list[tuple[int, int]] = []
    for h, i2, div in ((a_cols, b_rows, 2), (b_rows, a_cols, 2), (b_rows, a_cols, 1), (a_cols, b_rows, 1)):
        if h > 0 and i2 > 0 and i2 % div == 0 and (h, i2 // div) not in hyps:
            hyps.append((h, i2 // div))
    fits: list[_F2Fit] = []
    errors: list[tuple[int, int, AdapterLoadError]] = []
    for h, i in hyps:
        found: list[str] = []
        try:
            fmt, assignment = _resolve_f2(c.f2, c.f2_layer, metas, settings, w_file,
                                          dict.fromkeys(_F2_PARAMS, 1), h, i, found, layout)
        except AdapterLoadError as e:
            errors.append((h, i, e))
        else:
            fits.append((h, i, fmt, assignment, found))
    if not fits:
        if not errors:
            raise _fail(w_file, "fused-parameter LoRA tensors with a zero-sized dimension", first.a)
        if len({str(e) for _, _, e in errors}) == 1:  # the refusal does not depend on the sizes tried
            raise errors[0][2]
        # the telling refusal: of a size the first wrapper fits, by a later wrapper (e.g. another layer)
        later = [(h, i, e) for h, i, e in errors if first.a not in str(e) and first.b not in str(e)]
        h, i, e = (later or errors)[0]
        raise _fail(
            w_file,
            f"the fused-parameter (F2) LoRA tensors fit no single hidden/intermediate size: the first "
            f"wrapper's lora_A {metas[first.a].shape} / lora_B {metas[first.b].shape} allow (H, I) in "
            f"{hyps}, and each is refused; e.g. with H={h}, I={i}: {str(e).removeprefix(f'{w_file}: ')}",
        )
    return fits


def _choose_f2_fit(
    fits: list[_F2Fit], settings: _LoraSettings, notes: list[str]
) -> tuple[int, int, str, dict[tuple[str, int], tuple[str, bool]], list[tuple[int, int, str]]]:
    """``(H, I, format, assignment, size candidates)`` of the first fit, after ``peft_version`` picked one
    of several where it can; the candidates (and a combined format) are left when the model must decide.
    How it was decided goes to ``notes``."""
    by_version = False
    if len(fits) > 1:
        ver = _version_tuple(settings.peft_version)
        if ver is not None:
            swapped = (0, 17) <= ver[:2] and ver < (0, 19, 1)
            chosen = [f for f in fits if (f[2] == FORMAT_F2_SWAPPED) == swapped]
            if len(chosen) == 1:
                others = ", ".join(f"H={h} I={i}" for h, i, *_ in fits if (h, i) != chosen[0][:2])
                notes.append(
                    f"H and I decided by peft_version {settings.peft_version!r}: the shapes alone also fit "
                    f"{others} in the {'current' if swapped else 'PEFT 0.17-0.19.0'} orientation"
                )
                fits, by_version = chosen, True
    h, i, fmt, assignment, found = fits[0]
    candidates = [(fh, fi, ff) for fh, fi, ff, _, _ in fits] if len(fits) > 1 else []
    if candidates:
        fmt = f"{FORMAT_F2} or {FORMAT_F2_SWAPPED}"
        notes.append(
            "the shapes fit " + " or ".join(f"H={fh} I={fi} ({ff})" for fh, fi, ff in candidates)
            + ", and the config has no peft_version that tells which: the model's sizes decide"
        )
    elif not by_version:
        notes.extend(found)
    return h, i, fmt, assignment, candidates


def _describe_f2_params(
    c: _Classified,
    metas: Mapping[str, _TensorMeta],
    settings: _LoraSettings,
    w_file: Path,
    assignment: Mapping[tuple[str, int], tuple[str, bool]],
) -> tuple[dict[str, int], dict[str, float], int, list[str], dict[int, list[str]]]:
    """Ranks and alphas of each adapted parameter path, the expert count E the lora_A rows imply (refused
    unless one), the folded parameter names and the projections adapted per layer."""
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    n_exp: dict[int, str] = {}
    templates: dict[str, set[str]] = {}
    projections: dict[int, set[str]] = {}
    for (container, depth), (param, _) in assignment.items():
        p = c.f2[(container, depth)]
        assert p.a is not None
        rows = metas[p.a].shape[0]
        pname = f"{container}.{param}"
        cfg_r, alpha = settings.rank_alpha(pname)
        if rows % cfg_r:
            raise _fail(
                w_file,
                f"lora_A of {pname} has {rows} rows, not a multiple of its rank {cfg_r} (r / rank_pattern): "
                "lora_A must hold num_experts x rank rows",
                p.a,
            )
        n_exp.setdefault(rows // cfg_r, p.a)
        ranks[pname], alphas[pname] = cfg_r, alpha
        lid = c.f2_layer[container]
        projections.setdefault(lid, set()).update(("down",) if param == "down_proj" else ("gate", "up"))
        m = _F2_MODULE.match(container)
        assert m is not None
        templates.setdefault(_fold_ids(container, m, ("layer",), ("{L}",)), set()).add(param)
    if len(n_exp) > 1:
        found_e = ", ".join(f"{e} (from {k!r})" for e, k in n_exp.items())
        first_key = next(iter(n_exp.values()))
        raise _fail(w_file, f"the fused LoRA tensors imply different expert counts: {found_e}", first_key)
    return (
        ranks, alphas, next(iter(n_exp)), _join_templates(templates),
        {lid: [p for p in _PROJ_ORDER if p in ps] for lid, ps in sorted(projections.items())},
    )


def describe_peft_adapter(path: str | os.PathLike[str]) -> AdapterSummary:
    """What a PEFT adapter holds, from its config and safetensors header alone: no model sizes needed.

    Classifies the keys as :func:`read_peft_adapter` does and infers the sizes a model must have from the
    tensor shapes (``H``, ``I``; ``E`` for fused adapters, a lower bound for per-expert ones). No tensor
    data is read. It refuses only what :func:`read_peft_adapter` would refuse for every model; whether
    the adapter fits a given model (layer ids, expert count, sizes, ``max_rank``, finite values) is for
    :func:`read_peft_adapter` with that model's sizes.

    Raises:
        AdapterInputError: the path names no readable adapter directory, or its config is not a JSON object.
        AdapterLoadError: the adapter cannot be served by any model (unsupported feature, unknown layout,
            corrupt safetensors file, inconsistent shapes, ...); the message names the file, key and reason.
        TypeError: ``path`` is not a ``str`` / ``os.PathLike`` (see :func:`check_adapter_path`).
    """
    adir, cfg_file, w_file = _described_files(path)
    settings, raw = _described_config(cfg_file)
    base = raw.get("base_model_name_or_path")
    auto_mapping = raw.get("auto_mapping")
    base_class = auto_mapping.get("base_model_class") if isinstance(auto_mapping, dict) else None

    header = _read_safetensors_header(w_file)
    metas = header.tensors
    if not metas:
        raise _fail(w_file, "the file holds no tensors: no expert LoRA weights at all")
    c = _classify_keys(metas, settings, w_file)

    notes: list[str] = []
    if c.f1:
        fmt = FORMAT_F1
        ranks, alphas, hid, inter, layout, templates = _describe_f1(c, metas, settings, w_file)
        candidates: list[tuple[int, int, str]] = []
        experts, projections, min_experts = _describe_f1_experts(c, notes)
        num_experts = None
    else:
        (fmt, layout, templates, num_experts, hid, inter, candidates, ranks, alphas,
         projections) = _describe_f2(c, metas, settings, w_file, notes)
        experts = {lid: set(range(num_experts)) for lid in projections}
        min_experts = num_experts
        if candidates:
            hid = inter = None
    pattern_modules = [
        n for n in ranks
        if settings._pattern_key(settings.rank_pattern, n) is not None
        or settings._pattern_key(settings.alpha_pattern, n) is not None
    ]
    return AdapterSummary(
        path=str(adir),
        format=fmt,
        layout=layout,
        module_names=templates,
        layers=sorted(experts),
        experts_per_layer={lid: sorted(es) for lid, es in sorted(experts.items())},
        projections=projections,
        num_experts=num_experts,
        min_experts=min_experts,
        hidden_size=hid,
        intermediate_size=inter,
        size_candidates=candidates,
        ranks=ranks,
        alphas=alphas,
        scalings={n: settings.scaling(r, alphas[n]) for n, r in ranks.items()},
        pattern_modules=pattern_modules,
        max_rank=max(ranks.values()),
        r=settings.r,
        lora_alpha=settings.alpha,
        use_rslora=settings.use_rslora,
        rank_pattern=dict(settings.rank_pattern),
        alpha_pattern=dict(settings.alpha_pattern),
        peft_version=settings.peft_version,
        base_model=(base.strip() or None) if isinstance(base, str) else None,
        base_model_class=base_class if isinstance(base_class, str) and base_class else None,
        ignored_keys=c.ignored,
        file_bytes=header.size,
        lora_bytes=sum(metas[k].end - metas[k].begin for k in c.factor_keys),
        ignored_bytes=sum(metas[k].end - metas[k].begin for k in c.ignored),
        dtypes=sorted({metas[k].dtype for k in c.factor_keys}),
        notes=notes,
    )


def _described_files(path: str | os.PathLike[str]) -> tuple[Path, Path, Path]:
    """``(directory, config file, safetensors file)`` of the adapter at ``path``; AdapterInputError where
    there is none to describe (with a hint at an adapter one folder down)."""
    try:
        adir = check_adapter_path(path)
    except AdapterLoadError as e:
        raise AdapterInputError(str(e)) from None
    cfg_file, w_file = adir / CONFIG_NAME, adir / WEIGHTS_NAME
    try:
        _check_files(adir, cfg_file, w_file)
    except AdapterLoadError as e:
        hint = _nested_adapter_hint(adir) if adir.is_dir() and not cfg_file.exists() else ""
        raise AdapterInputError(str(e) + hint) from None
    except OSError as e:
        raise AdapterInputError(
            str(_fail(adir, f"cannot access the adapter directory: {type(e).__name__}: {e}"))
        ) from e
    return adir, cfg_file, w_file


def _described_config(cfg_file: Path) -> tuple[_LoraSettings, dict[str, Any]]:
    """The checked settings of the config and the config itself; AdapterInputError for a config that
    cannot be read or is not a JSON object, AdapterLoadError for one no model could serve."""
    raw: Any = None
    try:
        try:
            text = cfg_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise _fail(cfg_file, f"cannot read the adapter config: {type(e).__name__}: {e}") from e
        raw = _load_json(cfg_file, text, "adapter config")
        if not isinstance(raw, dict) or _nesting_depth(raw, _MAX_CONFIG_DEPTH) > _MAX_CONFIG_DEPTH:
            _parse_config(cfg_file)  # refuses it, worded as the loader words it
    except AdapterLoadError as e:
        raise AdapterInputError(str(e)) from None
    settings = _parse_config(cfg_file)
    return settings, raw if isinstance(raw, dict) else {}


def _describe_f1_experts(
    c: _Classified, notes: list[str]
) -> tuple[dict[int, set[int]], dict[int, list[str]], int]:
    """Experts and projections per layer of a per-expert adapter and the least expert count a model must
    have; experts missing below it, or lacking some of their layer's projections, go to ``notes``."""
    experts: dict[int, set[int]] = {}
    projs: dict[int, set[str]] = {}
    for lid, e, proj in c.f1:
        experts.setdefault(lid, set()).add(e)
        projs.setdefault(lid, set()).add(proj)
    projections = {lid: [p for p in _PROJ_ORDER if p in ps] for lid, ps in sorted(projs.items())}
    min_experts = max(max(es) for es in experts.values()) + 1
    missing = {lid: sorted(set(range(min_experts)) - es) for lid, es in sorted(experts.items())}
    if any(missing.values()):
        gaps = "; ".join(f"layer {lid}: {_brief(ids)}" for lid, ids in missing.items() if ids)
        notes.append(f"experts without LoRA weights (of ids 0-{min_experts - 1}): {gaps}")
    partial = sum(
        1 for lid, es in experts.items() for e in es
        if sum((lid, e, p) in c.f1 for p in _PROJ_ORDER) != len(projections[lid])
    )
    if partial:
        notes.append(f"{partial} experts lack some of their layer's adapted projections")
    return experts, projections, min_experts
