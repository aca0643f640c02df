"""Which transformers Mixture-of-Experts families ``moelora.integrations.attach`` serves, checked with PEFT.

The families are found in the installed transformers: every ``transformers/models/<family>/`` whose
``modeling_<family>.py`` defines a routed-experts module (a class whose name ends in ``Experts``, or a
top-k routed sparse block holding one module per expert). For each family this script

1. builds a tiny random model (fp32, eval, seeded): the family's causal LM (for a vision-language family
   without a text-only causal LM, its text decoder stack under a small language-model head; for a
   seq2seq family its ``...ForConditionalGeneration``; for an encoder, its token classifier) from its
   config class, shrunk generically (hidden 32, 4/2 heads of 8, 8 experts, top-2, 2-3 layers, vocabulary
   96, ...) plus the per-family overrides of :data:`OVERRIDES` (the ten families of
   tests/test_integrations.py keep their hand-written configs there), with sharper router weights so
   that the routing differs between tokens;
2. describes how the experts module stores its weights (fused / transposed / interleaved gate and up,
   biases, no gate, per-expert modules, its own ``_apply_gate``, the activation, zero experts);
3. saves two PEFT LoRA adapters on the routed experts (``target_parameters`` on the experts' 3-D
   parameters, or ``target_modules`` on per-expert ``nn.Linear`` experts) with seeded random weights:
   ``a`` (r 4, alpha 8) and ``b`` (r 8, rsLoRA, ``down_proj`` at rank 4);
4. attaches moelora (``path="torch"``), loads both adapters and runs one left-padded batch of three rows
   (adapters ``a``, none, ``b``): each row's logits at its real positions must equal PEFT's model of that
   row's adapter run on the row alone (max abs difference / max abs of the reference below 1e-4), and so
   must the 4 tokens of a greedy ``generate``; outside the adapter context and after ``detach`` the model
   must compute exactly what it did before ``attach``. ``attach`` runs first: a refusal needs no PEFT;
5. records the family, its experts class, the storage and the verdict: ``served`` (equal to PEFT),
   ``refused`` (attach or load_adapter said no: the message), ``mismatch`` (the numbers differ),
   ``no model`` (the tiny model could not be built, or does not run a forward and a ``generate``),
   ``PEFT cannot adapt`` (PEFT raised) or ``error`` (anything else: the exception and where).

Every family runs inside its own time budget and exception guard, so one family never stops the run.

Usage::

    python benchmarks/family_coverage.py                          # all families, a table on stdout
    python benchmarks/family_coverage.py --families mixtral,olmoe --json out.json
    python benchmarks/family_coverage.py --markdown               # the table as markdown
    python benchmarks/family_coverage.py --json benchmarks/results/family_coverage.json
    python benchmarks/supported_table.py --write                  # docs/models.md's table from that JSON

The model-family table of docs/models.md is rendered from the committed
``benchmarks/results/family_coverage.json``; ``tests/test_family_coverage.py`` checks every family's
verdict live and that the JSON holds the same.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import functools
import importlib
import inspect
import json
import math
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


CATEGORIES = ("served", "refused", "mismatch", "no model", "PEFT cannot adapt", "error")
REL_TOL = 1e-4
GPU_REL_TOL = 1e-3  # fp32 on CUDA: the Triton kernels against PEFT's own CUDA forward
NEW_TOKENS = 4
ROWS: tuple[str | None, ...] = ("a", None, "b")
ROW_LENS = (6, 4, 6)  # left padded to 6
DEFAULT_BUDGET_S = 60.0

HIDDEN = 32
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 8
EXPERTS = 8
TOP_K = 2
VOCAB = 96

# --------------------------------------------------------------------------------------------------
# Families
# --------------------------------------------------------------------------------------------------

_ROUTED_HINT = re.compile(r"top_?k|router|routing")


def _models_dir() -> Path:
    import transformers

    return Path(transformers.__file__).resolve().parent / "models"


def _experts_classes_in(source: str) -> list[str]:
    """Names of the routed-experts classes defined in a modeling file's source: classes whose name ends in
    ``Experts``, and top-k routed sparse blocks that hold one module per expert (an ``nn.ModuleList`` /
    ``nn.ModuleDict`` of experts)."""
    found = re.findall(r"^class (\w*Experts)\(", source, flags=re.MULTILINE)
    if found or not re.search(r"self\.experts\s*=\s*nn\.Module(List|Dict)\(", source):
        return found
    lines = source.splitlines()
    for node in ast.parse(source).body:  # only files that build a list of experts get parsed
        if not isinstance(node, ast.ClassDef) or not re.search(r"Sparse|Moe|MoE", node.name):
            continue
        text = "\n".join(lines[node.lineno - 1 : node.end_lineno])
        per_expert = re.search(r"self\.experts\s*=\s*nn\.Module(List|Dict)\(", text)
        if per_expert and _ROUTED_HINT.search(text):
            found.append(node.name)
    return found


@functools.lru_cache(maxsize=4)
def _discover(models_dir: Path) -> tuple[tuple[str, tuple[str, ...]], ...]:
    found = []
    for path in sorted(models_dir.glob("*/modeling_*.py")):
        family = path.parent.name
        if path.name != f"modeling_{family}.py":
            continue
        classes = _experts_classes_in(path.read_text(encoding="utf-8"))
        if classes:
            found.append((family, tuple(classes)))
    return tuple(found)


def discover_families(models_dir: Path | None = None) -> dict[str, list[str]]:
    """``{family: [experts class names]}`` for every transformers model directory whose
    ``modeling_<family>.py`` defines a routed-experts module, sorted by family."""
    return {family: list(classes) for family, classes in _discover(models_dir or _models_dir())}


# --------------------------------------------------------------------------------------------------
# Per-family overrides (where the generic shrink of the config is not enough)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Override:
    """What a family needs beyond the generic shrink.

    Attributes:
        config: values set on the (text) config after the shrink, by name.
        model_class: the modeling class to build (default: found from the modeling module).
        layers: decoder layers (default 3 where the first layer is dense, else 2).
        exact: build the config from :data:`_COMMON` and ``config`` only (no generic shrink).
    """

    config: dict[str, Any] = field(default_factory=dict)
    model_class: str | None = None
    layers: int | None = None
    exact: bool = False


# The ten families of tests/test_integrations.py (``_family_config``): their hand-written configs, exactly.
_EXACT = dict(exact=True)
OVERRIDES: dict[str, Override] = {
    "qwen3_moe": Override(dict(num_hidden_layers=3, head_dim=8, intermediate_size=48,
                               moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                               norm_topk_prob=True, mlp_only_layers=[0]), **_EXACT),
    "qwen2_moe": Override(dict(num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
                               shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                               mlp_only_layers=[1]), **_EXACT),
    "olmoe": Override(dict(num_hidden_layers=2, intermediate_size=16, num_experts=8, num_experts_per_tok=2),
                      **_EXACT),
    "mixtral": Override(dict(num_hidden_layers=2, intermediate_size=16, num_local_experts=4,
                             num_experts_per_tok=2), **_EXACT),
    "deepseek_v3": Override(dict(num_key_value_heads=4, num_hidden_layers=3, intermediate_size=48,
                                 moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                                 n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                                 routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=16,
                                 kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8),
                            **_EXACT),
    "hy_v4": Override(dict(num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
                           num_local_experts=8, num_experts_per_tok=2, swiglu_limit=2.0), **_EXACT),
    "minimax_m3_vl": Override(dict(num_hidden_layers=2, intermediate_size=16, num_local_experts=8,
                                   num_experts_per_tok=2, swiglu_limit=0.5), **_EXACT),
    "deepseek_v4": Override(dict(num_key_value_heads=1, num_hidden_layers=2, moe_intermediate_size=16,
                                 n_routed_experts=8, num_experts_per_tok=2, head_dim=16, q_lora_rank=16,
                                 o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=4,
                                 swiglu_limit=2.0, num_nextn_predict_layers=0,
                                 mlp_layer_types=["hash_moe", "moe"]), **_EXACT),
    "aria": Override(dict(num_hidden_layers=2, intermediate_size=24, moe_num_experts=8, moe_topk=2,
                          moe_num_shared_experts=1), **_EXACT),
    "gemma4": Override(dict(num_hidden_layers=2, head_dim=8, intermediate_size=48, moe_intermediate_size=16,
                            num_experts=8, top_k_experts=2, enable_moe_block=True,
                            layer_types=["sliding_attention", "full_attention"],
                            vocab_size_per_layer_input=VOCAB), **_EXACT),  # + a small per-layer vocabulary
    # families the generic shrink does not fit
    "dbrx": Override(dict(  # reads rope_theta and clip_qkv from attn_config, which has no defaults for them
        attn_config=dict(kv_n_heads=KV_HEADS, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=24, moe_num_experts=EXPERTS, moe_top_k=TOP_K, hidden_size=HIDDEN))),
    "deepseek_ocr2": Override(dict(mlp_layer_types=["dense", "sparse", "sparse"]), layers=3),  # None: no MoE
    "dots1": Override(dict(n_shared_experts=1)),  # None breaks the shared expert's size
    "dots3_note": Override(dict(head_dim=12)),  # its sliding layers: head_dim = qk_nope + qk_rope head dims
    "ernie4_5_vl_moe": Override(dict(rope_parameters=dict(  # the code's default sections need head_dim 128
        rope_theta=500000.0, rope_type="default", mrope_section=[1, 1, 2]))),
    "glm4v_moe": Override(dict(rope_parameters=dict(  # the code's default sections need 64 rotary dims
        rope_theta=10000.0, rope_type="default", partial_rotary_factor=0.5, mrope_section=[1, 1, 0]))),
    "glm5_next": Override(dict(index_kpool=2)),  # index_topk must be a multiple of it
    "granitemoehybrid": Override(dict(layer_types=["linear_attention", "attention"])),  # one attention layer
    "jamba": Override(dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1,
                           expert_layer_offset=0)),  # an attention layer, experts in both layers
    "lfm2_moe": Override(dict(layer_types=["conv", "full_attention", "conv"]), layers=3),  # None: not derived
    "nemotron_h": Override(dict(layers_block_type=["moe", "full_attention", "moe"])),  # two MoE layers
    "nllb_moe": Override(dict(encoder_sparse_step=1, decoder_sparse_step=1)),  # every layer sparse
    "qwen4_exp": Override(dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=HEAD_DIM,
                               indexer_budget=4, indexer_compress_ratio=2)),  # None by default: needed
    # its mask builder asks for a window; clamped SwiGLUs of two limits in the two MoE layers
    "step3p7": Override(dict(sliding_window=16, swiglu_limits=[0.0, 2.0, 3.0])),
    "switch_transformers": Override(dict(num_sparse_encoder_layers=2, num_sparse_decoder_layers=2,
                                         encoder_sparse_step=1, decoder_sparse_step=1)),  # all sparse
    "zaya": Override(dict(num_experts_per_tok=1)),  # ZAYA routes top-1 only
}
# The values every hand-written config shares (tests/test_integrations.py ``_common``).
_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
               max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.08, pad_token_id=0,
               bos_token_id=1, eos_token_id=None)

# --------------------------------------------------------------------------------------------------
# The generic shrink
# --------------------------------------------------------------------------------------------------

_FIXED: dict[str, Any] = {
    # widths
    "vocab_size": VOCAB, "unpadded_vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": HEAD_DIM, "hidden_size": HIDDEN, "d_model": HIDDEN, "n_embd": HIDDEN,
    "num_attention_heads": HEADS, "n_heads": HEADS, "num_heads": HEADS, "n_head": HEADS,
    "encoder_attention_heads": HEADS, "decoder_attention_heads": HEADS, "swa_num_attention_heads": HEADS,
    "num_sliding_attention_heads": HEADS, "swa_num_key_value_heads": KV_HEADS, "hc_lowrank": 8,
    "num_key_value_heads": KV_HEADS, "num_kv_heads": KV_HEADS, "kv_n_heads": KV_HEADS, "n_kv_heads": KV_HEADS,
    "head_dim": HEAD_DIM, "d_kv": HEAD_DIM, "kv_channels": HEAD_DIM,
    "intermediate_size": 48, "d_ff": 48, "ffn_hidden_size": 48, "encoder_ffn_dim": 48,
    "decoder_ffn_dim": 48, "dense_intermediate_size": 48, "intermediate_size_mlp": 48, "ffn_dim": 48,
    # experts' I = 24: 2I = 48 differs from H = 32, so (E, 2I, H) and (E, H, 2I) differ in shape too
    "moe_intermediate_size": 24, "expert_ffn_hidden_size": 24, "moe_hidden_size": 24,
    "expert_intermediate_size": 24,
    "shared_expert_intermediate_size": 24, "moe_shared_expert_intermediate_size": 24,
    "shared_intermediate_size": 24, "shared_experts_intermediate_size": 24, "share_expert_dim": 24,
    # experts and routing
    "num_experts": EXPERTS, "n_routed_experts": EXPERTS, "num_local_experts": EXPERTS,
    "moe_num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K, "num_experts_per_token": TOP_K, "moe_topk": TOP_K, "moe_top_k": TOP_K,
    "top_k_experts": TOP_K, "moe_k": TOP_K,
    # positions and tokens
    "max_position_embeddings": 64, "max_seq_len": 64,
    "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": None,
    "initializer_range": 0.08,
    # low-rank attention (MLA) and indexers
    "q_lora_rank": 16, "kv_lora_rank": 16, "o_lora_rank": 16,
    "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8, "qk_head_dim": 12,
    "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4,
    "num_nextn_predict_layers": 0,
    # linear attention / state-space mixers
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "linear_num_heads": HEADS,
    "mamba_n_heads": 4, "mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_d_head": 16,
    "mamba_d_state": 8, "mamba_n_groups": 1, "mamba_dt_rank": 4, "mamba_expand": 2, "mamba_d_conv": 4,
    "ssm_state_size": 8, "n_groups": 1, "expand": 2, "conv_kernel": 4,
    "mamba_chunk_size": 16, "chunk_size": 16,
}
# _FIXED keys set even where the default config leaves them None (elsewhere None means "off" or "derive").
_SET_EVEN_IF_NONE = frozenset({"pad_token_id", "bos_token_id", "eos_token_id", "num_experts_per_tok",
                               "num_experts_per_token", "moe_topk", "moe_top_k", "top_k_experts", "moe_k",
                               "num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts",
                               "moe_intermediate_size", "expert_ffn_hidden_size", "moe_hidden_size",
                               "expert_intermediate_size", "head_dim"})
_LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layers", "encoder_layers", "decoder_layers",
               "num_decoder_layers")
# Integer config values that name layer indices (kept where they fall inside the tiny stack).
_INDEX_LIST_KEYS = ("moe_layers", "global_attn_indexes", "full_attention_layers",
                    "sliding_window_layers", "kv_source_layers", "ple_layer_ids")
_SUB_CONFIGS = ("text_config", "attn_config", "ffn_config")


def _resize_per_layer(values: list, n: int) -> list:
    """A per-layer list for ``n`` layers: the first entry, then every other distinct value in order of first
    appearance, then the last entry repeated: ``[dense, moe, moe, ...]`` -> ``[dense, moe, moe]``,
    ``[sliding] * 5 + [full]`` -> ``[sliding, full]``."""
    picked = [values[0]]
    for v in values[1:]:
        if len(picked) < n and all(_hashable(v) != _hashable(p) for p in picked):
            picked.append(v)
    picked += [values[-1]] * (n - len(picked))
    return [copy.deepcopy(v) for v in picked[:n]]


def _hashable(v: Any) -> Any:
    return json.dumps(v, sort_keys=True, default=str) if isinstance(v, (list, dict)) else v


def _split_evenly(total: int, weights: Sequence[int]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainders; entries may be 0)."""
    w = [max(float(x), 0.0) for x in weights]
    scale = total / (sum(w) or 1.0)
    exact = [x * scale for x in w]
    parts = [int(math.floor(x)) for x in exact]
    order = sorted(range(len(w)), key=lambda i: exact[i] - parts[i], reverse=True)
    for i in order[: total - sum(parts)]:
        parts[i] += 1
    return parts


