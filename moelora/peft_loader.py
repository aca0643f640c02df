"""Reads PEFT LoRA adapters of Mixture-of-Experts models into per-layer :class:`ReferenceLoRA` objects.

:func:`read_peft_adapter` reads a PEFT adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``) on the host, validates all of it and returns, per MoE layer, the
gate/up/down LoRA of every expert in the form :meth:`MoELoRAMemoryPool.add_adapter_weights` takes. It
never touches a pool: :meth:`MoELoRAMemoryPool.load_adapter` reads with the pool's sizes through it and
places the result (validating again, and leaving the pool unchanged on any failure).

Layouts understood (facts checked against PEFT 0.21.2 with transformers 5.23, and the PEFT 0.17.1,
0.18.1, 0.19.0 and 0.19.1 sources):

F1, per-expert modules (transformers 4 MoE models, custom models): one ``nn.Linear`` per expert and
projection, ``target_modules``::

    base_model.model.<...>layers.{L}.<...>.experts.{e}.{gate_proj|up_proj|down_proj}.lora_{A|B}.weight
    base_model.model.<...>layers.{L}.block_sparse_moe.experts.{e}.{w1|w3|w2}.lora_{A|B}.weight  (Mixtral)

``A (r, in)``, ``B (out, r)``; ``w1`` is gate, ``w3`` up, ``w2`` down. ``rank_pattern`` /
``alpha_pattern`` may give single experts their own rank and alpha.

F2, fused expert parameters (transformers 5: ``experts.gate_up_proj (E, 2I, H)``, rows gate then up, and
``experts.down_proj (E, H, I)``, adapted through ``target_parameters`` with ``lora.ParamWrapper``). PEFT
nests one wrapper per targeted parameter in the order the experts module *registers* its parameters
(``named_parameters``), the first one innermost; every transformers-5 experts class registers
``gate_up_proj`` before ``down_proj``. So with both targets the gate_up LoRA is
``...experts.base_layer.lora_{A|B}.weight`` and the down LoRA ``...experts.lora_{A|B}.weight``, whatever
the order of ``target_parameters`` (PEFT's transformers-5 config conversion turns that list into a set,
so the saved order is arbitrary and says nothing about the nesting). With one target its LoRA is
``...experts.lora_{A|B}.weight``. Per parameter ``(E, out, in)``::

    A (E*r, in)    expert-major:  A_e = A[e*r:(e+1)*r]
    B (out, E*r)   rank-major:    B_e = B[:, e::E]          delta_e = scaling * B_e @ A_e

The gate_up A is shared by gate and up: gate uses ``A_e`` with ``B_e[:I]``, up ``A_e`` with ``B_e[I:]``.
PEFT 0.17.0 to 0.19.0 read the 3-D parameter as ``(E, in, out)`` and wrote ``A (E*r, out)``,
``B (in, E*r)`` (the same delta, transposed); then ``A_e = B[:, e::E].T`` and ``B_e = A[e*r:(e+1)*r].T``.
That layout is recognised by the shapes, and where the shapes cannot tell (``in == out``: ``H == 2I``
for gate_up, ``H == I`` for down, and no other F2 tensor of the file decides it) by ``peft_version``
in the config (written since PEFT 0.18.0; fixed in 0.19.1); with no readable ``peft_version`` such an
adapter is refused rather than guessed. gpt-oss (``gate_up_proj`` with interleaved gate/up columns) is
refused.

Scaling is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), with ``r`` and ``alpha``
taken from ``rank_pattern`` / ``alpha_pattern`` exactly as PEFT's ``get_pattern_key`` does: the first
key ``k`` (in the config's order) with ``re.match(rf"(.*\\.)?({k})$", name)``, where ``name`` is the
module path as PEFT sees it, without ``base_model.model.`` (``model.layers.3.mlp.experts.5.w1``), and
for F2 the parameter path (``model.layers.3.mlp.experts.gate_up_proj``). A config PEFT converted from a
transformers-4 adapter (``target_parameters`` with ``.*\\.gate_up_proj`` at rank ``2r``, alpha ``2*alpha``,
a block-diagonal gate_up B) is honoured as written.

Rank components that are exactly zero (an all-zero column of B or row of A) add exactly nothing and are
dropped, so the block-diagonal gate_up of a converted adapter costs rank ``r``, not ``2r``, and experts
a training run never routed to (B still zero) cost nothing; the ``max_rank`` limit applies to this
effective rank.

Keys of non-expert modules (attention, shared experts, dense MLPs, routers, embeddings) and
``modules_to_save`` copies are listed in :attr:`AdapterLoadReport.ignored_keys`, never merged into the
experts. Anything that cannot be served exactly raises :class:`AdapterLoadError` naming the file, the
key (where there is one) and the reason. The safetensors header (names, dtypes, shapes, data offsets) is
read and checked first; tensor data is read only once every shape and dtype of the adapter has passed.
"""

from __future__ import annotations

import json
import math
import operator
import os
import re
import reprlib
import sys
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from moelora.adapter_weights import AdapterLoadError, LoRAProjection, ReferenceLoRA

__all__ = [
    "BIN_NAME",
    "CONFIG_NAME",
    "FORMAT_F1",
    "FORMAT_F2",
    "FORMAT_F2_SWAPPED",
    "OTHER_EXPERT_SET",
    "WEIGHTS_NAME",
    "AdapterInputError",
    "AdapterLoadReport",
    "AdapterSummary",
    "check_adapter_path",
    "describe_peft_adapter",
    "in_expert_set",
    "lora_module_names",
    "read_peft_adapter",
]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
BIN_NAME = "adapter_model.bin"

FORMAT_F1 = "F1 per-expert modules"
FORMAT_F2 = "F2 fused expert parameters"
FORMAT_F2_SWAPPED = "F2 (PEFT 0.18-0.19 swapped)"

_PEFT_PREFIX = "base_model.model."
# per-expert projection module name -> our projection
_F1_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
# fused parameters in the order transformers-5 experts modules register them (innermost wrapper first);
# ungated experts (ExpertParamLayout.up_only) hold up_proj instead of gate_up_proj
_F2_PARAMS = ("gate_up_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertParamLayout:
    """How a model's fused expert parameters map onto the pool's gate, up and down rows (F2 adapters).

    Attributes:
        gate_up_interleaved: gate_up_proj's output columns alternate gate and up (gpt-oss): the gate_up B
            rows ``0::2`` are the gate's, ``1::2`` the up's.
        gate_up_experts: gate_up_proj holds this many experts, more than the model routes to its FFN
            experts (LongCat-Flash stores rows for its identity experts, which never read them): the LoRA
            factors of experts past ``num_experts`` are dropped. None: ``num_experts``.
        up_only: ungated experts (Nemotron-H): ``up_proj (E, I, H)``, no gate. Its LoRA is stored as both
            the gate's and the up's, the pool's form of ``relu(u) * u`` (``moelora.activations``).
        unflagged_transposed: the parameters are stored ``(E, in, out)`` without transformers'
            ``is_transposed`` flag (Llama-4), so PEFT writes their factors as ``A (E*r, out)``,
            ``B (in, E*r)``: what decides the orientation where the shapes cannot (``in == out``).
        expert_set: the experts module's path inside its decoder layer (``"mlp.text_moe.experts"``) where
            a layer holds several expert sets (ERNIE-4.5-VL: text and vision experts), one pool each: the
            LoRA of the layer's other sets is left to their pools (listed as ignored, with that reason).
            None: every expert LoRA of a layer is this pool's.
    """

    gate_up_interleaved: bool = False
    gate_up_experts: int | None = None
    up_only: bool = False
    unflagged_transposed: bool = False
    expert_set: str | None = None
_PROJ_ORDER = ("gate", "up", "down")
_PROJ_RANK = {p: i for i, p in enumerate(_PROJ_ORDER)}

_LORA_BIAS = re.compile(r"\.lora_[AB]\.bias$")
_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<ab>lora_A|lora_B)\.weight$")
_LORA_KEY_ENDS = (".lora_A.weight", ".lora_B.weight")
_F1_MODULE = re.compile(
    r"^(?:.*\.)?layers\.(?P<layer>\d+)\.(?:.+\.)?experts\.(?P<expert>\d+)\.(?P<proj>[^.]+)$"
)
_F2_MODULE = re.compile(
    r"^(?P<container>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:(?:.+\.)?experts|mlp\.(?:input|output)_linear))"
    r"(?P<wrap>(?:\.base_layer)*)$"
)
# JetMoE names its fused expert parameters ``mlp.input_linear.weight`` (E, 2I, H) and
# ``mlp.output_linear.weight`` (E, H, I), one parameter per module: the parameter each container holds.
_JETMOE_PARAMS = {"input_linear": "gate_up_proj", "output_linear": "down_proj"}

