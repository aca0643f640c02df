"""``adapter_config.json``: the LoraConfig fields that decide ranks and scalings, and those refused.

Scaling is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), with ``r`` and ``alpha``
taken from ``rank_pattern`` / ``alpha_pattern`` exactly as PEFT's ``get_pattern_key`` does: the first
key ``k`` (in the config's order) with ``re.match(rf"(.*\\.)?({k})$", name)``, where ``name`` is the
module path as PEFT sees it, without ``base_model.model.`` (``model.layers.3.mlp.experts.5.w1``), and
for F2 the parameter path (``model.layers.3.mlp.experts.gate_up_proj``). Options that change the forward
math beyond ``W + s*B*A`` (DoRA, LoRA bias, residual initialisations, ...) are refused with the reason.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moelora.peft_adapter.formats import _F2_PARAMS, _JETMOE_PARAMS, _ROUTER_SEGMENTS, ExpertParamLayout
from moelora.peft_adapter.messages import _fail, _json_type

# LoraConfig fields whose (truthy) value changes the forward math beyond W + s*B*A, or the meaning of the
# layer indices. Each is refused with this explanation.
_REFUSED_FEATURES: dict[str, str] = {
    "use_dora": "DoRA (use_dora) rescales every output column by a learned magnitude, which is not W + s*B*A",
    "lora_bias": "LoRA bias (lora_bias) adds a trained bias to lora_B",
    "use_qalora": "QALoRA (use_qalora) average-pools the input in groups before lora_A",
    "layer_replication": "layer_replication builds a stack of replicated layers whose indices are not the "
    "base model's layer ids",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) applies the adapter only from the "
    "invocation tokens on, which depends on the token sequence",
    "trainable_token_indices": "trainable tokens (trainable_token_indices) change embedding rows",
    "use_bdlora": "BD-LoRA (use_bdlora) stores block-diagonal LoRA factors",
    "arrow_config": "Arrow (arrow_config) routes each token among several LoRA adapters",
    "kasa_config": "KaSA (kasa_config) truncates the base weight and adds a learned singular-value diagonal",
    "monteclora_config": "MonteCLoRA (monteclora_config) adds variational sampling to the LoRA factors",
}
# init_lora_weights values that leave the adapter paired with a *modified* base weight (a residual).
_RESIDUAL_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


@dataclass
class _LoraSettings:
    """The parts of a LoraConfig that decide ranks and scalings."""

    r: int
    alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    target_parameters: list[str]
    modules_to_save: list[str]
    peft_version: str | None
    file: Path

    @staticmethod
    def _pattern_key(patterns: Mapping[str, Any], name: str) -> str | None:
        """PEFT's ``get_pattern_key``: the first key (config order) whose regex matches ``name``'s end."""
        for key in patterns:
            if re.match(rf"(.*\.)?({key})$", name):
                return key
        return None

    def rank_alpha(self, name: str) -> tuple[int, float]:
        rk = self._pattern_key(self.rank_pattern, name)
        ak = self._pattern_key(self.alpha_pattern, name)
        r = self.rank_pattern[rk] if rk is not None else self.r
        alpha = self.alpha_pattern[ak] if ak is not None else self.alpha
        return int(r), float(alpha)

    def scaling(self, r: int, alpha: float) -> float:
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _truthy(v: Any) -> bool:
    return v not in (None, False, 0, "", [], {})


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # a JSON integer beyond the float range
        return False


# Deeper than any LoraConfig (its deepest fields are lists of lists / small dicts). Refusing deeper values
# up front keeps every later repr()/str() of a config value (in messages) clear of RecursionError.
_MAX_CONFIG_DEPTH = 64
_F32_MAX = torch.finfo(torch.float32).max


def _nesting_depth(value: Any, limit: int) -> int:
    """Depth of nested lists/dicts in a parsed JSON value, counted without recursion; stops past ``limit``."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if not isinstance(v, (list, dict)):
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            break
        stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def _load_json(file: Path, text: str, what: str) -> Any:
    """``json.loads`` whose every failure (syntax, nesting, integer size) is an AdapterLoadError."""
    try:
        return json.loads(text)
    except RecursionError as e:  # json's parser recurses once per nesting level
        raise _fail(
            file, f"invalid {what}: nested too deeply to parse (deeper than Python's recursion limit)"
        ) from e
    except ValueError as e:  # JSONDecodeError, and integers beyond Python's int_max_str_digits
        raise _fail(file, f"invalid JSON in the {what}: {e}") from e


