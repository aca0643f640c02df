"""Sorting a safetensors file's keys into expert LoRA pairs, per-expert (F1) or fused-parameter (F2), and
keys that are not served (attention, shared experts, dense MLPs, routers, embeddings,
``modules_to_save``), each with the reason; refusing what no model could serve."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moelora.peft_adapter.config import _LoraSettings
from moelora.peft_adapter.formats import (
    _DENSE_PROJ,
    _F1_MODULE,
    _F1_PROJ,
    _F2_MODULE,
    _LORA_BIAS,
    _LORA_KEY,
    _LORA_KEY_ENDS,
    _MLP_SEGMENTS,
    _PEFT_PREFIX,
    _PROJ_RANK,
    _ROUTER_SEGMENTS,
    _SHARED_SEGMENTS,
    _SHARED_SET,
)
from moelora.peft_adapter.messages import _fail
from moelora.peft_adapter.paths import WEIGHTS_NAME, check_adapter_path
from moelora.peft_adapter.safetensors_file import _LORA_DTYPES, _read_safetensors_header, _TensorMeta
from moelora.peft_adapter.validation import _check_factor_meta


def _segments(module: str) -> list[str]:
    return module.split(".")


def _is_shared(module: str) -> bool:
    return not _SHARED_SET.isdisjoint(_segments(module))


def _is_expertish(module: str) -> bool:
    return any("expert" in s and s not in _SHARED_SEGMENTS for s in _segments(module))


def _non_expert_reason(module: str) -> str:
    segs = _segments(module)
    if _is_shared(module):
        return "shared expert (a dense MLP every token uses, not a routed expert): not merged"
    if segs[-1] in _ROUTER_SEGMENTS:
        return "router / gate (routing is computed outside the MoE layer): not merged"
    if any("attn" in s or "attention" in s for s in segs):
        return "attention module: not an MoE expert, not merged"
    if "embed" in module or segs[-1] in ("lm_head", "wte", "wpe"):
        return "embedding / output head: not an MoE expert, not merged"
    if segs[-1] in _DENSE_PROJ and any(s in _MLP_SEGMENTS for s in segs):
        return "dense MLP (not an MoE expert): not merged"
    return "not an MoE expert module: not merged"


def _matches_module(module: str, names: Iterable[str]) -> bool:
    return any(module == n or module.endswith("." + n) or f".{n}." in f".{module}." for n in names)


@dataclass(slots=True)
class _Pair:
    """The safetensors keys of one module's lora_A and lora_B."""

    a: str | None = None
    b: str | None = None


def _lora_weight(name: str) -> tuple[str, str] | None:
    """``(module, "lora_A" | "lora_B")`` when ``name`` is a LoRA A/B weight (``_LORA_KEY``), else None."""
    if name.endswith(_LORA_KEY_ENDS):  # the common case, decided without the regex
        return (name[:-14], name[-13:-7]) if len(name) > 14 and "\n" not in name else None
    m = _LORA_KEY.match(name)  # e.g. a name ending in a newline, which ``$`` lets the regex match
    return None if m is None else (m.group("module"), m.group("ab"))


def _first_key(pairs: Mapping[Any, _Pair]) -> str | None:
    p = next(iter(pairs.values()))
    return p.a or p.b


@dataclass
class _Classified:
    """The expert LoRA keys of a file, sorted as :func:`moelora.peft_loader._read` sorts them, and the keys
    it ignores."""

    ignored: dict[str, str]
    f1: dict[tuple[int, int, str], _Pair]
    f1_module: dict[tuple[int, int, str], str]
    f2: dict[tuple[str, int], _Pair]
    f2_layer: dict[str, int]
    factor_keys: list[str]


# The start of the reason an ignored key gets when it belongs to another expert set of its layer.
OTHER_EXPERT_SET = "another expert set of the layer"


def in_expert_set(module: str, expert_set: str) -> bool:
    """Whether ``module`` (a LoRA key's module path) lies in the expert set ``expert_set`` of its layer."""
    return re.search(r"(?:^|\.)layers\.\d+\." + re.escape(expert_set) + r"(?:\.|$)", module) is not None