_SHARED_SEGMENTS = ("shared_expert", "shared_experts", "shared_mlp", "shared_expert_gate")
_SHARED_SET = frozenset(_SHARED_SEGMENTS)
_ROUTER_SEGMENTS = ("gate", "router", "shared_expert_gate", "e_score_correction_bias")
_MLP_SEGMENTS = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "moe")
_DENSE_PROJ = (*_F1_PROJ, "fc1", "fc2", "gate_up_proj", "dense_h_to_4h", "dense_4h_to_h", "c_fc", "c_proj")

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
class AdapterLoadReport:
    """What :func:`read_peft_adapter` found in an adapter directory.

    Attributes:
        path: the adapter directory.
        format: :data:`FORMAT_F1`, :data:`FORMAT_F2` or :data:`FORMAT_F2_SWAPPED`.
        ranks: PEFT module name (F1, e.g. ``model.layers.0.mlp.experts.3.gate_proj``) or parameter path
            (F2, e.g. ``model.layers.0.mlp.experts.gate_up_proj``) -> its rank, as in the file and the
            config (``rank_pattern`` applied).
        scalings: the same names -> ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA).
        layers: model layer ids holding expert LoRA weights.
        experts_per_layer: layer id -> experts with LoRA weights in the file.
        ignored_keys: safetensors key -> why it was not used (attention, shared expert, dense MLP, router,
            modules_to_save, ...).
        pool_bytes: device bytes the adapter takes in a pool's arena: for each (layer, expert) it trains,
            rank rows of the four matrices in the pool's dtype, as many as its largest module rank in that
            layer (a tensor- or expert-parallel pool stores its shard's part).
        max_rank: the adapter's largest effective rank over all expert modules (exactly-zero rank
            components dropped), i.e. the rank its pool slot gets.
        pool_max_rank: the ``max_rank`` the adapter was checked against.
        dtype: the dtype of the returned tensors (after ``pool.load_adapter``: the pool's dtype).
        peft_version: ``peft_version`` from the config (``None`` when absent).
        notes: remarks worth a log line (dropped zero rank components, how the F2 orientation was decided).
    """

    path: str
    format: str
    ranks: dict[str, int]
    scalings: dict[str, float]
    layers: list[int]
    experts_per_layer: dict[int, list[int]]
    ignored_keys: dict[str, str]
    pool_bytes: int
    max_rank: int
    pool_max_rank: int = 0
    dtype: str = "float32"
    peft_version: str | None = None
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


def _fail(file: Path | str, reason: str, key: str | None = None) -> AdapterLoadError:
    where = f"{file}: key {key!r}: " if key is not None else f"{file}: "
    return AdapterLoadError(where + reason)


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------


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


_BRIEF = reprlib.Repr()
_BRIEF.maxstring = _BRIEF.maxother = 80
_BRIEF.maxlevel = 2


def _brief(v: Any) -> str:
    """A short repr of an untrusted JSON value for a message: bounded length, and bounded depth (a plain
    repr of a deeply nested value could itself raise RecursionError)."""
    return _BRIEF.repr(v)


def _json_type(v: Any) -> str:
    """The JSON name of a parsed value's type, for messages."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return f"number ({_brief(v)})"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else type(v).__name__


def _parse_config(file: Path, layout: ExpertParamLayout | None = None) -> _LoraSettings:
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

    r = cfg.get("r", 8)
    if not _is_int(r) or r <= 0:
        raise _fail(file, f"r must be a positive int, got {r!r}", "r")
    alpha = cfg.get("lora_alpha", 8)
    if not _is_number(alpha):
        raise _fail(file, f"lora_alpha must be a finite number, got {alpha!r}", "lora_alpha")
    use_rslora = cfg.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _fail(file, f"use_rslora must be true or false, got {use_rslora!r}", "use_rslora")

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
    _check_scalings(file, r, float(alpha), use_rslora, patterns["rank_pattern"], patterns["alpha_pattern"])

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

    mts = cfg.get("modules_to_save") or []
    if isinstance(mts, str):
        mts = [mts]
    if not isinstance(mts, list) or not all(isinstance(m, str) for m in mts):
        raise _fail(file, f"modules_to_save must be a list of module names, got {mts!r}", "modules_to_save")

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


def _version_tuple(version: str | None) -> tuple[int, ...] | None:
    """``"0.18.1"`` -> (0, 18, 1); ``"0.19.1.dev0@abc"`` -> (0, 19, 1); None when it cannot be read."""
    if not version:
        return None
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version.partition("@")[0])
    if not m:
        return None
    return tuple(int(g or 0) for g in m.groups())


# --------------------------------------------------------------------------------------------------
# Key classification
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


# safetensors dtype names -> torch dtypes the one-read path builds views of (a tensor whose dtype is missing
# here, e.g. on an older torch, is read through safetensors' own reader)
_ST_DTYPES: dict[str, torch.dtype] = {
    name: dt
    for name, dt in (
        ("F64", torch.float64),
        ("F32", torch.float32),
        ("F16", torch.float16),
        ("BF16", torch.bfloat16),
        ("F8_E4M3", getattr(torch, "float8_e4m3fn", None)),
        ("F8_E5M2", getattr(torch, "float8_e5m2", None)),
        ("I64", torch.int64),
        ("I32", torch.int32),
        ("I16", torch.int16),
        ("I8", torch.int8),
        ("U8", torch.uint8),
        ("U16", getattr(torch, "uint16", None)),
        ("U32", getattr(torch, "uint32", None)),
        ("U64", getattr(torch, "uint64", None)),
        ("BOOL", torch.bool),
    )
    if dt is not None
}
# Every dtype the safetensors format defines (safetensors 0.8) -> bits per element. The header of every
# tensor, used or ignored, is checked with it (byte sizes, offsets) before any tensor data is read.
_ST_BITS: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
# The dtypes a LoRA factor may have: real floating-point types that become float32 by a plain cast. Packed
# microscaling formats (F4, F6_*) and the scale-only F8_E8M0 are no LoRA weights torch can cast.
_LORA_DTYPES: tuple[str, ...] = tuple(
    d for d in ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2") if d in _ST_DTYPES
)
_ST_MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header
_ST_MAX_DIM = 2**63 - 1  # torch sizes are int64


class _TensorMeta(NamedTuple):
    """One tensor as the safetensors header describes it (none of its data read).

    A named tuple: a header holds one per tensor (tens of thousands in a per-expert adapter), and a tuple
    of strings and ints is quick to build and soon left alone by the garbage collector.
    """

    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # data_offsets, relative to the end of the header
    end: int

    def dim(self) -> int:
        return len(self.shape)

    def describe_dtype(self) -> str:
        dt = _ST_DTYPES.get(self.dtype)
        return self.dtype if dt is None else f"{str(dt).removeprefix('torch.')} ({self.dtype})"


@dataclass(frozen=True)
class _Header:
    """The checked header of a safetensors file and what it was checked against."""

    size: int  # the file size the data_offsets were checked against
    raw: bytes  # the first 8 + header-length bytes, exactly as read
    tensors: dict[str, _TensorMeta]


def _bad_file(file: Path, reason: str, key: str | None = None) -> AdapterLoadError:
    return _fail(file, f"cannot read the safetensors file (truncated, corrupt or unreadable): {reason}", key)


def _header_length(file: Path, first8: bytes, size: int) -> int:
    """The header length the first 8 bytes give (little-endian u64), refused unless the file holds it."""
    if len(first8) < 8:
        raise _bad_file(file, f"{size} bytes: shorter than the 8-byte header length")
    hlen = int.from_bytes(first8[:8], "little")
    if hlen > _ST_MAX_HEADER:
        raise _bad_file(file, f"header length {hlen} exceeds safetensors' limit of {_ST_MAX_HEADER} bytes")
    if 8 + hlen > size:
        raise _bad_file(file, f"header length {hlen} does not fit the file of {size} bytes")
    return hlen


def _parse_header(file: Path, text: bytes, data_len: int) -> dict[str, _TensorMeta]:
    """The tensors of a safetensors JSON header, checked as safetensors checks them: a dtype of the format,
    a shape, data_offsets within the ``data_len`` data bytes holding exactly shape x dtype bytes, and the
    tensors tiling the data (no gap, no overlap)."""
    try:
        header = json.loads(text.decode("utf-8"))
    except RecursionError as e:  # json's parser recurses once per nesting level
        raise _bad_file(file, "the JSON header is nested too deeply to parse") from e
    except ValueError as e:  # not UTF-8, JSONDecodeError, integers beyond int_max_str_digits
        raise _bad_file(file, f"the header is not valid UTF-8 JSON: {e}") from e
    if not isinstance(header, dict):
        raise _bad_file(file, f"the header is not a JSON object (got a JSON {_json_type(header)})")
    out: dict[str, _TensorMeta] = {}
    for key, info in header.items():
        if key == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise _bad_file(file, f"__metadata__ must be an object of strings, got {_brief(info)}")
            continue
        if not isinstance(info, dict):
            raise _bad_file(file, f"header entry {_brief(info)} is not an object", key)
        dt, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        dt_bits = _ST_BITS.get(dt) if isinstance(dt, str) else None
        if dt_bits is None:
            raise _fail(
                file,
                f"unknown dtype {_brief(dt)} in the safetensors header: LoRA weights must have one of the "
                f"dtypes {', '.join(_LORA_DTYPES)} (the safetensors format defines {', '.join(_ST_BITS)})",
                key,
            )
        if not _is_shape(shape):
            raise _bad_file(file, f"invalid shape {_brief(shape)}: expected a list of non-negative ints", key)
        if type(offs) is not list or len(offs) != 2 or type(offs[0]) is not int or type(offs[1]) is not int:
            raise _bad_file(
                file, f"invalid data_offsets {_brief(offs)}: expected [begin, end] byte offsets", key
            )
        bits = math.prod(shape) * dt_bits
        if bits % 8:
            raise _bad_file(file, f"a {dt} tensor of shape {shape} is not a whole number of bytes", key)
        begin, end = offs
        if not 0 <= begin <= end <= data_len or end - begin != bits // 8:
            raise _bad_file(
                file,
                f"data_offsets {_brief(offs)} do not hold the {bits // 8} bytes of a {dt} tensor of shape "
                f"{_brief(shape)} within the {data_len} data bytes of the file",
                key,
            )
        out[key] = _TensorMeta(dt, tuple(shape), begin, end)
    _check_tiling(file, out, data_len)
    return out


def _is_shape(shape: Any) -> bool:
    """Whether a header value is a shape: a list of ints in torch's size range (bools are no ints)."""
    if type(shape) is not list:
        return False
    for d in shape:
        if type(d) is not int or not 0 <= d <= _ST_MAX_DIM:
            return False
    return True