def _check_scalings(
    file: Path,
    r: int,
    alpha: float,
    use_rslora: bool,
    rank_pattern: Mapping[str, int],
    alpha_pattern: Mapping[str, float],
) -> None:
    """Refuses any alpha whose scaling cannot be stored: the pool keeps scalings in float32.

    Which rank a module gets with which alpha is only known per module, so each alpha is checked with
    the smallest rank the config can give (the largest scaling it can produce); no other pairing overflows.
    """
    r_min, r_field = r, "r"
    for k, v in rank_pattern.items():
        if v < r_min:
            r_min, r_field = v, f"rank_pattern[{k!r}]"
    # JSON ranks may be integers beyond the float range: capped, the divisor only gets smaller, so the
    # bound stays an upper bound (and such a rank can match no tensor anyway)
    denom = float(min(r_min, 2**64))
    if use_rslora:
        denom, formula = math.sqrt(denom), "alpha / sqrt(r)"
    else:
        formula = "alpha / r"
    for field_name, key, a in (
        ("lora_alpha", "lora_alpha", alpha),
        *((f"alpha_pattern[{k!r}]", "alpha_pattern", v) for k, v in alpha_pattern.items()),
    ):
        s = abs(float(a)) / denom
        if not s <= _F32_MAX:
            raise _fail(
                file,
                f"{field_name} = {a!r} gives a LoRA scaling of {s:.4g} ({formula} with {r_field} = {r_min}, "
                f"the smallest rank the config gives), which does not fit float32 (|scaling| <= "
                f"{_F32_MAX:.4g}): the pool stores scalings in float32",
                key,
            )


def _parse_config(file: Path, layout: ExpertParamLayout | None = None) -> _LoraSettings:
    """The checked LoRA settings of an adapter config; AdapterLoadError for anything that cannot be served.

    With ``layout`` (a pool's :class:`ExpertParamLayout`), a gpt-oss adapter is refused unless the layout
    interleaves gate and up.
    """
    cfg = _read_config_object(file)
    _refuse_unsupported_features(file, cfg)
    r, alpha, use_rslora = _rank_alpha_rslora(file, cfg)
    patterns = _rank_and_alpha_patterns(file, cfg)
    _check_scalings(file, r, float(alpha), use_rslora, patterns["rank_pattern"], patterns["alpha_pattern"])
    target_parameters = _target_parameters(file, cfg)
    _refuse_interleaved_gate_up(file, cfg, target_parameters, layout)
    mts = _modules_to_save(file, cfg)

    version = cfg.get("peft_version")
    return _LoraSettings(
        r=int(r),
        alpha=float(alpha),
        use_rslora=use_rslora,
        rank_pattern=patterns["rank_pattern"],
        alpha_pattern=patterns["alpha_pattern"],
        target_parameters=list(target_parameters),
        modules_to_save=list(mts),
        peft_version=str(version) if version is not None else None,
        file=file,
    )


def _read_config_object(file: Path) -> dict[str, Any]:
    """The config file parsed: a JSON object of at most :data:`_MAX_CONFIG_DEPTH` nesting levels."""
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise _fail(file, f"cannot read the adapter config: {type(e).__name__}: {e}") from e
    cfg = _load_json(file, text, "adapter config")
    if not isinstance(cfg, dict):
        raise _fail(
            file,
            f"the adapter config must be a JSON object ({{...}} of LoraConfig fields), got a JSON "
            f"{_json_type(cfg)}",
        )
    depth = _nesting_depth(cfg, _MAX_CONFIG_DEPTH)
    if depth > _MAX_CONFIG_DEPTH:
        raise _fail(
            file,
            f"invalid adapter config: nested too deeply (more than {_MAX_CONFIG_DEPTH} levels of "
            "objects/arrays; a LoraConfig has a few)",
        )
    return cfg


def _refuse_unsupported_features(file: Path, cfg: Mapping[str, Any]) -> None:
    """Refuses a PEFT type other than LoRA, the :data:`_REFUSED_FEATURES`, trained base biases and the
    :data:`_RESIDUAL_INITS` (adapters paired with a modified base weight)."""
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _fail(
            file,
            f"unsupported PEFT type {peft_type!r}: only LoRA adapters (peft_type 'LORA') can be served",
            "peft_type",
        )
    for name, why in _REFUSED_FEATURES.items():
        if _truthy(cfg.get(name)):
            raise _fail(file, f"unsupported feature {name}={cfg[name]!r}: {why}", name)
    bias = cfg.get("bias", "none")
    if bias not in (None, "none"):
        raise _fail(
            file,
            f"unsupported feature bias={bias!r}: the adapter trains base-layer biases; only "
            "bias='none' can be served",
            "bias",
        )
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_RESIDUAL_INITS):
        raise _fail(
            file,
            f"unsupported feature init_lora_weights={init!r}: this initialisation changes the base weights "
            "(the adapter is paired with a residual base model); convert it to a plain LoRA first with "
            "PEFT's "
            "save_pretrained(..., path_initial_model_for_weight_conversion=...)",
            "init_lora_weights",
        )