def lora_module_names(path: str | os.PathLike[str]) -> frozenset[str]:
    """The module paths of the LoRA A/B weights of a PEFT adapter directory, from its safetensors header
    alone (no tensor data read): what decides which expert sets an adapter touches. AdapterLoadError for a
    directory or header that cannot be read."""
    w_file = check_adapter_path(path) / WEIGHTS_NAME
    names = (_lora_weight(key.removeprefix(_PEFT_PREFIX)) for key in _read_safetensors_header(w_file).tensors)
    return frozenset(found[0] for found in names if found is not None)


def _classify_keys(metas: Mapping[str, _TensorMeta], settings: _LoraSettings, w_file: Path,
                   expert_set: str | None = None) -> _Classified:
    """Sorts a file's keys into per-expert (F1) and fused-parameter (F2) LoRA pairs and ignored keys, and
    refuses what no model could serve (DoRA, LoRA bias, unknown expert layouts, mixed layouts, no expert
    weights, lone factors, factor dtypes): the checks that need no model sizes, shared by
    :func:`moelora.peft_loader._read` and :func:`moelora.peft_loader.describe_peft_adapter`. With
    ``expert_set`` (``ExpertParamLayout.expert_set``) the expert LoRA of a layer's other expert sets is
    ignored."""
    c = _Classified(ignored={}, f1={}, f1_module={}, f2={}, f2_layer={}, factor_keys=[])
    # F1 module -> its (layer, expert, projection): the second factor of a module is not parsed again
    f1_slot_of: dict[str, tuple[int, int, str]] = {}
    for key in metas:
        name = key.removeprefix(_PEFT_PREFIX)
        _refuse_dora_and_lora_bias(w_file, key, name)
        lora = _lora_weight(name)
        if lora is None:
            c.ignored[key] = _not_lora_weight_reason(w_file, key, name, settings)
            continue
        module, ab = lora
        slot = f1_slot_of.get(module)
        if slot is None:
            reason = _not_this_pools_expert(module, expert_set)
            if reason is not None:
                c.ignored[key] = reason
                continue
            slot = _f1_slot(module)
            if slot is not None:
                f1_slot_of[module] = slot
        if slot is not None:
            pair = _f1_pair(c, w_file, key, module, ab, slot)
        else:
            pair = _f2_pair(c, w_file, key, module, ab)
            if pair is None:  # ignored
                continue
        if ab == "lora_A":
            pair.a = key
        else:
            pair.b = key
    return _finish_classification(c, metas, w_file)


def _refuse_dora_and_lora_bias(w_file: Path, key: str, name: str) -> None:
    """Refuses a DoRA magnitude vector or a LoRA bias (the forward is not ``W + s*B*A``)."""
    if "lora_magnitude_vector" in name:
        raise _fail(w_file, "DoRA magnitude vector: DoRA adapters are not supported (not W + s*B*A)", key)
    if "bias" in name and _LORA_BIAS.search(name):
        raise _fail(
            w_file, "LoRA bias (lora_bias): a trained bias on the LoRA factors is not supported", key
        )


def _not_lora_weight_reason(w_file: Path, key: str, name: str, settings: _LoraSettings) -> str:
    """Why a key that is no LoRA A/B weight is ignored; refused where it is a routed expert's weight (a
    ``modules_to_save`` copy of one, or an expert tensor of no known layout)."""
    module = name.rpartition(".")[0]
    if settings.modules_to_save and _matches_module(module, settings.modules_to_save):
        if _is_expertish(module) and not _is_shared(module):
            raise _fail(
                w_file,
                "modules_to_save replaces routed-expert weights wholesale; only LoRA "
                "deltas can be served",
                key,
            )
        return "modules_to_save (a full copy of a non-expert module): not merged"
    if "lora_embedding_" in name:
        return "embedding LoRA: not an MoE expert, not merged"
    if "lora_velora_" in name:
        return "VeLoRA training buffer (unused at inference)"
    if _is_expertish(module) and not _is_shared(module):
        raise _fail(
            w_file,
            "unknown expert layout: an expert tensor that is neither a per-expert "
            "(F1) nor a fused-parameter (F2) LoRA A/B weight",
            key,
        )
    return "not a LoRA A/B weight: " + _non_expert_reason(module)


def _not_this_pools_expert(module: str, expert_set: str | None) -> str | None:
    """Why the LoRA weight of ``module`` is ignored when it is a shared expert's or one of another expert
    set of its layer (None: it may be this pool's)."""
    if _is_shared(module):
        return _non_expert_reason(module)
    if expert_set is not None and _is_expertish(module) and not in_expert_set(module, expert_set):
        return f"{OTHER_EXPERT_SET}, not {expert_set!r}: read by that set's pool"
    return None