def _shrink_rope(rope: dict, rotary_dim: int) -> dict:
    """Rope parameters for the tiny model: an ``mrope_section`` covering ``rotary_dim // 2`` frequencies."""
    rope = dict(rope)
    section = rope.get("mrope_section")
    if isinstance(section, list) and section:
        rope["mrope_section"] = _split_evenly(rotary_dim // 2, section)
    if isinstance(rope.get("original_max_position_embeddings"), int):
        rope["original_max_position_embeddings"] = min(rope["original_max_position_embeddings"], 64)
    return rope


def _rotary_dim(d: dict, out: dict, rope: dict) -> int:
    """The rotary width of one head of the shrunk config (``rotary_dim // 2`` frequencies)."""
    def get(key: str) -> Any:
        return out.get(key, d.get(key))

    head = get("qk_rope_head_dim") or get("head_dim") or (get("hidden_size") or HIDDEN) // (
        get("num_attention_heads") or HEADS)
    factor = rope.get("partial_rotary_factor", get("partial_rotary_factor")) or 1.0
    return int(head * factor)


def _shrink_dict(d: dict, layers: int) -> dict:
    """The changed entries of a config's ``to_dict()`` for a tiny model of ``layers`` layers."""
    old_layers = next((d[k] for k in _LAYER_KEYS if isinstance(d.get(k), int)), None)
    out: dict[str, Any] = {}
    for key, value in d.items():
        new = value
        if key in _SUB_CONFIGS and isinstance(value, dict):
            new = _shrink_dict(value, layers)
            new = {**value, **new}
        elif key == "per_layer_config" and isinstance(value, dict):  # per-layer overrides, shrunk alike
            new = {k: {**v, **_shrink_dict(v, layers)} for k, v in value.items()
                   if isinstance(v, dict) and str(k).isdigit() and int(k) < layers}
        elif key in _LAYER_KEYS and isinstance(value, int):
            new = layers
        elif key.endswith(("head_dim", "_lora_rank")) and value == 0:
            new = value  # 0 means "none" (Glm-5-next's DSA layers have no rope part)
        elif key in _FIXED and isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            new = [_FIXED[key]] * len(value)  # one per modality (Ernie-4.5-VL: text, vision)
        elif key in _FIXED:
            if key in _SET_EVEN_IF_NONE or value is not None:
                new = _FIXED[key]
        elif key in ("swiglu_limit", "limit") and isinstance(value, (int, float)) and value > 0:
            new = 2.0  # within reach of the tiny model's activations: the clamp is used
        elif key in ("n_group", "num_expert_group"):
            new = 2 if isinstance(value, int) and value > 1 else value
        elif key == "topk_group":
            new = 1 if isinstance(value, int) else value
        elif key == "mlp_only_layers" and isinstance(value, list):
            new = [i for i in value if i == 0]  # at most the first layer dense: two MoE layers follow
        elif key == "moe_layer_end_index" and isinstance(value, int) and value >= 0:
            new = layers - 1
        elif key in ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index") and isinstance(
                value, int):
            new = min(value, 1)
        elif re.search(r"(^|_)sliding_window(_size)?$", key) and isinstance(value, int) and value > 0:
            new = 16
        elif key in ("zero_expert_num", "num_zero_experts", "n_zero_experts") and isinstance(value, int):
            new = min(value, 2)
        elif key.endswith("_lora_rank") and isinstance(value, int):
            new = 16
        elif key.endswith("_head_dim") and isinstance(value, int) and value > 0:
            new = HEAD_DIM
        elif key.endswith("_intermediate_size") and isinstance(value, int) and value > 0:
            new = 24
        elif key in _INDEX_LIST_KEYS and isinstance(value, list):
            new = [i for i in value if isinstance(i, int) and i < layers]
        elif isinstance(value, list) and old_layers and len(value) == old_layers and old_layers != layers:
            new = _resize_per_layer(value, layers)
        if new is not value and new != value:
            out[key] = new
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(d.get(key), dict):
            rope = _shrink_rope(d[key], _rotary_dim(d, out, d[key]))
            if rope != d[key]:
                out[key] = rope
    # MLA: one key/value head per query head
    if "kv_lora_rank" in d and "num_key_value_heads" in d and "num_attention_heads" in d:
        out["num_key_value_heads"] = out.get("num_attention_heads", d["num_attention_heads"])
    # MLA: head_dim is the rope part of the q/k head where the default config says so
    if "qk_rope_head_dim" in d and d.get("head_dim") == d.get("qk_rope_head_dim"):
        out["head_dim"] = out.get("qk_rope_head_dim", d["qk_rope_head_dim"])
    if "qk_head_dim" in d and "qk_rope_head_dim" in d and "qk_nope_head_dim" in d:
        out["qk_head_dim"] = out.get("qk_rope_head_dim", d["qk_rope_head_dim"]) + out.get(
            "qk_nope_head_dim", d["qk_nope_head_dim"])
    return out