def _rank_alpha_rslora(file: Path, cfg: Mapping[str, Any]) -> tuple[int, int | float, bool]:
    """``r`` (a positive int), ``lora_alpha`` (a finite number) and ``use_rslora`` (a bool), checked."""
    r = cfg.get("r", 8)
    if not _is_int(r) or r <= 0:
        raise _fail(file, f"r must be a positive int, got {r!r}", "r")
    alpha = cfg.get("lora_alpha", 8)
    if not _is_number(alpha):
        raise _fail(file, f"lora_alpha must be a finite number, got {alpha!r}", "lora_alpha")
    use_rslora = cfg.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _fail(file, f"use_rslora must be true or false, got {use_rslora!r}", "use_rslora")
    return r, alpha, use_rslora


def _rank_and_alpha_patterns(file: Path, cfg: Mapping[str, Any]) -> dict[str, dict]:
    """``{"rank_pattern": {regex: rank}, "alpha_pattern": {regex: alpha}}``: each key a valid regular
    expression (as PEFT wraps it), each rank a positive int, each alpha a finite number."""
    patterns: dict[str, dict] = {}
    for pname, check, what in (
        ("rank_pattern", lambda v: _is_int(v) and v > 0, "a positive int"),
        ("alpha_pattern", _is_number, "a finite number"),
    ):
        pat = cfg.get(pname) or {}
        if not isinstance(pat, dict):
            raise _fail(
                file, f"{pname} must be an object mapping regex -> value, got {type(pat).__name__}", pname
            )
        for k, v in pat.items():
            try:
                re.compile(rf"(.*\.)?({k})$")
            except re.error as e:
                raise _fail(file, f"{pname} key {k!r} is not a valid regular expression: {e}", pname) from e
            if not check(v):
                raise _fail(file, f"{pname}[{k!r}] must be {what}, got {v!r}", pname)
        patterns[pname] = dict(pat)
    return patterns


def _target_parameters(file: Path, cfg: Mapping[str, Any]) -> list[str]:
    """``target_parameters``: names of fused expert parameters (:data:`_F2_PARAMS`, JetMoE's) or router
    weights (ignored later); anything else is refused."""
    target_parameters = cfg.get("target_parameters") or []
    if isinstance(target_parameters, str) or not isinstance(target_parameters, list):
        raise _fail(
            file,
            f"target_parameters must be a list of parameter names, got {target_parameters!r}",
            "target_parameters",
        )
    for t in target_parameters:
        if not isinstance(t, str) or not t:
            raise _fail(
                file, f"target_parameters entries must be non-empty strings, got {t!r}", "target_parameters"
            )
        module, _, leaf = t.rpartition(".")
        is_router = leaf == "weight" and module.rpartition(".")[2] in _ROUTER_SEGMENTS
        jetmoe = leaf == "weight" and module.rpartition(".")[2] in _JETMOE_PARAMS
        if leaf not in _F2_PARAMS and not is_router and not jetmoe:
            raise _fail(
                file,
                f"unsupported target_parameters entry {t!r}: only the fused expert parameters "
                f"{list(_F2_PARAMS)} (and router weights, which are ignored) are understood",
                "target_parameters",
            )
    return target_parameters


def _refuse_interleaved_gate_up(
    file: Path, cfg: Mapping[str, Any], target_parameters: list[str], layout: ExpertParamLayout | None
) -> None:
    """Refuses a gpt-oss adapter (interleaved gate/up columns, told by the base model's name or class) of
    ``gate_up_proj`` for a pool whose ``layout`` expects ``[gate rows; up rows]``."""
    auto_mapping = cfg.get("auto_mapping")
    base_class = auto_mapping.get("base_model_class", "") if isinstance(auto_mapping, dict) else ""
    base_hint = re.sub(r"[-_\s]", "", f"{cfg.get('base_model_name_or_path') or ''} {base_class}".lower())
    interleaved = layout is not None and layout.gate_up_interleaved
    if (layout is not None and not interleaved and "gptoss" in base_hint
            and any(t.rpartition(".")[2] == "gate_up_proj" for t in target_parameters)):
        raise _fail(
            file,
            "unsupported expert layout: gpt-oss interleaves gate and up columns in gate_up_proj, and this "
            "pool was built for [gate rows; up rows] experts; load gpt-oss adapters through "
            "moelora.integrations.attach on the gpt-oss model (or a pool with "
            "ExpertParamLayout(gate_up_interleaved=True))",
            "base_model_name_or_path",
        )


def _modules_to_save(file: Path, cfg: Mapping[str, Any]) -> list[str]:
    """``modules_to_save`` as a list of module names (a single string is one name)."""
    mts = cfg.get("modules_to_save") or []
    if isinstance(mts, str):
        mts = [mts]
    if not isinstance(mts, list) or not all(isinstance(m, str) for m in mts):
        raise _fail(file, f"modules_to_save must be a list of module names, got {mts!r}", "modules_to_save")
    return mts


def _version_tuple(version: str | None) -> tuple[int, ...] | None:
    """``"0.18.1"`` -> (0, 18, 1); ``"0.19.1.dev0@abc"`` -> (0, 19, 1); None when it cannot be read."""
    if not version:
        return None
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version.partition("@")[0])
    if not m:
        return None
    return tuple(int(g or 0) for g in m.groups())