_BEGIN = operator.attrgetter("begin")
_END = operator.attrgetter("end")


def _check_tiling(file: Path, metas: Mapping[str, _TensorMeta], data_len: int) -> None:
    """Refuses tensors that do not tile the ``data_len`` data bytes exactly (a gap, an overlap, bytes left
    over), naming the first offending tensor in (begin, end, key) order."""
    by_begin = sorted(metas.values(), key=_BEGIN)
    begins = [m.begin for m in by_begin]
    ends = [m.end for m in by_begin]
    # Ordered by begin alone, tensors that tile the data follow each other without a gap; a failure here
    # may still be a valid file (empty tensors sharing a begin), which the exact order below decides.
    if by_begin:
        tiled = begins[0] == 0 and begins[1:] == ends[:-1] and ends[-1] == data_len
    else:
        tiled = data_len == 0
    if tiled:
        return
    pos = 0
    for begin, end, key in sorted((m.begin, m.end, k) for k, m in metas.items()):
        if begin != pos:
            raise _bad_file(file, f"data_offsets overlap or leave a gap at byte {pos}", key)
        pos = end
    if pos != data_len:
        raise _bad_file(file, f"the tensors cover {pos} of the {data_len} data bytes")


def _read_safetensors_header(file: Path) -> _Header:
    """Reads and checks the header of a safetensors file: its first 8 + header-length bytes, no tensor data,
    so that names, dtypes and shapes are validated before a (possibly large) file is read."""
    try:
        with open(file, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                raise _fail(file, "the file is empty (0 bytes)")
            first = fh.read(8)
            hlen = _header_length(file, first, size)
            text = fh.read(hlen)
    except OSError as e:
        raise _fail(file, f"cannot read the safetensors file: {type(e).__name__}: {e}") from e
    if len(text) != hlen:
        raise _bad_file(file, f"the file shrank while its header was read ({len(text)} of {hlen} bytes)")
    return _Header(size, first + text, _parse_header(file, text, size - 8 - hlen))


class _UseSafetensorsReader(Exception):
    """The file is valid for safetensors but uses something the one-read path does not map."""


def _owned_buffer(n: int) -> tuple[Any, torch.Tensor]:
    """``n`` bytes of private anonymous memory as (writable Python buffer, uint8 tensor on it).

    Transparent huge pages are asked for where the OS has them: faulting a 1 GB adapter in 4 KiB at a
    time costs about as much as reading it (on the H200 machine: 0.25 s instead of 0.38 s for the file,
    and 0.007 s instead of 0.03 s to free it). The tensor, and every view of it, keeps the memory alive.
    """
    try:
        import mmap

        raw: Any = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (ImportError, AttributeError, OSError, ValueError):  # pragma: no cover - not Linux / macOS
        raw = bytearray(n)
    else:
        try:
            raw.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):  # pragma: no cover - no transparent huge pages here
            pass
    return raw, torch.frombuffer(raw, dtype=torch.uint8)


# Files past this size are read by several threads at once, each a part (a read of the page cache is
# a copy, and one thread's copy runs at a fraction of the memory's bandwidth).
_PARALLEL_READ_BYTES = 64 << 20
_READ_THREADS = 8