# --------------------------------------------------------------------------------------------------
# Building the tiny model
# --------------------------------------------------------------------------------------------------


class NoModel(Exception):
    """The tiny model of a family could not be built (the message says why, briefly)."""


class FamilyTimeout(Exception):
    """A family ran past its time budget."""


@dataclass
class Tiny:
    """A built tiny model and how to run it."""

    model: nn.Module
    kind: str  # "causal", "text stack", "seq2seq", "encoder"
    model_class: str


def _modeling(family: str) -> Any:
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def _classes(module: Any) -> dict[str, type]:
    return {n: c for n, c in vars(module).items() if inspect.isclass(c) and c.__module__ == module.__name__}


def _config_class_of(cls: type) -> type | None:
    cc = getattr(cls, "config_class", None)
    return cc if inspect.isclass(cc) else None


def _pick_model_class(family: str, classes: dict[str, type]) -> tuple[str, type]:
    """(kind, class) of the model to build for ``family``: its causal LM (the one on the text config), else
    its text decoder stack (VL families), else its ``...ForConditionalGeneration`` (seq2seq), else its token
    classifier (encoders)."""
    over = OVERRIDES.get(family)
    if over is not None and over.model_class:
        return _kind_of(over.model_class), classes[over.model_class]
    with_config = {n: c for n, c in classes.items() if _config_class_of(c) is not None}
    causal = sorted((n for n in with_config if n.endswith("ForCausalLM")),
                    key=lambda n: ("Talker" in n, "Text" not in _config_class_of(with_config[n]).__name__, n))
    if causal:
        return "causal", with_config[causal[0]]
    # Qwen3OmniMoeThinkerTextModel, DiffusionGemmaEncoderTextModel: after the plain ...TextModel
    text = sorted((n for n in with_config if n.endswith("TextModel") and "Talker" not in n),
                  key=lambda n: ("Encoder" in n or "Thinker" in n, n))
    if text:
        return "text stack", with_config[text[0]]
    for suffix, kind in (("ForConditionalGeneration", "seq2seq"), ("ForTokenClassification", "encoder")):
        found = sorted(n for n in with_config if n.endswith(suffix))
        if found:
            return kind, with_config[found[0]]
    raise NoModel("no causal LM, text stack, seq2seq or token-classification class")