def _f1_slot(module: str) -> tuple[int, int, str] | None:
    """``(layer, expert, projection)`` of a per-expert (F1) module path, or None when it is not one."""
    m1 = _F1_MODULE.match(module)
    if m1 is not None and m1.group("proj") in _F1_PROJ:
        layer, expert, proj = m1.group("layer", "expert", "proj")
        return int(layer), int(expert), _F1_PROJ[proj]
    return None


def _f1_pair(c: _Classified, w_file: Path, key: str, module: str, ab: str,
             slot: tuple[int, int, str]) -> _Pair:
    """The F1 pair of ``slot`` that the factor ``ab`` (``key``) of ``module`` joins; refuses a second
    module or factor for the same (layer, expert, projection)."""
    pair = c.f1.get(slot)
    if pair is None:
        pair = c.f1[slot] = _Pair()
    prev = c.f1_module.setdefault(slot, module)
    if prev != module or (pair.a if ab == "lora_A" else pair.b) is not None:
        raise _fail(
            w_file,
            f"duplicate LoRA weights for layer {slot[0]} expert {slot[1]} {slot[2]} (also in module "
            f"{prev!r})",
            key,
        )
    return pair


def _f2_pair(c: _Classified, w_file: Path, key: str, module: str, ab: str) -> _Pair | None:
    """The F2 pair (container, wrapper depth) that the factor ``ab`` (``key``) of ``module`` joins; None
    (the key ignored, with the reason) for a module that is no expert; refuses an expert module of no
    known layout and a second factor for the same wrapper."""
    m2 = _F2_MODULE.match(module)
    if m2 is None:
        if _is_expertish(module):
            raise _fail(
                w_file,
                "unknown expert layout: expert LoRA weights that match neither per-expert modules "
                "(...experts.{e}.{gate_proj|up_proj|down_proj|w1|w3|w2}) nor fused expert "
                "parameters (...experts[.base_layer].lora_A/B)",
                key,
            )
        c.ignored[key] = _non_expert_reason(module)
        return None
    container = m2.group("container")
    pair = c.f2.setdefault((container, m2.group("wrap").count(".base_layer")), _Pair())
    c.f2_layer[container] = int(m2.group("layer"))
    if (pair.a if ab == "lora_A" else pair.b) is not None:
        raise _fail(w_file, f"duplicate fused-parameter LoRA weights for {container!r}", key)
    return pair


def _finish_classification(c: _Classified, metas: Mapping[str, _TensorMeta], w_file: Path) -> _Classified:
    """``c`` with its pairs sorted (F1 by layer, expert, projection; F2 by layer, outer wrapper first) and
    its factor keys listed; refuses mixed F1 / F2 files, files without expert weights, lone factors and
    factor dtypes or shapes no LoRA has."""
    f2_layer = c.f2_layer
    f1 = dict(sorted(c.f1.items(), key=lambda kv: (kv[0][0], kv[0][1], _PROJ_RANK[kv[0][2]])))
    f2 = dict(sorted(c.f2.items(), key=lambda kv: (f2_layer[kv[0][0]], -kv[0][1])))
    if f1 and f2:
        raise _fail(
            w_file,
            "the file mixes per-expert (F1) and fused-parameter (F2) expert LoRA weights "
            f"(e.g. {_first_key(f2)!r}); unknown expert layout",
            _first_key(f1),
        )
    if not f1 and not f2:
        raise _fail(
            w_file,
            f"no expert LoRA weights at all ({len(metas)} tensors, none on a routed MoE expert: "
            f"{sorted(set(c.ignored.values()))})",
        )
    pairs: list[_Pair] = [*f1.values(), *f2.values()]
    for p in pairs:
        if p.a is None or p.b is None:
            have, missing = (p.a, "lora_B") if p.b is None else (p.b, "lora_A")
            raise _fail(w_file, f"lone LoRA factor: its {missing} counterpart is missing", have)
    factor_keys = [k for p in pairs for k in (p.a, p.b) if k is not None]
    for k in factor_keys:
        m = metas[k]
        if m.dtype not in _LORA_DTYPES or len(m.shape) != 2:  # the cases _check_factor_meta refuses
            _check_factor_meta(w_file, k, m)
    return _Classified(c.ignored, f1, c.f1_module, f2, f2_layer, factor_keys)