def _read_into(fd: int, view: memoryview, size: int) -> int:
    """Reads bytes [0, size) of ``fd`` into ``view``; returns how many the file gave (fewer if it shrank)."""

    def read_part(start: int, end: int) -> int:
        got = start
        while got < end:
            k = os.preadv(fd, [view[got:end]], got)
            if not k:
                break
            got += k
        return got - start

    parts = min(_READ_THREADS, os.cpu_count() or 1) if size > _PARALLEL_READ_BYTES else 1
    if parts == 1:
        return read_part(0, size)
    bounds = [size * p // parts for p in range(parts + 1)]
    with ThreadPoolExecutor(max_workers=parts, thread_name_prefix="moelora-read") as pool:
        return sum(pool.map(read_part, bounds[:-1], bounds[1:]))


@dataclass
class _FileTensors:
    """Tensors of a safetensors file, and how they lie in memory.

    ``batches`` and ``regions`` each hold every tensor exactly once, as zero-copy views: a batch is
    ``(keys, view)`` with ``view[j]`` the tensor ``keys[j]`` (tensors of one group, dtype and shape lying
    at a constant stride share one ``(n, *shape)`` view, so an op over thousands of them runs as a few
    large ops); a region is ``(keys, 1-D view of all their elements)`` for tensors of one dtype lying back
    to back. A tensor read on its own is a batch and a region by itself.
    """

    tensors: dict[str, torch.Tensor]
    batches: list[tuple[list[str], torch.Tensor]]
    regions: list[tuple[list[str], torch.Tensor]]


def _read_safetensors_once(
    file: Path,
    header: _Header | None = None,
    keys: Iterable[str] | None = None,
    groups: Iterable[Sequence[str]] = (),
) -> _FileTensors:
    """Reads the whole file with one ``read`` into private memory and returns views of it: tensors ``keys``
    (default: all), batched along ``groups`` (see :func:`_file_views`).

    The tensors own their memory (not a map of the file, which could change or shrink under them after
    they were validated). ``header`` is the one :func:`_read_safetensors_header` checked; the bytes read
    must begin with exactly it, as the file may have changed in between. Without it the header is parsed
    and checked (:func:`_parse_header`) from the bytes read.
    """
    size = file.stat().st_size
    if header is not None and size != header.size:
        raise _bad_file(
            file, f"the file changed while it was read ({size} bytes, {header.size} when its header was read)"
        )
    if size < 8:
        raise _bad_file(file, f"{size} bytes: shorter than the 8-byte header length")
    raw, buf = _owned_buffer(size)
    view = memoryview(raw)
    with open(file, "rb", buffering=0) as fh:
        got = _read_into(fh.fileno(), view, size)
    if got != size:
        raise _bad_file(file, f"the file shrank while it was read ({got} of {size} bytes)")
    if header is None:
        hlen = _header_length(file, bytes(view[:8]), size)
        metas = _parse_header(file, bytes(view[8 : 8 + hlen]), size - 8 - hlen)
        base = 8 + hlen
    else:
        if view[: len(header.raw)] != header.raw:
            raise _bad_file(file, "the file changed while it was read (its header is not the one checked)")
        metas, base = header.tensors, len(header.raw)
    return _file_views(buf, base, metas, list(metas) if keys is None else list(keys), groups)


def _file_views(
    buf: torch.Tensor,
    base: int,
    metas: Mapping[str, _TensorMeta],
    keys: Sequence[str],
    groups: Iterable[Sequence[str]],
) -> _FileTensors:
    """The tensors ``keys`` as views of ``buf`` (the file's bytes, tensor data from byte ``base`` on).

    Each of ``groups`` (disjoint subsets of ``keys``, e.g. one layer's experts' gate lora_A) is cut into
    runs of one dtype and 2-D shape at a constant stride, and each run's tensors come from one strided
    view: a tensor per run element in one call, not a few calls per tensor. A tensor not aligned for its
    dtype is an aligned copy; a dtype without a torch view here raises :class:`_UseSafetensorsReader`.
    """
    typed: dict[torch.dtype, torch.Tensor] = {}

    def as_dtype(dtype: torch.dtype) -> torch.Tensor:
        """The whole buffer as ``dtype`` elements (so storage offsets count in them)."""
        if dtype not in typed:
            typed[dtype] = buf[: buf.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
        return typed[dtype]

    out: dict[str, torch.Tensor] = {}
    batches: list[tuple[list[str], torch.Tensor]] = []
    # with the buffer aligned for every dtype, a tensor is aligned exactly when its offset in it is
    for group in groups if buf.data_ptr() % 8 == 0 else ():
        group_metas = [metas[key] for key in group]
        layouts: dict[tuple[str, tuple[int, ...]], list[tuple[int, str]]] = {}
        if len({(m.dtype, m.shape) for m in group_metas}) == 1:  # the usual case
            first = group_metas[0]
            layouts[(first.dtype, first.shape)] = list(zip(map(_BEGIN, group_metas), group, strict=True))
        else:
            for key, m in zip(group, group_metas, strict=True):
                layouts.setdefault((m.dtype, m.shape), []).append((m.begin, key))
        for (dt_name, shape), spans in layouts.items():
            dtype = _ST_DTYPES.get(dt_name)
            if dtype is None or len(shape) != 2 or 0 in shape:
                continue  # tensor by tensor, below
            (rows, cols), item = shape, dtype.itemsize
            spans.sort()
            for run, start, step in _constant_stride_runs(spans, rows * cols * item):
                if (base + start) % item or step % item:
                    continue  # not all aligned: tensor by tensor, below
                view = as_dtype(dtype).as_strided(
                    (len(run), rows, cols), (step // item, cols, 1), (base + start) // item
                )
                out.update(zip(run, view.unbind(0), strict=True))
                batches.append((run, view))
    copied: set[str] = set()
    for key in keys if len(out) < len(keys) else ():
        if key in out:
            continue
        m = metas[key]
        dtype = _ST_DTYPES.get(m.dtype)
        if dtype is None:
            raise _UseSafetensorsReader(m.dtype)
        chunk = buf[base + m.begin : base + m.end]
        if chunk.data_ptr() % dtype.itemsize:
            chunk = chunk.clone()  # not aligned for its dtype: an aligned copy
            copied.add(key)
        t = out[key] = chunk.view(dtype).view(m.shape)
        batches.append(([key], t.unsqueeze(0)))
    return _FileTensors(out, batches, _file_regions(out, metas, keys, copied))


def _constant_stride_runs(
    spans: Sequence[tuple[int, str]], nbytes: int
) -> list[tuple[list[str], int, int]]:
    """``spans`` (begin, key) of ``nbytes`` tensors, sorted, cut into runs at a constant stride: ``(keys,
    first begin, stride)``, the stride of a lone tensor being ``nbytes``."""
    begins = [b for b, _ in spans]
    step = begins[1] - begins[0] if len(begins) > 1 else nbytes
    if step >= nbytes and begins == list(range(begins[0], begins[0] + step * len(begins), step)):
        return [([k for _, k in spans], begins[0], step)]  # the usual case: all of them
    runs: list[tuple[list[str], int, int]] = []
    j = 0
    while j < len(spans):
        k, step = j + 1, 0
        while k < len(spans):
            d = begins[k] - begins[k - 1]
            if (step and d != step) or (not step and d < nbytes):
                break
            step, k = d, k + 1
        runs.append(([key for _, key in spans[j:k]], begins[j], step or nbytes))
        j = k
    return runs


def _file_regions(
    tensors: Mapping[str, torch.Tensor],
    metas: Mapping[str, _TensorMeta],
    keys: Sequence[str],
    copied: set[str],
) -> list[tuple[list[str], torch.Tensor]]:
    """The regions (:class:`_FileTensors`) of ``tensors``, views of one buffer at their ``metas`` offsets
    but for those ``copied``."""
    key_metas = [metas[k] for k in keys]
    order = sorted(range(len(keys)), key=list(map(_BEGIN, key_metas)).__getitem__)
    ordered = [keys[i] for i in order]
    spans = [key_metas[i] for i in order]
    begins = list(map(_BEGIN, spans))
    ends = list(map(_END, spans))
    if (
        spans
        and not copied
        and len({m.dtype for m in spans}) == 1
        and begins[1:] == ends[:-1]
        and all(e > b for b, e in zip(begins, ends, strict=True))
    ):  # the usual case: one dtype, back to back
        return [_region(tensors, metas, ordered)]
    regions: list[tuple[list[str], torch.Tensor]] = []
    run: list[str] = []
    for key, m in zip(ordered, spans, strict=True):
        if key in copied or m.end == m.begin:
            regions.append(([key], tensors[key].reshape(-1)))
            continue
        if run and m.begin == metas[run[-1]].end and m.dtype == metas[run[-1]].dtype:
            run.append(key)
            continue
        if run:
            regions.append(_region(tensors, metas, run))
        run = [key]
    if run:
        regions.append(_region(tensors, metas, run))
    return regions


def _region(
    tensors: Mapping[str, torch.Tensor], metas: Mapping[str, _TensorMeta], run: list[str]
) -> tuple[list[str], torch.Tensor]:
    """``run`` (keys of tensors lying back to back, in order) with a 1-D view of all their elements."""
    first = tensors[run[0]]
    n = (metas[run[-1]].end - metas[run[0]].begin) // first.element_size()
    return run, first.as_strided((n,), (1,), first.storage_offset())


def _read_safetensors(
    file: Path, header: _Header, keys: Sequence[str], groups: Iterable[Sequence[str]] = ()
) -> _FileTensors:
    """Tensors ``keys`` of a safetensors file whose ``header`` was checked, in memory the tensors own;
    ``groups`` (subsets of ``keys``) are batched where they lie at a constant stride (:func:`_file_views`)."""
    try:
        from safetensors import safe_open
    except ImportError as e:  # pragma: no cover - safetensors is a dependency
        raise _fail(file, "the safetensors package is needed to read adapters") from e
    try:
        # safetensors validates the file too (whatever it refuses is refused here too) ...
        with safe_open(str(file), framework="pt", device="cpu") as f:
            if sorted(f.keys()) != sorted(header.tensors):
                raise _bad_file(
                    file, "the file changed while it was read (its tensors are not the ones checked)"
                )
            if sys.byteorder == "little":
                try:
                    # ... and the data is read once, into private memory (views, no per-tensor copy)
                    return _read_safetensors_once(file, header, keys, groups)
                except _UseSafetensorsReader:
                    pass
            # per tensor, through safetensors (its tensors map the file: copy them into owned memory)
            out: dict[str, torch.Tensor] = {}
            for k in keys:
                m, sl = header.tensors[k], f.get_slice(k)
                if sl.get_dtype() != m.dtype or tuple(sl.get_shape()) != m.shape:
                    raise _bad_file(file, "the file changed while it was read (another dtype or shape)", k)
                out[k] = f.get_tensor(k).clone()
            alone = [([k], t) for k, t in out.items()]
            return _FileTensors(
                out, [(k, t.unsqueeze(0)) for k, t in alone], [(k, t.reshape(-1)) for k, t in alone]
            )
    except AdapterLoadError:
        raise
    except Exception as e:  # SafetensorError, OSError, ...: truncated, unreadable, not a safetensors file
        raise _fail(
            file,
            f"cannot read the safetensors file (truncated, corrupt or unreadable): {type(e).__name__}: {e}",
        ) from e


# dtypes torch.aminmax reduces directly (others are widened to float32 first, as a float32 cast is exact)
_STAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _batches(
    ts: Sequence[torch.Tensor], kinds: Sequence[Any] | None = None
) -> list[tuple[list[int], torch.Tensor]]:
    """Zero-copy batches of ``ts``: ``(indices, view)`` pairs where ``view[j]`` is ``ts[indices[j]]``.

    Tensors of one kind (``kinds[i]``, e.g. the gate lora_A of one layer's experts), dtype and shape lying
    at a constant stride in one storage (as the per-expert slices of a fused F2 tensor do) share one
    ``(n, *shape)`` strided view, so an op over thousands of small tensors runs as a few large ops; any
    other tensor is a batch of its own.
    """
    out: list[tuple[list[int], torch.Tensor]] = []
    same: dict[tuple[Any, torch.dtype, tuple[int, ...], int], list[int]] = {}
    for i, t in enumerate(ts):
        if t.numel() == 0 or not t.is_contiguous():
            out.append(([i], t.unsqueeze(0)))
        else:
            kind = kinds[i] if kinds is not None else None
            same.setdefault((kind, t.dtype, tuple(t.shape), t.untyped_storage().data_ptr()), []).append(i)
    for (_, dtype, shape, _), idx in same.items():
        idx.sort(key=lambda i: ts[i].data_ptr())
        ptrs = [ts[i].data_ptr() for i in idx]
        size = ts[idx[0]].numel() * dtype.itemsize
        j = 0
        while j < len(idx):
            k, step = j + 1, 0
            while k < len(idx):
                d = ptrs[k] - ptrs[k - 1]
                if (step and d != step) or (not step and (d < size or d % dtype.itemsize)):
                    break
                step, k = d, k + 1
            t0 = ts[idx[j]]
            stride = (step or size) // dtype.itemsize
            view = t0.as_strided((k - j, *shape), (stride, *t0.stride()), t0.storage_offset())
            out.append((idx[j:k], view))
            j = k
    return out


def _aminmax_each(ts: Sequence[torch.Tensor]) -> list[tuple[float, float]]:
    """Exact (min, max) of each non-empty tensor (NaN when it holds a NaN: ``torch.aminmax`` propagates
    NaN), gathered with one host transfer per dtype."""
    lows: dict[torch.dtype, list[torch.Tensor]] = {}
    highs: dict[torch.dtype, list[torch.Tensor]] = {}
    where: list[tuple[torch.dtype, int]] = []
    for t in ts:
        lo, hi = torch.aminmax(t)
        where.append((t.dtype, len(lows.setdefault(t.dtype, []))))
        lows[t.dtype].append(lo)
        highs.setdefault(t.dtype, []).append(hi)
    got = {
        dt: (torch.stack(lows[dt]).double().tolist(), torch.stack(highs[dt]).double().tolist()) for dt in lows
    }
    return [(got[dt][0][j], got[dt][1][j]) for dt, j in where]


def _value_bounds(
    regions: Sequence[tuple[Sequence[str], torch.Tensor]], tensors: Mapping[str, torch.Tensor]
) -> dict[str, tuple[float, float]]:
    """key -> (lo, hi) for each non-empty floating-point tensor of ``regions`` (:class:`_FileTensors`),
    from one reduction per region.

    ``lo`` or ``hi`` is NaN exactly when the tensor holds a NaN; otherwise one is infinite exactly when it
    holds an infinity; and always ``lo <= min`` and ``max <= hi``: the range of its region, or its own
    range (from ``tensors``) where its region holds a non-finite value.
    """
    live = [
        (keys, view if view.dtype in _STAT_DTYPES else view.float())
        for keys, view in regions
        if view.is_floating_point() and view.numel()
    ]
    out: dict[str, tuple[float, float]] = {}
    recheck: list[str] = []
    for (keys, _), value_range in zip(live, _aminmax_each([v for _, v in live]), strict=True):
        if len(keys) == 1 or (math.isfinite(value_range[0]) and math.isfinite(value_range[1])):
            out.update(dict.fromkeys(keys, value_range))
        else:
            recheck.extend(keys)  # which tensors of the region: each one's own range
    own = [tensors[k] if tensors[k].dtype in _STAT_DTYPES else tensors[k].float() for k in recheck]
    out.update(zip(recheck, _aminmax_each(own), strict=True))
    return out


def _check_factor_meta(file: Path, key: str, m: _TensorMeta) -> None:
    """dtype and 2-D of one LoRA factor, from the header (before any tensor data is read)."""
    if m.dtype not in _LORA_DTYPES:
        if m.dtype.startswith(("I", "U", "BOOL")):
            why = "not a floating-point type"
        elif m.dtype.startswith("C"):
            why = "a complex type"
        else:
            why = "a packed or scale-only format that does not become float32 by a plain cast"
        raise _fail(
            file,
            f"LoRA weights must be a floating-point tensor of one of the dtypes {', '.join(_LORA_DTYPES)}; "
            f"got dtype {m.describe_dtype()}: {why}",
            key,
        )
    if m.dim() != 2:
        raise _fail(file, f"LoRA weights must be 2-D, got shape {m.shape}", key)


def _check_finite(file: Path, key: str, value_range: tuple[float, float] | None) -> None:
    """Finiteness of one file tensor; ``value_range`` from :func:`_value_bounds` (None: empty)."""
    if value_range is None:
        return
    lo, hi = value_range
    if math.isnan(lo) or math.isnan(hi):
        raise _fail(file, "tensor holds non-finite values (NaN)", key)
    if math.isinf(lo) or math.isinf(hi):
        raise _fail(file, "tensor holds non-finite values (Inf)", key)


def _overflows(abs_max: list[float], dtype: torch.dtype) -> list[bool]:
    """Whether a finite value of magnitude ``abs_max[i]``, cast to float32 and then to ``dtype``, is no
    longer finite. Casts round monotonically, so this is whether any element of a tensor with that largest
    magnitude overflows (exactly what casting the whole tensor and testing it would find)."""
    if not abs_max:
        return []
    x = torch.tensor(abs_max, dtype=torch.float64).to(torch.float32).to(dtype)
    return (~torch.isfinite(x)).tolist()


def _compact(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drops rank components that are exactly zero (an all-zero B column or A row): they add exactly 0."""
    keep = (b != 0).any(dim=0) & (a != 0).any(dim=1)
    if bool(keep.all()):
        return a, b
    return a[keep], b[:, keep]


def _maybe_zero_components(
    a_batches: Sequence[tuple[Sequence[Any], torch.Tensor]],
    b_batches: Sequence[tuple[Sequence[Any], torch.Tensor]],
) -> set[Any]:
    """The labels whose A may have an all-zero row (``a_batches``: ``(labels, (n, r, in) view)``) or whose
    B may have an all-zero column (``b_batches``: ``(labels, (n, out, r) view)``); :func:`_compact`
    decides exactly.

    A component whose first element is non-zero is live, so only the first elements of all components
    are read; where one is zero, its module's components are summed (an all-zero row or column sums to
    exactly 0, so a non-zero sum, an infinite or NaN one too, proves the component live).
    """
    maybe: set[Any] = set()
    for batches, dim in ((a_batches, 2), (b_batches, 1)):  # the dim A rows / B columns run along
        if not batches:
            continue
        # per module: whether a component starts with a zero (every module, where components are empty)
        heads = [
            (view.select(dim, 0) == 0).any(dim=1) if view.shape[dim] else torch.ones(len(view), dtype=bool)
            for _, view in batches
        ]
        suspect = torch.cat(heads).tolist()
        pos = 0
        for labels, view in batches:
            picked = [j for j, head_is_zero in enumerate(suspect[pos : pos + len(labels)]) if head_is_zero]
            pos += len(labels)
            if picked:
                zero_sum = (view[picked].sum(dim=dim) == 0).any(dim=1).tolist()
                maybe.update(labels[j] for j, z in zip(picked, zero_sum, strict=True) if z)
    return maybe


def _live_experts_and_rank(lora: ReferenceLoRA) -> tuple[set[int], int]:
    """The experts of one layer's adapter with a module, and its largest module rank: the arena blocks
    the pool gives that layer (one of that rank per expert)."""
    mods = [(e, proj) for p in ("gate", "up", "down") for e, proj in getattr(lora, p).items()
            if proj.a.shape[0] > 0]
    return {e for e, _ in mods}, max((proj.a.shape[0] for _, proj in mods), default=0)


def arena_bytes_of(blocks: int, rank: int, hidden: int, inter: int, dtype: torch.dtype) -> int:
    """Arena bytes of ``blocks`` (layer, expert) blocks of ``rank`` rows: each row holds gate and up A
    (2H), gate and up B (2I), down A (I) and down B (H)."""
    return blocks * rank * 3 * (hidden + inter) * torch.empty((), dtype=dtype).element_size()


def _check_positive_int(name: str, v: Any) -> int:
    if not _is_int(v) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def check_adapter_path(path: Any) -> Path:
    """``path`` as a :class:`~pathlib.Path`, refusing what cannot name an adapter directory.

    Call it before resolving a path: ``Path("")`` is the current directory, so an empty (or
    whitespace-only) path would silently load whatever adapter lies there.

    Raises:
        TypeError: ``path`` is not a ``str`` or an ``os.PathLike`` of one (``None``, bytes, a number, ...).
        AdapterLoadError: ``path`` is empty, only whitespace, or holds a NUL character.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            "adapter path must be a str or os.PathLike (a directory), got "
            f"{type(path).__name__} {_brief(path)}"
        )
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"adapter path must be a str or os.PathLike of a str, got {type(text).__name__}")
    if not text.strip():
        raise AdapterLoadError(
            f"adapter path is empty ({text!r}): an empty path would read the current directory; "
            f"pass the adapter directory (holding {CONFIG_NAME} and {WEIGHTS_NAME})"
        )
    if "\0" in text:
        raise AdapterLoadError(f"adapter path {text!r} holds a NUL character")
    return Path(text)


def _check_files(adir: Path, cfg_file: Path, w_file: Path) -> None:
    """The adapter directory holds a regular config and safetensors file (a clear message for each miss)."""
    if not adir.exists():
        raise _fail(adir, "adapter directory does not exist")
    if not adir.is_dir():
        raise _fail(
            adir, f"not a directory: an adapter is a directory holding {CONFIG_NAME} and {WEIGHTS_NAME}"
        )
    if not cfg_file.exists():
        raise _fail(cfg_file, "missing: a PEFT adapter directory must hold adapter_config.json")
    if not w_file.exists():
        if (adir / BIN_NAME).exists():
            raise _fail(
                adir / BIN_NAME,
                f"only a pickled PyTorch {BIN_NAME} was found; it is not read (loading a pickle can run "
                "code). "
                'Convert it to safetensors, e.g. python -c "import torch; from safetensors.torch import '
                f"save_file; save_file(torch.load('{BIN_NAME}', weights_only=True), '{WEIGHTS_NAME}')\", or "
                "re-save it with PEFT's save_pretrained(..., safe_serialization=True)",
            )
        raise _fail(w_file, "missing: a PEFT adapter directory must hold adapter_model.safetensors")
    if not cfg_file.is_file():
        raise _fail(cfg_file, "not a regular file")
    if not w_file.is_file():
        raise _fail(w_file, "not a regular file")


def read_peft_adapter(
    path: str | os.PathLike[str],
    *,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    layer_ids: Iterable[int],
    max_rank: int,
    dtype: torch.dtype = torch.float32,
    pool_dtype: torch.dtype | None = None,
    layout: ExpertParamLayout | None = None,
) -> tuple[dict[int, ReferenceLoRA], AdapterLoadReport]:
    """Reads and validates a PEFT LoRA adapter of an MoE model; returns per-layer expert LoRAs and a report.

    Args:
        path: the adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).
        num_experts: ``E``, routed experts per MoE layer of the base model.
        hidden_size: ``H``.
        intermediate_size: ``I``, the per-expert FFN width.
        layer_ids: the model's MoE layer indices; expert weights of any other layer are refused.
        max_rank: the largest (effective) rank a module may have.
        dtype: dtype of the returned tensors (arithmetic is done in float32 first).
        pool_dtype: the dtype the pool stores (default: ``dtype``), for ``pool_bytes`` and the overflow
            check. A pool that rescales B's per module (rank/alpha patterns) rounds once if it is given
            float32 tensors: read with ``dtype=torch.float32, pool_dtype=pool.dtype``.
        layout: how the model's fused expert parameters map onto gate, up and down
            (:class:`ExpertParamLayout`; default: ``[gate; up]`` rows of ``num_experts`` experts).

    Returns:
        ``({layer_id: ReferenceLoRA}, AdapterLoadReport)``: CPU tensors, ``a (r, in)``, ``b (out, r)``, the
        module's own scaling, ready for :meth:`MoELoRAMemoryPool.add_adapter_weights`. Exactly-zero modules
        are left out; every layer with expert weights in the file has an entry. The tensors own their
        memory (never a map of the file); per-expert (F1) factors already in ``dtype`` are views of the
        one buffer the file was read into, which lives as long as any of them.

    Raises:
        AdapterLoadError: for anything that cannot be served exactly; the message names the file, the key
            (where there is one) and the reason. See the module docstring for the formats.
        ValueError: for invalid arguments (not adapter problems).
        TypeError: ``path`` is not a ``str`` / ``os.PathLike`` (see :func:`check_adapter_path`).
    """
    return _read(
        path,
        num_experts=num_experts,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        layer_ids=layer_ids,
        max_rank=max_rank,
        dtype=dtype if pool_dtype is None else pool_dtype,
        out_dtype=dtype,
        layout=layout if layout is not None else ExpertParamLayout(),
    )


# (layer, expert, proj), a, b (float32), scaling, module name, file key of this A, of this B, and whether a
# rank component may be exactly zero (:func:`_maybe_zero_components`)
_ModuleRow = tuple[tuple[int, int, str], torch.Tensor, torch.Tensor, float, str, str, str, bool]


def _read(
    path: str | os.PathLike[str],
    *,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    layer_ids: Iterable[int],
    max_rank: int,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    layout: ExpertParamLayout,
) -> tuple[dict[int, ReferenceLoRA], AdapterLoadReport]:
    """:func:`read_peft_adapter`, checking overflow in ``dtype`` but returning ``out_dtype`` tensors."""
    n_exp = _check_positive_int("num_experts", num_experts)
    if layout.gate_up_experts is not None and (not _is_int(layout.gate_up_experts)
                                               or layout.gate_up_experts < n_exp):
        raise ValueError(f"layout.gate_up_experts must be an int >= num_experts={n_exp}, got "
                         f"{layout.gate_up_experts!r}")
    # experts each fused parameter holds (LoRA rows of experts past n_exp are dropped)
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
    valid_layers = set(lids)

    # ---- files -------------------------------------------------------------------------------------
    adir = check_adapter_path(path)
    cfg_file = adir / CONFIG_NAME
    w_file = adir / WEIGHTS_NAME
    try:
        _check_files(adir, cfg_file, w_file)
    except OSError as e:  # e.g. a name too long, a directory without search permission
        raise _fail(adir, f"cannot access the adapter directory: {type(e).__name__}: {e}") from e

    settings = _parse_config(cfg_file, layout)
    # Only the header is read here: every name, dtype and shape is checked before any tensor data is.
    header = _read_safetensors_header(w_file)
    metas = header.tensors
    if not metas:
        raise _fail(w_file, "the file holds no tensors: no expert LoRA weights at all")

    # ---- classify keys (refusing mixed layouts, no expert weights, lone factors, bad factor dtypes) ----
    classified = _classify_keys(metas, settings, w_file, layout.expert_set)
    ignored, f1, f1_module = classified.ignored, classified.f1, classified.f1_module
    f2, f2_layer = classified.f2, classified.f2_layer

    # ---- layers, experts ----------------------------------------------------------------------------
    f1_fits = {lid for lid, _, _ in f1} <= valid_layers and max((e for _, e, _ in f1), default=-1) < n_exp
    for (lid, e, _), p in f1.items() if not f1_fits else ():  # to name the first offender
        if lid not in valid_layers:
            raise _fail(
                w_file, f"layer {lid} is not an MoE layer of this model (layer_ids {sorted(lids)})", p.a
            )
        if e >= n_exp:
            raise _fail(w_file, f"expert index {e} out of range: the model has num_experts={n_exp}", p.a)
    for (container, _), p in f2.items():
        lid = f2_layer[container]
        if lid not in valid_layers:
            raise _fail(
                w_file, f"layer {lid} is not an MoE layer of this model (layer_ids {sorted(lids)})", p.a
            )
    factor_keys = classified.factor_keys

    # ---- shapes, ranks and scalings, from the header alone ------------------------------------------
    ranks: dict[str, int] = {}
    scalings: dict[str, float] = {}
    notes: list[str] = []
    dims = {"gate": (hid, inter), "up": (hid, inter), "down": (inter, hid)}  # (in, out)
    dim_names = {"gate": ("H", "I"), "up": ("H", "I"), "down": ("I", "H")}
    # F2: (container, depth) -> (param, swapped, r, s)
    f2_plan: dict[tuple[str, int], tuple[str, bool, int, float]] = {}
    # F1: (layer, proj) -> (its experts' lora_A keys, lora_B keys), read as a few strided batches
    f1_groups: dict[tuple[int, str], tuple[list[str], list[str]]] = {}

    if f1:
        fmt = FORMAT_F1
        # Without rank/alpha patterns every module has the config's rank and alpha, so one expected
        # (A, B) shape per projection decides all the checks below; any other case goes module by module.
        expected = {proj: ((settings.r, n_in), (n_out, settings.r)) for proj, (n_in, n_out) in dims.items()}
        uniform = not settings.rank_pattern and not settings.alpha_pattern and all(
            (metas[p.a].shape, metas[p.b].shape) == expected[proj] for (_, _, proj), p in f1.items()
        )
        if uniform:
            f1_mods = [f1_module[slot] for slot in f1]
            ranks = dict.fromkeys(f1_mods, settings.r)
            scalings = dict.fromkeys(f1_mods, settings.scaling(settings.r, settings.alpha))
        for (lid, e, proj), p in f1.items() if not uniform else ():
            assert p.a is not None and p.b is not None
            mod = f1_module[(lid, e, proj)]
            a_shape, b_shape = metas[p.a].shape, metas[p.b].shape
            in_f, out_f = dims[proj]
            in_n, out_n = dim_names[proj]
            r = a_shape[0]
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
            alpha = _f1_module_alpha(w_file, p, a_shape, b_shape, settings, mod)
            ranks[mod], scalings[mod] = r, settings.scaling(r, alpha)
        for (lid, _, proj), p in f1.items():
            assert p.a is not None and p.b is not None
            group = f1_groups.get((lid, proj))
            if group is None:
                group = f1_groups[(lid, proj)] = ([], [])
            group[0].append(p.a)
            group[1].append(p.b)
    else:
        fmt, f2_params = _resolve_f2(f2, f2_layer, metas, settings, w_file, param_experts, hid, inter, notes,
                                     layout)
        for (container, depth), (param, swapped) in f2_params.items():
            p = f2[(container, depth)]
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

    # ---- tensor data: read only now, for a file whose header and shapes all passed -------------------
    f1_batched = [keys for a_and_b in f1_groups.values() for keys in a_and_b]
    data = _read_safetensors(w_file, header, factor_keys, f1_batched)
    tensors = data.tensors
    bounds = _value_bounds(data.regions, tensors)  # one reduction per region
    value_ranges = list(set(bounds.values()))  # a few: most tensors share their region's
    if not all(math.isfinite(lo) and math.isfinite(hi) for lo, hi in value_ranges):
        for k in factor_keys:
            _check_finite(w_file, k, bounds.get(k))
    # file tensors that may overflow the checked dtype (their modules are cast to find out exactly; a
    # module is a part of its file tensor, so no other module can)
    overflows = dict(
        zip(value_ranges, _overflows([max(-lo, hi) for lo, hi in value_ranges], dtype), strict=True)
    )
    if any(overflows.values()):
        over_keys = {k: overflows[value_range] for k, value_range in bounds.items()}
    else:
        over_keys = dict.fromkeys(bounds, False)

    # ---- per-module (a, b, scaling) in float32 ---------------------------------------------------------
    module_rows: Iterable[_ModuleRow]  # in (layer, expert, projection) order
    if f1:
        # to float32 (``.float()``), whole batches of file tensors at a time: one layer's experts' lora_A
        # (lora_B) of one projection lie at a constant stride in the file
        f32, f32_batches = tensors, data.batches
        if any(view.dtype != torch.float32 for _, view in data.batches):
            f32, f32_batches = dict(tensors), []
            for keys, view in data.batches:
                if view.dtype != torch.float32:
                    view = view.float()
                    f32.update(zip(keys, view.unbind(0), strict=True))
                f32_batches.append((keys, view))
        a_keys = {p.a for p in f1.values()}
        maybe = _maybe_zero_components(
            [batch for batch in f32_batches if batch[0][0] in a_keys],
            [batch for batch in f32_batches if batch[0][0] not in a_keys],
        )
        # generated as consumed: no per-module objects beyond the result's
        module_rows = (
            (slot, f32[p.a], f32[p.b], scalings[mod], mod, p.a, p.b, p.a in maybe or p.b in maybe)
            for slot, p in f1.items()
            for mod in (f1_module[slot],)
        )
    else:
        # (layer, expert, proj) -> (a, b, scaling, module name, file key of this A, file key of this B)
        modules: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor, float, str, str, str]] = {}
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
        ordered = sorted(modules.items(), key=lambda kv: (kv[0][0], kv[0][1], _PROJ_RANK[kv[0][2]]))
        kinds = [(slot[0], slot[2]) for slot, _ in ordered]
        maybe = _maybe_zero_components(
            _batches([m[0] for _, m in ordered], kinds), _batches([m[1] for _, m in ordered], kinds)
        )
        module_rows = ((slot, *m, i in maybe) for i, (slot, m) in enumerate(ordered))

    # ---- effective ranks, max_rank, cast ------------------------------------------------------------
    layers: dict[int, ReferenceLoRA] = {}
    experts_per_layer: dict[int, set[int]] = {}
    eff_max = 0
    dropped_components = 0
    zero_modules = 0
    for (lid, e, proj), a, b, s, mod, key_a, key_b, may_drop in module_rows:
        layer = layers.get(lid)
        if layer is None:
            layer = layers[lid] = ReferenceLoRA()
            experts_per_layer[lid] = set()
        experts_per_layer[lid].add(e)
        if may_drop:
            ac, bc = _compact(a, b)
            dropped_components += a.shape[0] - ac.shape[0]
        else:
            ac, bc = a, b
        r_eff = int(ac.shape[0])
        if r_eff > max_r:
            extra = f" (rank {a.shape[0]} in the file)" if r_eff != a.shape[0] else ""
            raise _fail(w_file, f"module {mod}: rank {r_eff}{extra} exceeds max_rank {max_r}", key_a)
        if r_eff == 0:
            zero_modules += 1
            continue
        eff_max = max(eff_max, r_eff)
        if over_keys.get(key_a, True) or over_keys.get(key_b, True):
            for what, t, key in (("A", ac.to(dtype), key_a), ("B", bc.to(dtype), key_b)):
                if not bool(torch.isfinite(t).all()):
                    dname = str(dtype).removeprefix("torch.")
                    raise _fail(w_file, f"module {mod}: LoRA {what} overflows {dname}", key)
        # F1 factors are whole file tensors, in memory of their own (``_read_safetensors``): no copy
        # unless the dtype changes. F2 factors are slices of fused tensors (gate and up share one A).
        # (a tensor already in out_dtype skips ``to``, which would return it, at a cost per call)
        a_out = (ac if ac.dtype == out_dtype else ac.to(out_dtype)).contiguous()
        b_out = (bc if bc.dtype == out_dtype else bc.to(out_dtype)).contiguous()
        if fmt != FORMAT_F1:
            a_out, b_out = a_out.clone(), b_out.clone()
        getattr(layer, proj)[e] = LoRAProjection(a_out, b_out, float(s))

    if dropped_components:
        notes.append(
            f"{dropped_components} exactly-zero rank components dropped ({zero_modules} modules all "
            f"zero); largest effective rank {eff_max}"
        )
    report = AdapterLoadReport(
        path=str(adir),
        format=fmt,
        ranks=ranks,
        scalings=scalings,
        layers=sorted(layers),
        experts_per_layer={lid: sorted(es) for lid, es in sorted(experts_per_layer.items())},
        ignored_keys=ignored,
        pool_bytes=sum(arena_bytes_of(len(experts), rank, hid, inter, dtype)
                       for experts, rank in map(_live_experts_and_rank, layers.values())),
        max_rank=eff_max,
        pool_max_rank=max_r,
        dtype=str(out_dtype).removeprefix("torch."),
        peft_version=settings.peft_version,
        notes=notes,
    )
    return layers, report


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
    # in/out features of each fused parameter (E, out, in)
    io = {"gate_up_proj": (hid, 2 * inter), "up_proj": (hid, inter), "down_proj": (inter, hid)}
    io_names = {"gate_up_proj": ("H", "2I"), "up_proj": ("H", "I"), "down_proj": ("I", "H")}
    # the parameters this model's experts hold: up_proj instead of gate_up_proj when ungated
    model_params = ("up_proj", "down_proj") if layout.up_only else ("gate_up_proj", "down_proj")

    def orientations(param: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> set[bool]:
        """The layouts (swapped or not) in which lora_A / lora_B of these shapes adapt ``param``."""
        in_f, out_f = io[param]
        cand = set()
        if a_shape[1] == in_f and b_shape[0] == out_f:
            cand.add(False)
        if a_shape[1] == out_f and b_shape[0] == in_f:
            cand.add(True)
        return cand

    assignment: dict[tuple[str, int], str] = {}
    candidates: dict[tuple[str, int], set[bool]] = {}
    for (container, depth), p in sorted(f2.items()):
        assert p.a is not None and p.b is not None
        leaf = container.rpartition(".")[2]
        if leaf in _JETMOE_PARAMS:  # one parameter, ``weight``, per container
            targeted = [_JETMOE_PARAMS[leaf]] if any(
                f"{container}.weight" == t or f"{container}.weight".endswith("." + t)
                for t in settings.target_parameters) else []
        else:
            targeted = [
                prm
                for prm in model_params
                if any(
                    f"{container}.{prm}" == t or f"{container}.{prm}".endswith("." + t)
                    for t in settings.target_parameters
                )
            ]
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
        # PEFT nests in registration order, first registered (gate_up_proj) innermost = deepest.
        param = targeted[len(targeted) - 1 - depth]
        assignment[(container, depth)] = param
        a_shape, b_shape = metas[p.a].shape, metas[p.b].shape
        in_f, out_f = io[param]
        in_n, out_n = io_names[param]
        if a_shape[0] != b_shape[1]:
            raise _fail(
                w_file,
                f"rank mismatch: lora_A {a_shape} and lora_B {b_shape} of {param} "
                "must share the num_experts x rank axis",
                p.b,
            )
        n_exp = param_experts[param]
        if a_shape[0] % n_exp:
            raise _fail(
                w_file,
                f"lora_A of {param} has {a_shape[0]} rows, not a multiple of num_experts={n_exp}: "
                "the adapter was made for a model with another number of experts",
                p.a,
            )
        cand = orientations(param, a_shape, b_shape)
        other = next(prm for prm in model_params if prm != param)
        if not cand and orientations(other, a_shape, b_shape):
            # The shapes of gate_up_proj ({H, 2I}) and down_proj ({I, H}) never coincide, so tensors that
            # fit the other parameter mean the config's target_parameters, not the model sizes, is wrong.
            o_in, o_out = io[other]
            o_in_n, o_out_n = io_names[other]
            if len(targeted) == 1:
                why = f"it targets only {param} on this experts module"
            else:
                place = "outer" if depth == 0 else "inner"
                why = (
                    f"it targets {targeted} here, and PEFT nests the {param} LoRA as the {place} wrapper "
                    f"(...experts{'.base_layer' * depth}.lora_A/B)"
                )
            present = sum(1 for c, _ in f2 if c == container)
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
        candidates[(container, depth)] = cand

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
    fmt = FORMAT_F2_SWAPPED if swapped else FORMAT_F2
    return fmt, {k: (prm, swapped) for k, prm in assignment.items()}


# --------------------------------------------------------------------------------------------------
# Describing an adapter on its own (no model sizes)
# --------------------------------------------------------------------------------------------------


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


@dataclass
class _Classified:
    """The expert LoRA keys of a file, sorted as :func:`_read` sorts them, and the keys it ignores."""

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
    weights, lone factors, factor dtypes): the checks that need no model sizes, shared by :func:`_read`
    and :func:`describe_peft_adapter`. With ``expert_set`` (``ExpertParamLayout.expert_set``) the expert
    LoRA of a layer's other expert sets is ignored."""
    ignored: dict[str, str] = {}
    f1: dict[tuple[int, int, str], _Pair] = {}
    f1_module: dict[tuple[int, int, str], str] = {}
    f2: dict[tuple[str, int], _Pair] = {}
    f2_layer: dict[str, int] = {}
    # F1 module -> its (layer, expert, projection): the second factor of a module is not parsed again
    f1_slot_of: dict[str, tuple[int, int, str]] = {}
    for key in metas:
        name = key.removeprefix(_PEFT_PREFIX)
        if "lora_magnitude_vector" in name:
            raise _fail(w_file, "DoRA magnitude vector: DoRA adapters are not supported (not W + s*B*A)", key)
        if "bias" in name and _LORA_BIAS.search(name):
            raise _fail(
                w_file, "LoRA bias (lora_bias): a trained bias on the LoRA factors is not supported", key
            )
        lora = _lora_weight(name)
        if lora is None:
            module = name.rpartition(".")[0]
            if settings.modules_to_save and _matches_module(module, settings.modules_to_save):
                if _is_expertish(module) and not _is_shared(module):
                    raise _fail(
                        w_file,
                        "modules_to_save replaces routed-expert weights wholesale; only LoRA "
                        "deltas can be served",
                        key,
                    )
                ignored[key] = "modules_to_save (a full copy of a non-expert module): not merged"
            elif "lora_embedding_" in name:
                ignored[key] = "embedding LoRA: not an MoE expert, not merged"
            elif "lora_velora_" in name:
                ignored[key] = "VeLoRA training buffer (unused at inference)"
            elif _is_expertish(module) and not _is_shared(module):
                raise _fail(
                    w_file,
                    "unknown expert layout: an expert tensor that is neither a per-expert "
                    "(F1) nor a fused-parameter (F2) LoRA A/B weight",
                    key,
                )
            else:
                ignored[key] = "not a LoRA A/B weight: " + _non_expert_reason(module)
            continue
        module, ab = lora
        slot = f1_slot_of.get(module)
        if slot is None:
            if _is_shared(module):
                ignored[key] = _non_expert_reason(module)
                continue
            if expert_set is not None and _is_expertish(module) and not in_expert_set(module, expert_set):
                ignored[key] = f"{OTHER_EXPERT_SET}, not {expert_set!r}: read by that set's pool"
                continue
            m1 = _F1_MODULE.match(module)
            if m1 is not None and m1.group("proj") in _F1_PROJ:
                layer, expert, proj = m1.group("layer", "expert", "proj")
                slot = f1_slot_of[module] = (int(layer), int(expert), _F1_PROJ[proj])
        if slot is not None:
            pair = f1.get(slot)
            if pair is None:
                pair = f1[slot] = _Pair()
            prev = f1_module.setdefault(slot, module)
            if prev != module or (pair.a if ab == "lora_A" else pair.b) is not None:
                raise _fail(
                    w_file,
                    f"duplicate LoRA weights for layer {slot[0]} expert {slot[1]} {slot[2]} (also in module "
                    f"{prev!r})",
                    key,
                )
        else:
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
                ignored[key] = _non_expert_reason(module)
                continue
            container = m2.group("container")
            pair = f2.setdefault((container, m2.group("wrap").count(".base_layer")), _Pair())
            f2_layer[container] = int(m2.group("layer"))
            if (pair.a if ab == "lora_A" else pair.b) is not None:
                raise _fail(w_file, f"duplicate fused-parameter LoRA weights for {container!r}", key)
        if ab == "lora_A":
            pair.a = key
        else:
            pair.b = key

    f1 = dict(sorted(f1.items(), key=lambda kv: (kv[0][0], kv[0][1], _PROJ_RANK[kv[0][2]])))
    f2 = dict(sorted(f2.items(), key=lambda kv: (f2_layer[kv[0][0]], -kv[0][1])))
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
            f"{sorted(set(ignored.values()))})",
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
    return _Classified(ignored, f1, f1_module, f2, f2_layer, factor_keys)


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
    layout = ExpertParamLayout(up_only=any(t.rpartition(".")[2] == "up_proj"
                                           for t in settings.target_parameters))
    first = next(iter(c.f2.values()))
    assert first.a is not None and first.b is not None
    a_cols, b_rows = metas[first.a].shape[1], metas[first.b].shape[0]
    hyps: list[tuple[int, int]] = []
    for h, i2, div in ((a_cols, b_rows, 2), (b_rows, a_cols, 2), (b_rows, a_cols, 1), (a_cols, b_rows, 1)):
        if h > 0 and i2 > 0 and i2 % div == 0 and (h, i2 // div) not in hyps:
            hyps.append((h, i2 // div))
    fits: list[tuple[int, int, str, dict[tuple[str, int], tuple[str, bool]], list[str]]] = []
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
    params = sorted({prm for prm, _ in assignment.values()}, key=_F2_PARAMS.index)
    layout = f"fused expert parameters (target_parameters): {', '.join(params)}"
    if len(params) == 2:
        layout += " (gate_up_proj LoRA in the inner ...experts.base_layer wrapper)"
    return (
        fmt, layout, _join_templates(templates), next(iter(n_exp)), h, i, candidates, ranks, alphas,
        {lid: [p for p in _PROJ_ORDER if p in ps] for lid, ps in sorted(projections.items())},
    )


def _nested_adapter_hint(adir: Path) -> str:
    """`` (its subfolder 'adapter' holds one)`` when an adapter lies one level down (``adapters/f1-qwen``)."""
    try:
        inner = sorted(d.name for d in adir.iterdir() if (d / CONFIG_NAME).is_file())
    except OSError:
        return ""
    if not inner:
        return ""
    if len(inner) == 1:
        return f" (its subfolder {inner[0]!r} holds one)"
    return f" (its subfolders {', '.join(map(repr, inner))} hold one each)"


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
    raw = raw if isinstance(raw, dict) else {}
    base = raw.get("base_model_name_or_path")
    auto_mapping = raw.get("auto_mapping")
    base_class = auto_mapping.get("base_model_class") if isinstance(auto_mapping, dict) else None

    header = _read_safetensors_header(w_file)
    metas = header.tensors
    if not metas:
        raise _fail(w_file, "the file holds no tensors: no expert LoRA weights at all")
    c = _classify_keys(metas, settings, w_file)

    notes: list[str] = []
    experts: dict[int, set[int]] = {}
    if c.f1:
        fmt = FORMAT_F1
        ranks, alphas, hid, inter, layout, templates = _describe_f1(c, metas, settings, w_file)
        candidates: list[tuple[int, int, str]] = []
        projs: dict[int, set[str]] = {}
        for lid, e, proj in c.f1:
            experts.setdefault(lid, set()).add(e)
            projs.setdefault(lid, set()).add(proj)
        projections = {lid: [p for p in _PROJ_ORDER if p in ps] for lid, ps in sorted(projs.items())}
        num_experts = None
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
    else:
        (fmt, layout, templates, num_experts, hid, inter, candidates, ranks, alphas,
         projections) = _describe_f2(c, metas, settings, w_file, notes)
        for lid in projections:
            experts[lid] = set(range(num_experts))
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