def _kind_of(name: str) -> str:
    for suffix, kind in (("ForCausalLM", "causal"), ("TextModel", "text stack"),
                         ("ForConditionalGeneration", "seq2seq")):
        if name.endswith(suffix):
            return kind
    return "encoder"


def tiny_config(family: str, config_cls: type, layers: int | None = None) -> Any:
    """The shrunk config of ``config_cls`` for ``family`` (generic shrink, then :data:`OVERRIDES`)."""
    over = OVERRIDES.get(family, Override())
    if over.exact:
        try:
            return config_cls(**{**_COMMON, **over.config})
        except Exception as exc:
            raise NoModel(f"{config_cls.__name__}(**tiny) fails: {type(exc).__name__}: {_short(exc)}") \
                from exc
    try:
        defaults = config_cls()
    except Exception as exc:
        raise NoModel(f"{config_cls.__name__}() fails: {type(exc).__name__}: {_short(exc)}") from exc
    d = defaults.to_dict()
    n = layers or over.layers or _default_layers(d)
    kwargs = _shrink_dict(d, n)
    kwargs.update(over.config)
    try:
        return config_cls(**kwargs)
    except Exception as exc:
        raise NoModel(f"{config_cls.__name__}(**tiny) fails: {type(exc).__name__}: {_short(exc)}") from exc


def _default_layers(d: dict) -> int:
    """3 layers where the first one is dense (so two MoE layers follow), else 2."""
    dense_first = any(isinstance(d.get(k), int) and d[k] > 0 for k in ("first_k_dense_replace",
                                                                       "num_dense_layers",
                                                                       "moe_layer_start_index"))
    dense_first = dense_first or 0 in (d.get("mlp_only_layers") or ())
    for key, value in d.items():
        if "layer" in key and isinstance(value, list) and value and isinstance(value[0], str):
            dense_first = dense_first or "dense" in value[0] or value[0] == "mlp"
    return 3 if dense_first else 2


def _text_stack_lm(text_cls: type) -> type:
    """A causal LM over a text decoder stack (``...TextModel``): the stack and a linear head, generating with
    transformers' ``GenerationMixin`` (for VL families whose causal LM also needs a vision tower)."""
    from transformers import GenerationMixin
    from transformers.modeling_outputs import CausalLMOutputWithPast

    base = next(b for b in text_cls.__mro__[1:] if b.__name__.endswith("PreTrainedModel"))

    class TextStackForCausalLM(base, GenerationMixin):  # type: ignore[misc, valid-type]
        config_class = _config_class_of(text_cls)
        _no_split_modules = getattr(text_cls, "_no_split_modules", None)

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.model = text_cls(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()

        def get_input_embeddings(self) -> nn.Module:
            return self.model.get_input_embeddings()

        def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                    position_ids: torch.Tensor | None = None, past_key_values: Any = None,
                    inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                    logits_to_keep: int = 0, **kwargs: Any) -> CausalLMOutputWithPast:
            kwargs.pop("return_dict", None)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                             use_cache=use_cache, **kwargs)
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
            keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
            return CausalLMOutputWithPast(logits=self.lm_head(hidden[:, keep]),
                                          past_key_values=getattr(out, "past_key_values", None))

    TextStackForCausalLM.__name__ = TextStackForCausalLM.__qualname__ = f"{text_cls.__name__}+LMHead"
    return TextStackForCausalLM


def build_tiny_model(family: str, seed: int = 0) -> Tiny:
    """The tiny random model of ``family`` (fp32, eval, seeded, sharper routers); raises :class:`NoModel`."""
    try:
        modeling = _modeling(family)
    except Exception as exc:
        raise NoModel(f"import fails: {type(exc).__name__}: {_short(exc)}") from exc
    classes = _classes(modeling)
    kind, cls = _pick_model_class(family, classes)
    config_cls = _config_class_of(cls)
    if config_cls is None:
        raise NoModel(f"{cls.__name__} has no config class")
    config = tiny_config(family, config_cls)
    build_cls = _text_stack_lm(cls) if kind == "text stack" else cls
    torch.manual_seed(seed)
    try:
        model = build_cls(config)
    except Exception as exc:
        raise NoModel(f"{cls.__name__}(tiny config) fails: {type(exc).__name__}: {_short(exc)}") from exc
    model = model.to(torch.float32).eval()
    sharpen_routers(model)
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None:
        gen_cfg.pad_token_id = 0
        gen_cfg.eos_token_id = None
        gen_cfg.bos_token_id = getattr(config, "bos_token_id", 1)
        if kind == "seq2seq":
            gen_cfg.decoder_start_token_id = getattr(config, "decoder_start_token_id", None) or 1
    return Tiny(model, kind, build_cls.__name__)


def sharpen_routers(model: nn.Module, seed: int = 7) -> None:
    """Router weights ``randn * 0.5`` (the default init routes almost uniformly) and a used score-correction
    bias (``randn * 0.1``), as tests/test_integrations.py does for its families. A router weight is a 2-D
    weight under a ``router`` / ``gate`` module with one row per expert (up to twice that many: zero or
    identity experts)."""
    gen = torch.Generator().manual_seed(seed)
    experts = _num_experts_of(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            path = name.split(".")
            is_router = any("router" in c for c in path) or any(c in ("gate", "wg") for c in path[-3:-1])
            rows_ok = experts is None or experts <= p.shape[0] <= 2 * experts
            if is_router and path[-1] == "weight" and p.dim() == 2 and rows_ok:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        for name, t in list(model.named_buffers()) + list(model.named_parameters()):
            if name.endswith(("e_score_correction_bias", "expert_bias")) and t.dim() == 1:
                t.copy_(torch.randn(t.shape, generator=gen) * 0.1)


def _num_experts_of(model: nn.Module) -> int | None:
    """E: the leading size of the experts' stacked 3-D parameters, else an experts module's num_experts."""
    stacked = [int(p.shape[0]) for name, p in model.named_parameters() if p.dim() == 3 and "expert" in name]
    if stacked:
        return min(stacked)  # LongCat-Flash's gate_up_proj also has rows for its zero (identity) experts
    for module in model.modules():
        e = getattr(module, "num_experts", None)
        if type(module).__name__.endswith("Experts") and isinstance(e, int) and e > 1:
            return e
    return None


# --------------------------------------------------------------------------------------------------
# The experts modules and their storage
# --------------------------------------------------------------------------------------------------


def experts_modules(model: nn.Module, class_names: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every module of ``model`` whose class is one of ``class_names``
    (outermost only: a routed block holding experts modules is not listed twice)."""
    names = set(class_names)
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if type(module).__name__ in names and not any(name.startswith(p + ".") for p, _ in found):
            found.append((name, module))
    return found


def _routed_experts(model: nn.Module, class_names: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """The routed-experts modules (``...Experts`` classes, else the sparse blocks' ``experts`` child); a
    mixture of attention heads built of the same class (JetMoE's ``self_attention.experts``) is left out."""
    found = experts_modules(model, [c for c in class_names if c.endswith("Experts")])
    ffn = [(n, m) for n, m in found if not re.search(r"(^|\.)(self_)?attn|attention", n)]
    found = ffn or found
    shared = [(n, m) for n, m in found if "Shared" in type(m).__name__]
    found = [(n, m) for n, m in found if "Shared" not in type(m).__name__] or shared
    if found:
        return found
    blocks = experts_modules(model, class_names)
    return [(f"{n}.experts", m.experts) for n, m in blocks
            if isinstance(getattr(m, "experts", None), nn.Module)]


def describe_storage(module: nn.Module) -> str:
    """How ``module`` (an experts module) stores its experts, briefly: layout, biases, gate, activation."""
    parts: list[str] = []
    direct = dict(module.named_parameters(recurse=False))
    holder = module if isinstance(module, (nn.ModuleList, nn.ModuleDict)) else next(
        (c for c in module.children() if isinstance(c, (nn.ModuleList, nn.ModuleDict))), None)
    if holder is not None or not direct:
        experts = [c for c in (holder or module).children() if any(True for _ in c.parameters())]
        if len(experts) > 1 and all(type(e) is type(experts[0]) for e in experts):
            first = experts[0]
            linears = [n for n, m in first.named_modules() if isinstance(m, nn.Linear)]
            kind = "ModuleDict" if isinstance(holder, nn.ModuleDict) else "ModuleList"
            parts.append(f"per-expert modules (nn.{kind} of {len(experts)} {type(first).__name__}: "
                         f"{'/'.join(linears)})")
            if any(getattr(m, "bias", None) is not None for m in first.modules() if isinstance(m, nn.Linear)):
                parts.append("+bias")
            act = next((getattr(first, a) for a in ("act", "act_fn", "activation") if hasattr(first, a)),
                       None)
            if act is not None:
                parts.append(f"act {_act_name(act)}")
        else:
            flat = {n: tuple(p.shape) for n, p in module.named_parameters()}
            parts.append("params " + ", ".join(f"{n} {_shape(sh)}" for n, sh in flat.items()))
    else:
        w13, w2 = direct.get("gate_up_proj"), direct.get("down_proj")
        flag = bool(getattr(module, "is_transposed", False))
        if w13 is not None and w2 is not None and w13.dim() == 3 and w2.dim() == 3:
            _, a, b = w13.shape
            _, c, d = w2.shape
            plain, swapped = a == 2 * d and b == c, b == 2 * c and a == d
            transposed = swapped if plain != swapped else flag  # the shapes decide where they can
            layout = "(E,H,2I)/(E,I,H)" if transposed else "(E,2I,H)/(E,H,I)"
            parts.append(f"fused{' transposed' if transposed else ''} {layout}")
            if transposed != flag:
                parts.append(f"is_transposed={flag}")
            if w13.shape[0] != w2.shape[0]:
                parts.append(f"gate_up_proj has {w13.shape[0]} experts, down_proj {w2.shape[0]}")
            if getattr(module, "is_concatenated", True) is False:
                parts.append("interleaved gate/up")
        elif "up_proj" in direct and "down_proj" in direct and "gate_up_proj" not in direct:
            parts.append(f"up {_shape(direct['up_proj'].shape)} / down {_shape(direct['down_proj'].shape)}")
        else:
            parts.append("params " + ", ".join(f"{n} {_shape(p.shape)}" for n, p in direct.items()))
        ungated = "up_proj" in direct and "gate_up_proj" not in direct
        if getattr(module, "has_gate", True) is False or ungated:
            parts.append("ungated (no gate)")
        if getattr(module, "has_bias", False) or any(n.endswith("bias") for n in direct):
            parts.append("+bias")
        if getattr(module, "has_post_expert_norm", False):
            parts.append("+post-expert norm")
    gate = _custom_apply_gate(module)
    if gate:
        parts.append(gate)
    act = getattr(module, "act_fn", None) or getattr(module, "activation", None)
    if act is not None and not isinstance(act, (int, float, str)):
        parts.append(f"act {_act_name(act)}")
    for attr in ("zero_expert_num", "num_zero_experts", "zero_experts", "identity_experts",
                 "num_identity_experts", "n_zero_experts"):
        v = getattr(module, attr, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            kind = " identity" if isinstance(getattr(module, "identity_expert", None), nn.Identity) else ""
            parts.append(f"{attr}={v}{kind}")
    for attr in ("limit", "swiglu_limit", "alpha", "swiglu_alpha"):
        v = getattr(module, attr, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            parts.append(f"{attr}={v:g}")
    return ", ".join(parts)


def describe_layer_storage(experts: Sequence[tuple[str, nn.Module]]) -> str:
    """:func:`describe_storage` of the first MoE layer's experts module, or of each of its experts modules
    where the layer has several (JetMoE: ``input_linear`` and ``output_linear``; ERNIE-4.5-VL's expert
    sets, named by their block: ``text_moe`` and ``vision_moe``)."""
    parent = experts[0][0].rpartition(".")[0]
    siblings = [(n.rpartition(".")[2], m) for n, m in experts if n.rpartition(".")[0] == parent]
    if len(siblings) == 1:
        layer = re.match(r"^(.*?layers\.\d+\.)", experts[0][0])
        sets = [(n.rpartition(".")[0].rpartition(".")[2], m) for n, m in experts
                if layer is not None and n.startswith(layer.group(1))]
        if len(sets) > 1:
            return "; ".join(f"{block}: {describe_storage(m)}" for block, m in sets)
        return describe_storage(experts[0][1])
    return "; ".join(f"{attr}: {describe_storage(m)}" for attr, m in siblings)


def _shape(shape: Sequence[int]) -> str:
    return "(" + ",".join(str(int(s)) for s in shape) + ")"


def _act_name(act: Any) -> str:
    name = type(act).__name__
    if name in ("function", "builtin_function_or_method", "method"):
        name = getattr(act, "__name__", name)
    approx = getattr(act, "approximate", None)
    return f"{name}({approx})" if isinstance(approx, str) and approx != "none" else name


def _custom_apply_gate(module: nn.Module) -> str:
    own = getattr(type(module), "_apply_gate", None)
    if own is None:
        return ""
    try:
        from transformers.integrations.moe import _default_apply_gate
    except Exception:
        return ""
    return "custom _apply_gate" if own is not _default_apply_gate else ""


# --------------------------------------------------------------------------------------------------
# Adapters
# --------------------------------------------------------------------------------------------------


@dataclass
class Targets:
    """What PEFT adapts: ``target_parameters`` (fused 3-D expert parameters) or ``target_modules``
    (per-expert ``nn.Linear``); ``down`` is the name of the down projection (for rank_pattern), if any."""

    parameters: list[str]
    modules: list[str] | str
    down: str | None


def peft_targets(model: nn.Module, experts: Sequence[tuple[str, nn.Module]]) -> Targets:
    """The experts' LoRA targets, derived from the model: suffixes ``<attr>.<param>`` of their 3-D
    parameters (``experts.gate_up_proj``), else a regex of their per-expert ``nn.Linear`` modules."""
    params: dict[str, None] = {}
    targeted = {f"{name}.{pname}" for name, module in experts
                for pname, _ in module.named_parameters(recurse=False)}
    others = [n for n, _ in model.named_parameters() if n not in targeted]
    for name, module in experts:
        parts = name.split(".")
        for pname, p in module.named_parameters(recurse=False):
            if p.dim() != 3:
                continue
            for k in range(1, len(parts) + 1):  # the shortest suffix that names no other parameter
                suffix = ".".join(parts[-k:] + [pname])
                if not any(o == suffix or o.endswith("." + suffix) for o in others):
                    break
            params[suffix] = None
    if params:
        names = list(params)
        down = next((n.rsplit(".", 1)[-1] for n in names if n.endswith(("down_proj", "w2"))), None)
        return Targets(names, [], down)
    linears: dict[str, None] = {}  # full-name patterns, layer and expert indices generalised
    leaves: set[str] = set()
    for name, module in experts:
        for sub, m in module.named_modules():
            if isinstance(m, nn.Linear) and sub:
                pattern = re.sub(r"(^|\.)\d+(?=\.|$)", r"\1<N>", f"{name}.{sub}")  # layer / expert index
                pattern = re.sub(r"(expert_)\d+", r"\1<N>", pattern)
                linears[re.escape(pattern).replace("<N>", r"\d+")] = None
                leaves.add(sub.rsplit(".", 1)[-1])
    if not linears:
        raise ValueError("no 3-D expert parameters and no per-expert nn.Linear to adapt")
    down = next((n for n in ("down_proj", "w2", "wo", "fc2") if n in leaves), None)
    return Targets([], "|".join(linears), down)


def adapter_configs(targets: Targets) -> dict[str, dict[str, Any]]:
    """LoraConfig keyword arguments of adapters ``a`` and ``b``."""
    common = dict(target_modules=targets.modules, target_parameters=targets.parameters or None)
    b = dict(r=8, lora_alpha=8, use_rslora=True, **common)
    if targets.down:
        b["rank_pattern"] = {targets.down: 4}
    return {"a": dict(r=4, lora_alpha=8, **common), "b": b}


def fill_lora(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


# --------------------------------------------------------------------------------------------------
# Running the check
# --------------------------------------------------------------------------------------------------


@dataclass
class FamilyResult:
    """The verdict of one family."""

    family: str
    experts_class: str = ""
    storage: str = ""
    category: str = "error"
    detail: str = ""
    model_class: str = ""
    seconds: float = 0.0


def _short(exc: BaseException | str, limit: int = 300) -> str:
    """The message on one line, at most ``limit`` characters."""
    msg = " ".join(str(exc).split())
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def _inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    s = max(ROW_LENS)
    ids = torch.randint(2, vocab, (len(ROW_LENS), s), generator=gen)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(ROW_LENS):
        ids[i, : s - n] = 0
        mask[i, s - n :] = 1
    return ids, mask


def _real(row: int) -> slice:
    return slice(max(ROW_LENS) - ROW_LENS[row], None)


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) / (float(want.abs().max()) + 1e-12)


def _forward_kwargs(tiny: Tiny, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    kw = dict(input_ids=ids, attention_mask=mask)
    if tiny.kind == "seq2seq":
        start = tiny.model.generation_config.decoder_start_token_id or 1
        dec = torch.cat([torch.full_like(ids[:, :1], start), ids[:, -3:]], dim=1)
        kw["decoder_input_ids"] = dec
    return kw


def _logits(model: nn.Module, tiny: Tiny, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = model(**_forward_kwargs(tiny, ids, mask))
    return out.logits if hasattr(out, "logits") else out[0]


def _generate(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         min_new_tokens=NEW_TOKENS)
    return out[:, -NEW_TOKENS:]


@contextlib.contextmanager
def time_budget(seconds: float | None) -> Iterator[None]:
    """Raises :class:`FamilyTimeout` inside the block after ``seconds`` (main thread only; elsewhere, or with
    ``None``, no limit)."""
    usable = seconds is not None and seconds > 0 and threading.current_thread() is threading.main_thread() \
        and hasattr(signal, "setitimer")
    if not usable:
        yield
        return

    def _raise(signum: int, frame: Any) -> None:
        raise FamilyTimeout(f"over the time budget of {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import transformers

        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        try:
            yield
        finally:
            transformers.logging.set_verbosity(verbosity)


def check_family(family: str, experts_classes: Sequence[str] | None = None,
                 budget_s: float | None = DEFAULT_BUDGET_S, workdir: Path | None = None,
                 device: str = "cpu") -> FamilyResult:
    """Runs the whole check on one family and returns its verdict; never raises (but KeyboardInterrupt).
    ``device="cuda"`` runs the models there in fp32, the layers on the Triton kernels (``path="auto"``)."""
    if experts_classes is None:
        experts_classes = discover_families().get(family)
        if experts_classes is None:
            return FamilyResult(family, category="error", detail="no routed-experts class in transformers")
    result = FamilyResult(family, experts_class="/".join(experts_classes))
    started = time.perf_counter()
    try:
        with time_budget(budget_s), _quiet(), torch.no_grad():
            with tempfile.TemporaryDirectory(dir=workdir) as tmp:
                _check(family, experts_classes, result, Path(tmp), torch.device(device))
    except FamilyTimeout as exc:
        result.category, result.detail = "error", f"FamilyTimeout: {exc}"
    except Exception as exc:  # one family never stops the run
        result.category, result.detail = "error", f"{type(exc).__name__}: {_short(exc)} @ {_where(exc)}"
    result.seconds = round(time.perf_counter() - started, 2)
    return result


def _where(exc: BaseException) -> str:
    """Where ``exc`` was raised: its last frame, after the last moelora frame when that is another one."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"

    def ours(f: traceback.FrameSummary) -> bool:
        return "moelora" in Path(f.filename).parts[:-1]

    def at(f: traceback.FrameSummary) -> str:
        parts = Path(f.filename).parts
        rel = "/".join(parts[parts.index("moelora"):]) if ours(f) else parts[-1]
        return f"{rel}:{f.lineno}"

    mine = [f for f in frames if ours(f)]
    where = [at(mine[-1])] if mine and mine[-1] is not frames[-1] else []
    return " > ".join(where + [at(frames[-1])])


def _check(family: str, experts_classes: Sequence[str], result: FamilyResult, tmp: Path,
           device: torch.device) -> None:
    import peft

    import moelora.integrations as mi

    try:
        tiny = build_tiny_model(family)
    except NoModel as exc:
        result.category, result.detail = "no model", str(exc)
        return
    except FamilyTimeout:
        raise
    except Exception as exc:
        result.category, result.detail = "no model", f"{type(exc).__name__}: {_short(exc)}"
        return
    model = tiny.model.to(device)
    result.model_class = tiny.model_class
    experts = _routed_experts(model, experts_classes)
    if not experts:
        result.category = "no model"
        result.detail = f"the tiny {tiny.model_class} holds no {'/'.join(experts_classes)} module"
        return
    result.experts_class = type(experts[0][1]).__name__
    result.storage = describe_layer_storage(experts)
    pristine = copy.deepcopy(model)

    ids, mask = (t.to(device) for t in _inputs(VOCAB))
    tol = REL_TOL if device.type == "cpu" else GPU_REL_TOL
    generates = tiny.kind != "encoder"
    try:  # the tiny model itself must run: a forward and a greedy generate of the batch
        base_logits = _logits(model, tiny, ids, mask)
        if generates:
            _generate(model, ids, mask)
    except FamilyTimeout:
        raise
    except Exception as exc:
        result.category = "no model"
        result.detail = f"the tiny {tiny.model_class} does not run: {type(exc).__name__}: {_short(exc)} " \
                        f"@ {_where(exc)}"
        return

    # attach first: a refusal needs no PEFT oracle
    try:
        handle = mi.attach(model, max_loras=4, max_rank=16, path="torch" if device.type == "cpu" else "auto")
    except mi.UnsupportedModelError as exc:
        result.category, result.detail = "refused", f"attach: {_short(exc)}"
        return
    try:
        try:
            targets = peft_targets(pristine, experts)
            oracles: dict[str | None, nn.Module] = {None: pristine}
            for i, (name, kw) in enumerate(adapter_configs(targets).items()):
                pm = peft.get_peft_model(copy.deepcopy(pristine), peft.LoraConfig(**kw))
                fill_lora(pm, seed=100 + i)
                pm.eval()
                pm.save_pretrained(str(tmp / name))
                oracles[name] = pm
        except FamilyTimeout:
            raise
        except Exception as exc:
            result.category = "PEFT cannot adapt"
            result.detail = f"{type(exc).__name__}: {_short(exc)}"
            return
        for name in ("a", "b"):
            try:
                handle.load_adapter(name, tmp / name)
            except FamilyTimeout:
                raise
            except Exception as exc:
                result.category = "refused"
                result.detail = f"load_adapter({name!r}): {type(exc).__name__}: {_short(exc)}"
                return
        with handle.adapters(list(ROWS)):
            logits = _logits(model, tiny, ids, mask)
            tokens = _generate(model, ids, mask) if generates else None
        # outside the context the model is the base model again
        after = _logits(model, tiny, ids, mask)
    finally:
        handle.detach()
    detached = _logits(model, tiny, ids, mask)

    errors: list[str] = []
    worst, effect = 0.0, math.inf
    for row, name in enumerate(ROWS):
        sl = slice(row, row + 1)
        oracle = oracles[name]
        want = _logits(oracle, tiny, ids[sl], mask[sl])[0]
        real = _real(row) if tiny.kind != "seq2seq" else slice(None)
        err = _close(logits[row, real], want[real])
        worst = max(worst, err)
        if not math.isfinite(err) or err >= tol:
            errors.append(f"row {row} ({name or 'base'}) logits rel err {err:.2e}")
        elif name is not None:
            effect = min(effect, _close(base_logits[row, real], want[real]))
            if effect < 1e-6:
                errors.append(f"row {row} ({name}): the adapter does not change PEFT's logits")
        if tokens is not None:
            ref = _generate(oracle, ids[sl], mask[sl])[0]
            if tokens[row].tolist() != ref.tolist():
                errors.append(f"row {row} ({name or 'base'}) generate {tokens[row].tolist()} != PEFT "
                              f"{ref.tolist()}")
    if not torch.equal(after, base_logits):
        errors.append("outside handle.adapters the logits differ from the base model's")
    if not torch.equal(detached, base_logits):
        errors.append("after detach the logits differ from the base model's")
    if errors:
        result.category, result.detail = "mismatch", "; ".join(errors)
    else:
        result.category = "served"
        how = f"logits max rel err {worst:.1e}" + (f", generate {NEW_TOKENS} tokens equal" if generates
                                                   else " (encoder: no generate)")
        result.detail = f"{how}; adapter effect >= {effect:.1e}; MoE layers {list(handle.layer_ids)}"


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def run(families: Sequence[str] | None = None, budget_s: float | None = DEFAULT_BUDGET_S,
        progress: Callable[[str], None] | None = None, device: str = "cpu") -> list[FamilyResult]:
    """Checks ``families`` (default: all found in transformers), in order."""
    found = discover_families()
    names = list(found) if not families else list(families)
    results = []
    for i, family in enumerate(names, 1):
        if family not in found:
            results.append(FamilyResult(family, category="error", detail="not a transformers MoE family"))
        else:
            results.append(check_family(family, found[family], budget_s, device=device))
        r = results[-1]
        if progress is not None:
            progress(f"[{i}/{len(names)}] {family}: {r.category} ({r.seconds:.1f} s) {r.detail[:160]}")
    return results


def _cell(text: str, markdown: bool) -> str:
    text = " ".join(str(text).split())
    return text.replace("|", "\\|") if markdown else text


def format_table(results: Sequence[FamilyResult], markdown: bool = False) -> str:
    header = ("family", "experts class", "storage", "result", "detail")
    rows = [(r.family, r.experts_class, r.storage, r.category, r.detail) for r in results]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(_cell(c, True) for c in row) + " |" for row in rows]
    else:
        widths = [max(len(header[i]), *(min(len(_cell(r[i], False)), 60) for r in rows)) if rows else
                  len(header[i]) for i in range(4)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
        lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths), "-" * 6)]
        lines += [fmt.format(*(_cell(c, False) for c in row)) for row in rows]
    return "\n".join(lines + ["", count_line(results)])


def count_line(results: Sequence[FamilyResult]) -> str:
    served = sum(r.category == "served" for r in results)
    by_cat = ", ".join(f"{c}: {n}" for c in CATEGORIES if (n := sum(r.category == c for r in results)))
    return f"{served} of {len(results)} families served and equal to PEFT ({by_cat})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", help="comma-separated families (default: all)")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds per family")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--device", default="cpu",
                        help="cpu (the PyTorch path) or cuda (fp32, the Triton kernels)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    families = [f.strip() for f in args.families.split(",") if f.strip()] if args.families else None
    started = time.perf_counter()
    results = run(families, args.budget, progress=lambda line: print(line, file=sys.stderr, flush=True),
                  device=args.device)
    print(f"total {time.perf_counter() - started:.1f} s", file=sys.stderr)
    table = format_table(results, markdown=args.markdown)
    print(table)
    if args.json:
        import peft
        import transformers

        versions = dict(transformers=transformers.__version__, peft=peft.__version__)
        records = [dict(asdict(r), **versions) for r in results]
        args.json.write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
