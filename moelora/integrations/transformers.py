"""Serve many LoRA adapters on a transformers-5 Mixture-of-Experts model, one adapter per sequence.

:func:`attach` finds every routed-experts module of the model and swaps it for a
:class:`MoELoRAExperts`, which runs :class:`moelora.FusedMoEWithLoRA` on the model's own expert tensors
(the same ``nn.Parameter`` objects: nothing is copied, ``state_dict()`` keys are unchanged). Routers,
shared experts, attention and dense MLP layers are not touched. The returned :class:`MoELoRAHandle`
loads adapters into the pool and selects one adapter per batch row::

    handle = attach(model, max_loras=8, max_rank=64)     # pool sized from the expert tensors
    handle.load_adapter("sql", "path/to/sql")            # a PEFT directory
    handle.load_adapter("chat", "path/to/chat")
    with handle.adapters(["sql", None, "chat"]):          # one entry per batch row, None = base model
        logits = model(input_ids).logits
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
    handle.detach()                                       # original modules back, bit-identical outputs

What is swapped. In transformers 5 the routed experts of a MoE layer are one module with fused
parameters ``gate_up_proj (E, 2I, H)`` (rows ``[0, I)`` gate, ``[I, 2I)`` up) and ``down_proj
(E, H, I)`` and ``forward(hidden_states (M, H), top_k_index (M, k), top_k_weights (M, k))`` computing
``sum_k w_k * down_e(act(gate_e x, up_e x))``: ``Qwen3MoeExperts``, ``Qwen2MoeExperts``,
``OlmoeExperts``, ``MixtralExperts``, ``DeepseekV3Experts`` (the families in
:data:`KNOWN_EXPERTS_CLASSES`, tested against PEFT) and many others built with transformers'
``use_experts_implementation``. The router of each family runs before the experts module and hands it
the final routing weights: DeepSeek-V3's ``DeepseekV3TopkRouter`` already multiplies them by
``routed_scaling_factor`` (and renormalises with ``norm_topk_prob``), so the experts module, and
therefore the swapped layer, uses ``routed_scaling_factor = 1``: the same math as the original module.
Other classes with the same structure are accepted after a numerical check of their forward against
that formula at attach time. ``act`` is SiLU, exact or tanh GELU (probed from ``act_fn``), or, where the
class overrides ``_apply_gate``, the gated activation it computes (the clamped SwiGLUs of gpt-oss,
DeepSeek-V4, GLM-5-next, Hunyuan-V4, MiniMax-M3, Step-3.7; Inkling-2's soft-capped SwiGLU: found by running
it on probe values, :class:`moelora.activations.GatedActivation`). Other layouts are mapped onto the layer
(docs/architecture.md, "Expert layouts"): transposed storage (Aria, gpt-oss, and Llama-4's unflagged one)
read in place through strides; ungated squared-ReLU experts (Nemotron-H) as a ``(E, 2, I, H)`` halves view
of their up projection; interleaved gate/up columns (gpt-oss) through one de-interleaved copy of gate/up
(the in-place halves view reads 6-8x slower); MXFP4 experts packed for transformers' hub kernels (gpt-oss)
dequantized once at attach, de-interleaved on the way; expert biases (gpt-oss) in the GEMM
epilogues; identity experts (LongCat-Flash) added by the wrapper; a norm after each expert (MuSE-Spark) run
on each routed pair's output; Llama-4's dense form (every expert's input-scaled rows) as top-1 pairs; and
JetMoE's self-routing block, swapped whole; several expert sets per layer chosen by a token-type mask
(ERNIE-4.5-VL's text and vision experts) from a pool per set (:attr:`MoELoRAHandle.pools`).
``benchmarks/family_coverage.py`` checks every family against PEFT. Refused, with an
:class:`UnsupportedModelError` (a ``ValueError``) that says why: expert sets chosen otherwise, stacked 2-D
expert matrices (DBRX), experts as one module each (transformers 4,
Switch Transformers, NLLB-MoE), an ``_apply_gate`` of another form, other activations, MXFP4 experts whose
packed tensors cannot be decoded (load them dequantized), expert parallelism across ranks that hold different
batches (transformers' all-to-all), quantised or meta-device expert weights, experts spread over several
devices or dtypes, MoE layers of different shapes in one model, and a model that PEFT already wraps (attach
to the plain base model). A model loaded with transformers' tensor-parallel plan, or its expert-parallel
plan over the tensor-parallel ranks, is served shard by shard (``_sharding_of``).

Adapter per token. Inside a ``handle.adapters(names)`` context the hidden states an experts module
receives are the model's ``(B, S, H)`` activations flattened batch-major: ``B*S`` rows at prefill,
``B`` rows per decode step with a KV cache. The tokens of row ``b`` are rows ``[b*S, (b+1)*S)``, so
row ``b`` gets ``names[b]`` for all its ``S`` tokens. When ``generate`` expands the batch
(``num_return_sequences``, beam search) it repeats each row in place (``repeat_interleave``), so a
batch of ``n * len(names)`` rows gives every name its ``n`` adjacent copies; the model's forward
pre-hook refuses a batch whose row count is not a multiple of ``len(names)``. For packed (padding-free)
inputs pass ``seq_lens`` (tokens per sequence in the flattened order) instead.

Padding. With left (or right) padding a padded position belongs to its row and takes the row's
adapter. That is harmless: the attention mask keeps padded positions out of every real token's
attention, and their own outputs are ignored, so real tokens get exactly what they get unpadded.

Batch info. A :class:`moelora.MoELoRABatchInfo` depends only on the names and the token count, so one
is built per (context, token count) on first use and shared by every MoE layer and every later step
of that shape: a ``generate`` call builds two (prefill and decode), not one per layer per step. They
hold their adapters' slots (no eviction) until the context exits. Outside any context (or when every
name is ``None``) the original module runs: exactly the base model's output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import re
import threading
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moelora.activations import GatedActivation
from moelora.batch_info import MoELoRABatchInfo
from moelora.layer import PATHS, FusedMoEWithLoRA, fp8_scales_of
from moelora.parallel import MoEShard
from moelora.peft_loader import OTHER_EXPERT_SET, ExpertParamLayout, in_expert_set, lora_module_names
from moelora.pool import MoELoRAMemoryPool
from moelora.torch_path import moe_lora_forward_torch

__all__ = [
    "UnsupportedModelError",
    "KNOWN_EXPERTS_CLASSES",
    "MoELoRAExperts",
    "MoELoRAHandle",
    "attach",
    "find_experts_modules",
]

class UnsupportedModelError(ValueError, NotImplementedError):
    """A model (or one of its MoE layers) that ``attach()`` cannot serve exactly; the message says why.
    A ``ValueError`` like every refusal of the library, and a ``NotImplementedError`` for callers that
    caught that."""


#: Experts classes whose math (``sum_k w_k * down(silu(gate x) * up x)``, routing weights final, no
#: routed_scaling_factor inside the experts module) was read in the transformers 5 sources and is
#: checked against PEFT in tests/test_integrations.py. Other classes of the same structure are checked
#: numerically at attach time.
KNOWN_EXPERTS_CLASSES = frozenset(
    {"Qwen3MoeExperts", "Qwen2MoeExperts", "OlmoeExperts", "MixtralExperts", "DeepseekV3Experts"}
)
# transformers' fine-grained FP8 experts: any family's experts, quantized. Not run to verify the math (its
# forward needs transformers' hub kernels); _check_supported reads its scales and gate variants instead.
_FP8_EXPERTS_CLASS = "FP8Experts"
# FP8Experts overrides _apply_gate for these variants; without them it is the plain act(gate) * up.
_FP8_GATE_VARIANTS = ("gate_softcap", "up_softcap", "swiglu_alpha", "swiglu_limit", "limit")

_POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?=\.|$)")


# --------------------------------------------------------------------------------------------------
# Finding and checking the experts modules
# --------------------------------------------------------------------------------------------------


def _gate_up_name(module: nn.Module) -> str:
    """The parameter holding the experts' input projections: ``gate_up_proj``, or ``up_proj`` for ungated
    experts (``has_gate`` False, Nemotron-H)."""
    return "up_proj" if getattr(module, "has_gate", True) is False else "gate_up_proj"


def _is_fused_experts(module: nn.Module) -> bool:
    w13 = getattr(module, _gate_up_name(module), None)
    w2 = getattr(module, "down_proj", None)
    return isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor) and w13.dim() == 3 and w2.dim() == 3


class _RoutedBlockExperts(nn.Module):
    """The experts of a MoE block that routes inside its own forward (JetMoE's ``JetMoeMoE``: a top-k
    softmax router, ``input_linear`` / ``output_linear`` expert weights ``(E, 2I, H)`` / ``(E, H, I)`` and one
    output bias), seen as a transformers-5 experts module: ``gate_up_proj``, ``down_proj``, ``act_fn``.
    Not part of the model: the block itself is what ``attach`` swaps."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "block", block)  # not a child: the view owns nothing

    @property
    def gate_up_proj(self) -> torch.Tensor:
        return self.block.input_linear.weight

    @property
    def down_proj(self) -> torch.Tensor:
        return self.block.output_linear.weight

    @property
    def act_fn(self) -> Any:
        return self.block.activation

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(top_k_weights, top_k_index)`` of ``x (M, H)`` as the block's router computes them: a softmax
        over the top-k of fp32 logits, in x's dtype."""
        router = self.block.router
        top_logits, top_index = router.layer(x).float().topk(router.top_k, dim=1)
        return torch.softmax(top_logits, dim=1).type_as(x), top_index

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.block(*args, **kwargs)


def _is_routed_block(module: nn.Module) -> bool:
    """A JetMoE-style MoE block (``_RoutedBlockExperts``)."""
    parts = [getattr(module, n, None) for n in ("input_linear", "output_linear")]
    router = getattr(module, "router", None)
    return (all(isinstance(getattr(p, "weight", None), torch.Tensor) and p.weight.dim() == 3 for p in parts)
            and isinstance(getattr(router, "layer", None), nn.Linear)
            and isinstance(getattr(router, "top_k", None), int)
            and callable(getattr(module, "activation", None))
            and isinstance(getattr(module, "bias", None), torch.Tensor))


def _deinterleaved(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A copy of ``t`` with its alternating gate/up entries along ``dim`` (gpt-oss) as gate first, then
    up."""
    index = [slice(None)] * t.dim()
    gate, up = list(index), list(index)
    gate[dim], up[dim] = slice(0, None, 2), slice(1, None, 2)
    return torch.cat((t[tuple(gate)], t[tuple(up)]), dim=dim)


def _is_mxfp4_packed(module: nn.Module) -> bool:
    """gpt-oss' experts as transformers loads them for its MXFP4 hub kernels (``Mxfp4GptOssExperts``)."""
    return type(module).__name__ == "Mxfp4GptOssExperts"


def _mxfp4_dequantized(name: str, packed: nn.Module, proj: str, dtype: torch.dtype) -> torch.Tensor:
    """``packed``'s ``proj`` ("gate_up_proj" or "down_proj") in ``dtype``, stored as gpt-oss' bf16 experts
    store it: ``(E, H, 2I)`` (gate/up columns interleaved) or ``(E, I, H)``. The hub tensors are unswizzled
    and the FP4 values decoded by transformers' own conversion (what it runs to save such a model, and to
    load one with ``Mxfp4Config(dequantize=True)``)."""
    try:
        from transformers.integrations.mxfp4 import Mxfp4ReverseDeserialize, convert_moe_packed_tensors

        packed_tensors = Mxfp4ReverseDeserialize(None).convert({}, model=packed,
                                                               full_layer_name=f"{proj}_blocks")
        blocks, scales = packed_tensors[f"{proj}_blocks"], packed_tensors[f"{proj}_scales"]
        with torch.no_grad():
            return convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    except Exception as exc:  # plain uint8 tensors without their scales, another hub or transformers version
        raise UnsupportedModelError(
            f"experts module {name!r} ({type(packed).__name__}) holds MXFP4 weights that cannot be "
            f"dequantized at attach ({type(exc).__name__}: {exc}); load the model with quantization_config="
            "Mxfp4Config(dequantize=True) (the experts in bfloat16) and attach that"
        ) from exc


class _DequantizedMxfp4Experts(nn.Module):
    """gpt-oss' MXFP4 experts (``Mxfp4GptOssExperts``, packed for transformers' hub kernels) dequantized
    once, at attach, into the model's compute dtype: what the layer reads. Gate/up ``(E, H, 2I)`` with the
    gate columns first (de-interleaved while dequantizing, so no second copy), down ``(E, I, H)``, both read
    through transposed strides, and the biases in the same dtype and order. These bf16 copies hold about four
    times the MXFP4 bytes (gpt-oss-20b: 38 GB beside 10 GB packed), beside the packed module, which stays
    the model's (its ``state_dict`` and what :meth:`MoELoRAHandle.detach` restores). PEFT adapters of
    gpt-oss address the interleaved columns of its bf16 storage: :func:`_expert_layout` reads them so."""

    is_concatenated = True
    is_transposed = True
    has_bias = True
    adapter_gate_up_interleaved = True

    def __init__(self, name: str, packed: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        object.__setattr__(self, "packed", packed)  # not a child: the view owns nothing of the model's
        self.alpha, self.limit = float(packed.alpha), float(packed.limit)
        gate_up = _mxfp4_dequantized(name, packed, "gate_up_proj", dtype)
        self.gate_up_proj = nn.Parameter(_deinterleaved(gate_up, dim=2), requires_grad=False)
        del gate_up
        down = _mxfp4_dequantized(name, packed, "down_proj", dtype)
        self.down_proj = nn.Parameter(down, requires_grad=False)
        bias = packed.gate_up_proj_bias.detach().to(dtype)
        self.gate_up_proj_bias = nn.Parameter(_deinterleaved(bias, dim=1), requires_grad=False)
        self.down_proj_bias = nn.Parameter(packed.down_proj_bias.detach().to(dtype), requires_grad=False)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gpt-oss' own clamped SwiGLU (``GptOssExperts._apply_gate``) on ``[gate | up]`` columns."""
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        gate, up = gate_up.chunk(2, dim=-1)
        return GptOssExperts._apply_gate(self, torch.stack((gate, up), dim=-1).flatten(-2))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """``sum_k w_k * (W2 gpt_oss_swiglu(W13 x + b13) + b2)`` on the dequantized weights (PyTorch)."""
        w13, w2 = self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2)
        activation = GatedActivation("clamped_swiglu", self.limit, self.alpha, 1.0)
        return moe_lora_forward_torch(hidden_states, w13, w2, top_k_weights, top_k_index, None, None,
                                      activation=activation, w13_bias=self.gate_up_proj_bias,
                                      w2_bias=self.down_proj_bias)


def _experts_view(name: str, module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """What attach checks and serves: the module itself, the experts of a routed block, or MXFP4 experts
    dequantized into ``dtype``."""
    if _is_mxfp4_packed(module):
        return _DequantizedMxfp4Experts(name, module, dtype)
    return _RoutedBlockExperts(module) if _is_routed_block(module) else module


def _model_module(view: nn.Module) -> nn.Module:
    """The model's own module behind an experts view (its parameters and children stay the model's)."""
    if isinstance(view, _RoutedBlockExperts):
        return view.block
    return view.packed if isinstance(view, _DequantizedMxfp4Experts) else view


def _expert_set_of(name: str, lid: int) -> str:
    """The experts module's path inside its decoder layer (``"mlp.experts"``, ``"mlp.text_moe.experts"``)."""
    return name.rpartition(f"layers.{lid}.")[2]


# Expert sets chosen per token by a token-type mask (ERNIE-4.5-VL): the sparse block's attribute name ->
# whether it takes the tokens the mask marks (vision) or the others (text). The MoE block that holds them
# takes the mask as this forward argument and, without a marked token, runs every token through the
# unmarked set.
_TOKEN_TYPE_SETS = {"text_moe": False, "vision_moe": True}
_TOKEN_TYPE_ARG = "moe_mm_token_type_ids"


class _TokenTypes:
    """The token-type mask the MoE block of one layer got for its current forward (read by its expert
    sets' modules). Set by a forward pre-hook on the block."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None

    def record(self, block: nn.Module, args: tuple, kwargs: dict) -> None:
        mask = kwargs.get(_TOKEN_TYPE_ARG, args[1] if len(args) > 1 else None)
        self.mask = mask if isinstance(mask, torch.Tensor) else None

    def rows_of(self, marked: bool) -> torch.Tensor | None:
        """Which of the block's tokens (flattened, batch-major) the set taking the ``marked`` tokens gets:
        a bool tensor, or None where it gets them all (no token marked: the block's text-only branch). The
        block's own test of the mask reads it on the host too."""
        if self.mask is None or not bool(self.mask.any()):
            return None
        marked_rows = self.mask.reshape(-1).bool()
        return marked_rows if marked else ~marked_rows


def _token_type_block(model: nn.Module, name: str) -> tuple[nn.Module, bool]:
    """(the MoE block holding the expert set ``name`` among others, whether the set takes the marked
    tokens); UnsupportedModelError where the layer's sets are not chosen by a token-type mask."""
    sparse_name, _, _ = name.rpartition(".")
    block_name, _, set_attr = sparse_name.rpartition(".")
    block = model.get_submodule(block_name) if block_name else model
    try:
        takes_arg = _TOKEN_TYPE_ARG in inspect.signature(block.forward).parameters
    except (TypeError, ValueError):
        takes_arg = False
    if set_attr not in _TOKEN_TYPE_SETS or not takes_arg:
        raise UnsupportedModelError(
            f"experts module {name!r} is one of several expert sets in its layer, chosen by something other "
            f"than a token-type mask ({', '.join(_TOKEN_TYPE_SETS)} of a block taking {_TOKEN_TYPE_ARG}, "
            "ERNIE-4.5-VL): moelora cannot tell which tokens each set gets"
        )
    return block, _TOKEN_TYPE_SETS[set_attr]


def find_experts_modules(model: nn.Module) -> list[tuple[str, int, nn.Module]]:
    """The fused routed-experts modules of ``model``: ``(qualified name, layer id, module)`` per MoE layer,
    in model order.

    A module qualifies when it has 3-D ``gate_up_proj`` and ``down_proj`` tensors (transformers 5). The
    layer id is the model's own decoder-layer index, the last ``layers.{n}`` in the module's name (as in
    PEFT keys); a layer with several expert sets (ERNIE-4.5-VL's text and vision experts) lists each.
    Raises :class:`UnsupportedModelError` when a module has no layer index, modules of two decoder stacks
    share one, or the model is already wrapped by PEFT or attached.
    """
    found: list[tuple[str, int, nn.Module]] = []
    seen: dict[int, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, MoELoRAExperts):
            raise ValueError(f"{name} is already a MoELoRAExperts: this model is attached; detach() first")
        if not _is_fused_experts(module) and not _is_routed_block(module) and not _is_mxfp4_packed(module):
            continue
        ids = _LAYER_RE.findall(name)
        if not ids:
            raise UnsupportedModelError(
                f"experts module {name!r} ({type(module).__name__}) has no 'layers.<n>' in its name, so its "
                "layer index (as in PEFT keys) is unknown"
            )
        lid = int(ids[-1])
        if lid in seen and seen[lid].partition(f"layers.{lid}.")[0] != name.partition(f"layers.{lid}.")[0]:
            raise UnsupportedModelError(
                f"experts modules {seen[lid]!r} and {name!r} share the layer index {lid}: the adapter keys "
                "('layers.<n>...experts') would be ambiguous; attach to the sub-model that holds one decoder "
                "stack"
            )
        seen.setdefault(lid, name)
        found.append((name, lid, module))
    return found


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


def _dense_form(module: nn.Module) -> bool:
    """Experts whose ``forward(hidden_states)`` takes every expert's inputs stacked, ``(E * M, H)``, already
    scaled by the routing scores (Llama-4: zero rows for the experts a token is not routed to), and
    returns ``(E * M, H)`` for its caller to sum. They multiply ``x @ W``: their weights are stored
    transposed, ``(E, H, 2I)`` / ``(E, I, H)``, without an ``is_transposed`` flag."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 1 and not any(p.kind == p.VAR_POSITIONAL for p in params)


def _transposed(module: nn.Module) -> bool:
    """Weights stored ``(E, H, 2I)`` / ``(E, I, H)``: ``is_transposed`` (Aria, gpt-oss) or the dense form."""
    return bool(getattr(module, "is_transposed", False)) or _dense_form(module)


def _post_expert_norm(module: nn.Module) -> nn.Module | None:
    """The norm each expert's output goes through before its routing weight (MuSE-Spark), or None."""
    norm = getattr(module, "post_expert_norm", None)
    return norm if getattr(module, "has_post_expert_norm", False) and isinstance(norm, nn.Module) else None


def _per_pair(run: Any, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              norm: nn.Module) -> torch.Tensor:
    """``sum_k w_k * norm(y_k)``: ``run(rows, ones, ids)`` gives each routed pair's expert output ``y``
    (the pairs as top-1 rows, token-major, weight 1); the norm runs on them, then the weighted top-k sum.
    No host sync."""
    m, top_k = ids.shape
    rows = x.repeat_interleave(top_k, dim=0)
    y = run(rows, torch.ones(m * top_k, 1, device=x.device, dtype=weights.dtype), ids.reshape(-1, 1))
    y = norm(y).reshape(m, top_k, -1)
    return (y * weights.to(y.dtype)[..., None]).sum(dim=1).to(x.dtype)


def _identity_experts(module: nn.Module) -> int:
    """Router ids past the FFN experts that are identity experts (LongCat-Flash's zero-computation
    experts: ``out += w * x``): the extra experts ``gate_up_proj`` holds beyond ``down_proj``'s."""
    w13 = getattr(module, _gate_up_name(module))
    return max(0, int(w13.shape[0]) - int(module.down_proj.shape[0]))


def _storage_of(module: nn.Module) -> str:
    """The experts' storage in words, as the coverage table lists it."""
    parts = ["ungated up_proj" if _gate_up_name(module) == "up_proj" else "gate_up_proj"]
    if isinstance(module, _DequantizedMxfp4Experts):
        parts.append("MXFP4 (dequantized at attach)")
    if getattr(module, "adapter_gate_up_interleaved", not getattr(module, "is_concatenated", True)):
        parts.append("interleaved gate/up")
    if _transposed(module):
        parts.append("transposed")
    if any(b is not None for b in _raw_biases(module)):
        parts.append("biases")
    if _identity_experts(module):
        parts.append(f"{_identity_experts(module)} identity experts")
    if _post_expert_norm(module) is not None:
        parts.append("post-expert norm")
    return ", ".join(parts)


def _canonical_gate_up(module: nn.Module, t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` (a gate_up weight or bias) with its FFN experts' gate rows first and up rows second along
    ``dim``: itself (or a view) for ``[gate; up]`` storage, a copy for interleaved columns (gpt-oss) or an
    ungated up projection (Nemotron-H: the up rows stand as the gate rows too, ``relu(u) * u``)."""
    t = t[: module.down_proj.shape[0]]  # LongCat-Flash: no rows of identity experts
    if _gate_up_name(module) == "up_proj":
        return torch.cat((t, t), dim=dim)
    if not getattr(module, "is_concatenated", True):
        return _deinterleaved(t, dim)
    return t


def _halves_view(module: nn.Module) -> bool:
    """Whether the layer reads gate/up other than as the parameter's own rows (interleaved or ungated)."""
    return _gate_up_name(module) == "up_proj" or not getattr(module, "is_concatenated", True)


def _expert_shape(module: nn.Module) -> tuple[int, int, int]:
    """``(E, 2I, H)`` of the layer's gate/up weight (FFN experts only)."""
    e, h, i = (int(d) for d in module.down_proj.shape)
    if _transposed(module):  # (E, I, H)
        h, i = i, h
    return e, 2 * i, h


def _expert_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up_proj`` and ``down_proj`` as the layer reads them: ``(E, 2I, H)`` (gate rows, then up rows)
    or a ``(E, 2, I, H)`` halves view of it (``triton_ops.moe_inputs.is_gate_up_halves``), and
    ``(E, H, I)``. Views of the parameters for transposed storage (``is_transposed``: Aria, gpt-oss; or
    unflagged, Llama-4), identity experts' rows left out (LongCat-Flash) and an ungated up projection
    (Nemotron-H: both halves read the same rows, stride 0); interleaved gate/up columns (gpt-oss) are
    de-interleaved into one copy of gate/up, in the storage's orientation."""
    w13, w2 = getattr(module, _gate_up_name(module)), module.down_proj
    if not getattr(module, "is_concatenated", True):
        # A halves view of interleaved columns reads gate and up at stride 2: 6-8x the time of GEMM1's
        # contiguous reads (benchmarks/results/bench_layouts_NVIDIA_H200.json). One copy with the gate
        # columns (rows) first, in the storage's own orientation, costs the gate/up weights once more.
        w13 = _deinterleaved(w13, dim=2 if _transposed(module) else 1)
    if _transposed(module):
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    w13 = w13[: w2.shape[0]]  # LongCat-Flash: no rows of identity experts
    if _gate_up_name(module) == "up_proj":
        return w13.unsqueeze(1).expand(-1, 2, -1, -1), w2
    return w13, w2


def _expert_biases(module: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The experts' biases as ``(E, 2I)`` (gate then up) and ``(E, H)``, or None where there are none."""
    gate_up = getattr(module, f"{_gate_up_name(module)}_bias", None)
    down = getattr(module, "down_proj_bias", None)
    gate_up = _canonical_gate_up(module, gate_up, dim=1) if isinstance(gate_up, torch.Tensor) else None
    return gate_up, down if isinstance(down, torch.Tensor) else None


def _expert_layout(module: nn.Module) -> ExpertParamLayout:
    """How the PEFT ``target_parameters`` LoRA of this module's parameters maps onto the pool's rows."""
    identity = _identity_experts(module)
    return ExpertParamLayout(
        gate_up_interleaved=getattr(module, "adapter_gate_up_interleaved",
                                    not getattr(module, "is_concatenated", True)),
        gate_up_experts=int(module.down_proj.shape[0]) + identity if identity else None,
        up_only=_gate_up_name(module) == "up_proj",
        unflagged_transposed=_transposed(module) and not getattr(module, "is_transposed", False),
    )


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


def _raw_biases(module: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The module's own gate/up (or up) and down bias tensors, as stored."""
    found = (getattr(module, f"{_gate_up_name(module)}_bias", None), getattr(module, "down_proj_bias", None))
    return tuple(b if isinstance(b, torch.Tensor) else None for b in found)


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


def _activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in beside its FP8 experts: its input embeddings' (else bfloat16)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    dtype = getattr(getattr(embeddings, "weight", None), "dtype", None)
    return dtype if dtype in _POOL_DTYPES else torch.bfloat16


def _sharding_of(name: str, module: nn.Module, model: nn.Module) -> tuple[MoEShard, object] | None:
    """(this rank's :class:`MoEShard`, the process group to all-reduce over) of an experts module that
    transformers sharded with one of its plans, None for plain tensors:

    - tensor parallel (``packed_colwise`` gate_up_proj: each rank its rows of gate, then of up; ``rowwise``
      down_proj: its columns; ``moe_tp_experts`` all-reduces over the tp group);
    - expert parallel (``grouped_gemm``: contiguous experts per rank) where the expert-parallel ranks hold
      the same batch (the ep group is the model's tp group): transformers then runs each rank's experts on
      the whole batch and all-reduces (``AllReduceEP``), which is what a moelora expert-parallel layer does.

    Raises UnsupportedModelError for any other sharding (an all-to-all expert-parallel layout among them)."""
    try:
        from torch.distributed import get_process_group_ranks
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor shards nothing
        return None
    w13, w2 = getattr(module, _gate_up_name(module)), module.down_proj
    if not isinstance(w13, DTensor) and not isinstance(w2, DTensor):
        return None
    where = f"experts module {name!r} ({type(module).__name__})"
    if not (isinstance(w13, DTensor) and isinstance(w2, DTensor)):
        raise UnsupportedModelError(f"{where}: only one of gate_up_proj and down_proj is sharded (a "
                                  "DTensor); moelora serves transformers' tensor- or expert-parallel plans, "
                                  "which shard both")
    if w13.device_mesh.ndim != 1:
        raise UnsupportedModelError(f"{where}: its expert tensors are sharded over a mesh of "
                                  f"{w13.device_mesh.ndim} dims; moelora serves transformers' 1-D tensor- or "
                                  "expert-parallel plans")
    mesh = w13.device_mesh
    size, rank, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
    e, two_i, h = w13.shape
    i = two_i // 2
    local13, local2 = tuple(w13.to_local().shape), tuple(w2.to_local().shape)
    placements = (tuple(getattr(p, "dim", None) for p in w13.placements),
                  tuple(getattr(p, "dim", None) for p in w2.placements))
    if placements == ((1,), (2,)) and i % size == 0 and local13 == (e, two_i // size, h) \
            and local2 == (e, h, i // size):
        return MoEShard(e, i, tp_rank=rank, tp_size=size), group
    if placements == ((0,), (0,)) and e % size == 0 and local13 == (e // size, two_i, h) \
            and local2 == (e // size, h, i):
        model_mesh = getattr(model, "_device_mesh", None)
        tp_ranks = None
        if model_mesh is not None and "tp" in (getattr(model_mesh, "mesh_dim_names", None) or ()):
            tp_ranks = get_process_group_ranks(model_mesh["tp"].get_group())
        if tp_ranks != get_process_group_ranks(group):
            raise UnsupportedModelError(
                f"{where}: expert parallel across ranks that hold different batches (transformers moves the "
                "tokens with an all-to-all there); moelora serves expert parallelism where the expert-"
                "parallel ranks are the tensor-parallel ones (ep_size == tp_size), combined by all-reduce")
        return MoEShard(e, i, ep_rank=rank, ep_size=size), group
    raise UnsupportedModelError(
        f"{where}: sharded as {w13.placements} / {w2.placements} with local shapes {local13} / {local2}; "
        "moelora serves transformers' tensor-parallel plan (packed_colwise gate_up_proj, rowwise down_proj) "
        "and its expert-parallel plan (grouped_gemm)")


def _identity_term(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   num_experts: int) -> torch.Tensor:
    """``sum_k w_k * x`` over the pairs routed to an identity expert (id ``>= num_experts``): LongCat-Flash's
    zero-computation experts return their input. No host sync."""
    identity = (weights * (ids >= num_experts)).sum(dim=-1, keepdim=True)
    return (identity * x).to(x.dtype)


def _dense_routing(x: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of the dense form's stacked rows (``(E * M, H)``, expert-major): row ``j`` is one pair of
    expert ``j // M`` with weight 1 (the scores already scale the rows); an all-zero row (an expert its
    token is not routed to) gets id -1, which the layer skips, since it contributes exactly zero. No host
    sync: ``(E * M, 1)`` weights and ids."""
    rows = x.shape[0]
    ids = torch.arange(num_experts, device=x.device).repeat_interleave(rows // num_experts)
    ids = ids.masked_fill(~x.ne(0).any(dim=-1), -1)
    return torch.ones(rows, 1, device=x.device, dtype=x.dtype), ids[:, None]


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


# --------------------------------------------------------------------------------------------------
# Adapter selection
# --------------------------------------------------------------------------------------------------


class _Selection:
    """One active adapter choice: names per batch row and the batch infos built for it, by token count."""

    def __init__(self, names: tuple[str | None, ...], seq_lens: tuple[int, ...] | None) -> None:
        self.names = names
        self.seq_lens = seq_lens
        self.any_adapter = any(n is not None for n in names)
        self.batches: dict[Any, MoELoRABatchInfo] = {}  # by token count (and set, copies, rows)
        self.built: dict[Any, int] = {}  # the epoch each batch was last built for
        self.epoch = 0
        self.builds = 0

    def retarget(self, other: _Selection) -> None:
        """Takes ``other``'s names and lengths for the next step; the batch infos are kept and rebuilt in
        place (``prepare_batch(..., out=)``) at their first use in that step."""
        self.names, self.seq_lens, self.any_adapter = other.names, other.seq_lens, other.any_adapter
        self.epoch += 1

    def lens_for(self, num_tokens: int) -> tuple[int, ...]:
        if self.seq_lens is not None:
            if sum(self.seq_lens) != num_tokens:
                raise ValueError(
                    f"the MoE layer got {num_tokens} tokens but seq_lens {list(self.seq_lens)} sum to "
                    f"{sum(self.seq_lens)}"
                )
            return self.seq_lens
        rows = len(self.names)
        if num_tokens % rows:
            raise ValueError(
                f"the MoE layer got {num_tokens} tokens, not a multiple of the {rows} batch rows named in "
                f"handle.adapters({list(self.names)}): give one name per batch row"
            )
        return (num_tokens // rows,) * rows

    def release(self, *, keep: bool = False) -> None:
        """Releases the batch infos' holds on their slots (and forgets them unless ``keep``)."""
        for batch in self.batches.values():
            batch.release()
        if not keep:
            self.batches.clear()
            self.built.clear()


class _Selector:
    """The handle's adapter choice, read by every swapped module of the model.

    Shared by all threads (a ``generate`` running in a worker thread, e.g. with a streamer, sees the
    context entered by the caller); one choice is active per model at a time: contexts nest, the
    innermost wins, and ``set_adapters`` gives the choice used outside any context.
    """

    def __init__(self, pools: dict[str, MoELoRAMemoryPool]) -> None:
        self.pools = pools  # expert set -> its pool; one set (the first is the primary) for most models
        self.pool = next(iter(pools.values()))
        # adapter name -> the expert sets it has LoRA in (recorded where a layer has several sets; an
        # adapter not listed is every set's)
        self.covers: dict[str, frozenset[str]] = {}
        self.lock = threading.RLock()
        self.stack: list[_Selection] = []
        self.default: _Selection | None = None

    def make(self, names: Sequence[str | None], seq_lens: Sequence[int] | None) -> _Selection:
        if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
            raise ValueError(f"adapter names must be a list with one entry per batch row, got {names!r}")
        names_t = tuple(names)
        if not names_t:
            raise ValueError("adapter names must name at least one batch row")
        bad = [n for n in names_t if n is not None and not isinstance(n, str)]
        if bad:
            raise ValueError(f"adapter names must be str or None, got {bad!r}")
        unknown = sorted({n for n in names_t
                          if n is not None and not any(n in pool for pool in self.pools.values())})
        if unknown:
            raise ValueError(f"unknown adapter(s) {unknown}; loaded adapters: {self.pool.adapters()}")
        lens_t = None
        if seq_lens is not None:
            lens_t = tuple(seq_lens)
            if len(lens_t) != len(names_t) or any(
                not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in lens_t
            ):
                raise ValueError(
                    f"seq_lens must hold one non-negative int per name ({len(names_t)}), got {list(lens_t)}"
                )
        return _Selection(names_t, lens_t)

    def active(self) -> _Selection | None:
        with self.lock:
            return self.stack[-1] if self.stack else self.default

    def batch_for(self, num_tokens: int, copies: int = 1, repeat: int = 1, *, expert_set: str | None = None,
                  token_rows: torch.Tensor | None = None) -> MoELoRABatchInfo | None:
        """The batch info of the active choice for ``num_tokens`` tokens; None = every token base. With
        ``copies`` the batch covers that many copies of those tokens one after the other (the dense form's
        rows of every expert); with ``repeat`` each token stands ``repeat`` times in a row (a row per
        routed pair). ``expert_set``: the batch of that set's pool (default the primary), where an adapter
        without LoRA in the set runs its rows as base; ``token_rows``: the set gets only these of the
        layer's tokens (a bool per token, :class:`_TokenTypes`), whose count per sequence is read on the
        host."""
        with self.lock:
            sel = self.stack[-1] if self.stack else self.default
            if sel is None or not sel.any_adapter:
                return None
            pool = self.pool if expert_set is None else self.pools[expert_set]
            names = sel.names
            if expert_set is not None and self.covers:
                names = tuple(n if n is None or expert_set in self.covers.get(n, (expert_set,)) else None
                              for n in names)
                if all(n is None for n in names):
                    return None
            if token_rows is None:
                lens = sel.lens_for(num_tokens)
                key: Any = num_tokens if copies == repeat == 1 else (num_tokens, copies, repeat)
            else:
                ends = torch.tensor(sel.lens_for(token_rows.numel()), device=token_rows.device).cumsum(0)
                counts = token_rows.long().cumsum(0)[ends - 1] if token_rows.numel() else ends * 0
                lens = tuple(int(n) for n in torch.diff(counts, prepend=counts.new_zeros(1)).tolist())
                if sum(lens) != num_tokens:
                    raise ValueError(f"the expert set {expert_set!r} got {num_tokens} tokens, its token-type "
                                     f"mask marks {sum(lens)}")
                key = ("rows", lens, copies, repeat)
            if expert_set is not None and pool is not self.pool:
                key = (expert_set, key)
            batch = sel.batches.get(key)
            if batch is None or sel.built[key] != sel.epoch or not pool.is_current(batch):
                # (Re)built: first use, or an adapter was unloaded or evicted since (rebuilt in place; an
                # unloaded one that is not in the host tier is refused here, by name).
                lens = tuple(n * repeat for n in lens) * copies
                if batch is None:
                    batch = sel.batches[key] = pool.prepare_batch(names * copies, lens)
                else:
                    pool.prepare_batch(names * copies, lens, out=batch)
                sel.built[key] = sel.epoch
                sel.builds += 1
            return batch

    def clear(self) -> None:
        with self.lock:
            for sel in self.stack:
                sel.release()
            self.stack.clear()
            if self.default is not None:
                self.default.release()
            self.default = None


# --------------------------------------------------------------------------------------------------
# The swapped module
# --------------------------------------------------------------------------------------------------


class MoELoRAExperts(nn.Module):
    """Drop-in replacement of a transformers-5 routed-experts module that adds each token's adapter.

    Holds the original module's ``gate_up_proj`` and ``down_proj`` (the same ``nn.Parameter`` objects,
    registered under the same names, so ``state_dict()`` is unchanged) and runs
    :class:`moelora.FusedMoEWithLoRA` on them with the pool's layer ``layer_id``. ``forward`` has the
    original signature ``(hidden_states (M, H), top_k_index (M, k), top_k_weights (M, k)) -> (M, H)``.
    When no adapter is selected for any token it calls the original module (exactly the base output).

    Attributes:
        layer_id: the model's own index of this MoE layer (as in PEFT keys).
        original: the module this one replaced (restored by :meth:`MoELoRAHandle.detach`).
        layer: the :class:`moelora.FusedMoEWithLoRA` (routed_scaling_factor 1: the router already
            applied it where the family has one, e.g. DeepSeek-V3).
    """

    def __init__(
        self,
        original: nn.Module,
        *,
        pool: MoELoRAMemoryPool,
        layer_id: int,
        activation: str | GatedActivation,
        path: str,
        selector: _Selector,
        cuda_graphs: bool = False,
        graph_max_tokens: int = 64,
        process_group: object | None = None,
        expert_set: str | None = None,
        token_types: _TokenTypes | None = None,
        marked_tokens: bool = False,
        base_on_kernels: bool = False,
    ) -> None:
        super().__init__()
        # Rows without adapter run the layer's kernels (True) or the model's own experts module (False).
        self.base_on_kernels = base_on_kernels
        # One of several expert sets of its layer (ERNIE-4.5-VL): its pool, and the tokens it gets.
        self.expert_set = expert_set
        object.__setattr__(self, "_token_types", token_types)
        self.marked_tokens = marked_tokens
        # The original's parameters under their own names (gate_up_proj or up_proj, down_proj, biases): the
        # same objects, so state_dict() keys and tensors are unchanged.
        source = _model_module(original)
        for pname, param in source.named_parameters(recurse=False):
            self.register_parameter(pname, param)
        for cname, child in source.named_children():  # e.g. a post-expert norm with its weight
            self.add_module(cname, child)
        self.routed_block = isinstance(original, _RoutedBlockExperts)
        # Dequantized MXFP4 experts: the packed module's forward needs the hub kernels, so the layer runs
        # the base rows too; and transformers' Mxfp4GptOssMLP sends the routes through this module's
        # forward (its router, then experts(hidden, indices, scores)) only when the experts are hooked.
        self.dequantized = isinstance(original, _DequantizedMxfp4Experts)
        if self.dequantized:
            self._is_hooked = True
        self.num_experts, two_i, self.hidden_dim = _expert_shape(original)
        self.identity_experts = _identity_experts(original)
        self.dense = _dense_form(original)
        self.post_expert_norm = _post_expert_norm(original)  # the model's own module (a child, as there)
        self.intermediate_dim = two_i // 2
        self.layer_id = int(layer_id)
        # Not registered as submodules: the original stays out of the module tree (and state_dict), and
        # the layer holds the same Parameters (its own registration of them must not add state_dict keys).
        object.__setattr__(self, "original", original)
        (w13, w2), parallel = _expert_weights(original), {}
        w13_bias, w2_bias = _expert_biases(original)
        if w13_bias is not None or w2_bias is not None:
            parallel.update(w13_bias=w13_bias, w2_bias=w2_bias)
        if process_group is not None:
            # This rank's part of gate/up and down (views of the DTensors' local shards, its I share or its
            # experts); the layer all-reduces its partial output over the group, as the plan's own
            # moe_tp_experts / AllReduceEP does for the original module.
            w13, w2 = w13.to_local().detach(), w2.to_local().detach()
            parallel = dict(process_group=process_group, reduce_results=True)
        if w13.dtype == torch.float8_e4m3fn:
            # transformers runs FP8 experts through its hub kernels; the layer serves base rows too.
            parallel["fp8"] = fp8_scales_of(original, "gate_up_proj", "down_proj")
        object.__setattr__(
            self,
            "layer",
            FusedMoEWithLoRA(
                w13, w2, pool=pool, layer_id=layer_id, routed_scaling_factor=1.0, activation=activation,
                path=path, cuda_graphs=cuda_graphs, graph_max_tokens=graph_max_tokens, **parallel,
            ),
        )
        object.__setattr__(self, "_selector", selector)

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor | None = None,
        top_k_weights: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """``sum_k w_k * W2'(act(W_gate' x) * W_up' x)`` with each token's adapter (DESIGN §1). The dense
        form (Llama-4) takes ``hidden_states`` alone, every expert's rows stacked, and returns each row's
        expert output."""
        if self.routed_block:
            return self._block_forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        hidden = hidden_states.shape[-1]
        num_tokens = hidden_states.numel() // hidden if hidden else 0
        copies = self.num_experts if self.dense else 1
        if num_tokens % copies:
            raise ValueError(f"the dense experts module got {num_tokens} rows, not {copies} experts' rows of "
                             "the same tokens")
        # With a post-expert norm the layer runs each routed pair as a row of its own (its token's adapter).
        repeat = top_k_index.shape[-1] if self.post_expert_norm is not None and top_k_index is not None else 1
        token_rows = None if self._token_types is None else self._token_types.rows_of(self.marked_tokens)
        batch = self._selector.batch_for(num_tokens // copies, copies=copies, repeat=repeat,
                                         expert_set=self.expert_set, token_rows=token_rows)
        # Outside any adapter context the model is the model: its own experts module, whatever base_experts.
        if ((batch is None or not batch.has_lora) and self.layer.fp8 is None and not self.dequantized
                and (not self.base_on_kernels or self._selector.active() is None)):
            if self.dense:
                return self.original(hidden_states, *args, **kwargs)
            return self.original(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        if self.dense and (top_k_index is not None or top_k_weights is not None):
            raise TypeError(f"{type(self.original).__name__}.forward takes hidden_states alone (the dense "
                            "form)")
        if args or kwargs:
            raise TypeError(
                f"MoELoRAExperts.forward takes (hidden_states, top_k_index, top_k_weights) only, got extra "
                f"{len(args)} positional and {sorted(kwargs)} keyword arguments"
            )
        hidden_states, top_k_index, top_k_weights = (t.to_local() if hasattr(t, "to_local") else t
                                                     for t in (hidden_states, top_k_index, top_k_weights))
        x = hidden_states.reshape(num_tokens, hidden)
        if self.dense:
            weights, ids = _dense_routing(x, self.num_experts)
        else:
            weights, ids = top_k_weights.reshape(num_tokens, -1), top_k_index.reshape(num_tokens, -1)
        lora_batch = batch if batch is not None and batch.has_lora else None
        if self.post_expert_norm is not None:
            def run(rows: torch.Tensor, w: torch.Tensor, pair_ids: torch.Tensor) -> torch.Tensor:
                return self.layer(rows, w, pair_ids, lora_batch)

            out = _per_pair(run, x, ids, weights, self.post_expert_norm)
        else:
            out = self.layer(x, weights, ids, lora_batch)
        if self.identity_experts:  # the layer skips ids past its experts; they return their input
            out = out + _identity_term(x, ids, weights.to(out.dtype), self.num_experts)
        return out.reshape(hidden_states.shape)

    def _block_forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """A routed block's forward (JetMoE): its router, then the experts with each token's adapter, then
        its output bias."""
        block = self.original.block
        hidden = hidden_states.shape[-1]
        num_tokens = hidden_states.numel() // hidden if hidden else 0
        batch = self._selector.batch_for(num_tokens)
        if batch is None or not batch.has_lora:
            return block(hidden_states, *(a for a in args if a is not None), **kwargs)
        if any(a is not None for a in args) or kwargs:
            raise TypeError(f"{type(block).__name__}.forward takes the hidden states alone")
        x = hidden_states.reshape(num_tokens, hidden)
        weights, ids = self.original.route(x)
        out = self.layer(x, weights, ids, batch) + block.bias
        return out.reshape(hidden_states.shape)

    def extra_repr(self) -> str:
        return (
            f"{type(self.original).__name__}, layer_id={self.layer_id}, experts={self.num_experts}, "
            f"hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
            f"activation={self.layer.activation}, path={self.layer.path}"
        )


# --------------------------------------------------------------------------------------------------
# Handle
# --------------------------------------------------------------------------------------------------


def _rows_of(args: tuple, kwargs: dict) -> int | None:
    for key in ("input_ids", "inputs_embeds"):
        t = kwargs.get(key)
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return int(t.shape[0])
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2:
        return int(args[0].shape[0])
    return None


class MoELoRAHandle:
    """What :func:`attach` returns: the pool, the swapped modules, adapter loading and selection.

    Attributes:
        model: the attached model.
        pool: the :class:`moelora.MoELoRAMemoryPool` (created by ``attach`` unless one was given); of the
            first expert set where a layer holds several.
        pools: expert set (the experts module's path in its layer, ``"mlp.experts"``) -> its pool: one
            entry, ``pool``, unless a layer holds several expert sets (ERNIE-4.5-VL: text and vision).
        modules: layer id -> :class:`MoELoRAExperts` now in the model (of the first expert set).
        module_names: layer id -> qualified module name (of the first expert set).
        expert_sets: expert set -> layer id -> its :class:`MoELoRAExperts`.
    """

    def __init__(
        self,
        model: nn.Module,
        pools: dict[str, MoELoRAMemoryPool],
        sites: list[tuple[str, int, nn.Module, nn.Module, str]],
        modules: dict[str, MoELoRAExperts],
        selector: _Selector,
        owns_pool: bool,
        hooks: Sequence[Any] = (),
    ) -> None:
        self.model = model
        self.pools = dict(pools)
        self.pool = next(iter(self.pools.values()))
        self.expert_sets: dict[str, dict[int, MoELoRAExperts]] = {name: {} for name in self.pools}
        for name, lid, *_ in sites:
            self.expert_sets[_expert_set_of(name, lid)][lid] = modules[name]
        primary = next(iter(self.pools))
        self.modules = dict(self.expert_sets[primary])
        self.module_names = {lid: name for name, lid, *_ in sites if _expert_set_of(name, lid) == primary}
        self._sites = sites  # (name, layer id, parent, original, attribute in parent)
        self._selector = selector
        self._step_selection: _Selection | None = None  # the one :meth:`step` keeps across steps
        self._owns_pool = owns_pool
        self._hooks = [model.register_forward_pre_hook(self._check_rows, with_kwargs=True), *hooks]
        self._loader: ThreadPoolExecutor | None = None  # loads into several pools, in the background
        self._attached = True

    # ---------------------------------------------------------------------------------------------- info

    @property
    def attached(self) -> bool:
        """False after :meth:`detach`."""
        return self._attached

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """The model's MoE layer indices, ascending."""
        return tuple(sorted(self.modules))

    @property
    def active_adapters(self) -> tuple[str | None, ...] | None:
        """The names per batch row in effect now (innermost context, else ``set_adapters``), or None."""
        sel = self._selector.active()
        return None if sel is None else sel.names

    def __repr__(self) -> str:
        state = "attached" if self._attached else "detached"
        return f"MoELoRAHandle({state}, layers={list(self.layer_ids)}, pool={self.pool!r})"

    # ---------------------------------------------------------------------------------------------- adapters

    def load_adapter(self, name: str, path: str | Path) -> object:
        """Loads a PEFT adapter directory into the pool (``MoELoRAMemoryPool.load_adapter``) and returns
        its report. Only the routed-expert LoRA is served: if the adapter also has LoRA weights elsewhere
        (attention, shared experts, dense MLPs, ``modules_to_save``) a warning names them, since outputs
        will then differ from PEFT's for that adapter.

        Where a layer holds several expert sets (:attr:`pools`), the adapter is loaded into the pool of
        each set it has LoRA in (a set it has none in runs its rows as the base model) and the reports
        come back as a dict by set; if one load fails, the others are undone (every pool as before)."""
        if len(self.pools) == 1:
            report = self.pool.load_adapter(name, path)
            self._warn_ignored(name, [report])
            return report
        with self._selector.lock:
            held = [set_name for set_name, pool in self.pools.items() if name in pool]
            if held:
                raise ValueError(f"adapter {name!r} is already loaded (expert sets {held}); unload it first")
            modules = lora_module_names(path)
            sets = [s for s in self.pools if any(in_expert_set(m, s) for m in modules)]
            sets = sets or [next(iter(self.pools))]  # none: the first pool's load says what is wrong
            reports: dict[str, object] = {}
            try:
                for set_name in sets:
                    reports[set_name] = self.pools[set_name].load_adapter(name, path)
            except BaseException:
                for set_name in reports:
                    self.pools[set_name].unload_adapter(name)
                raise
            self._selector.covers[name] = frozenset(sets)
        self._warn_ignored(name, list(reports.values()))
        return reports

    def _warn_ignored(self, name: str, reports: Sequence[object]) -> None:
        ignored: dict[str, str] = {}
        for report in reports:
            ignored.update(getattr(report, "ignored_keys", None) or {})
        keys = sorted(k for k, why in ignored.items() if not str(why).startswith(OTHER_EXPERT_SET))
        if keys:
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            warnings.warn(
                f"adapter {name!r}: {len(keys)} tensor(s) outside the routed experts are not applied "
                f"({', '.join(keys[:3])}{more}); this adapter's outputs will differ from PEFT's",
                UserWarning,
                stacklevel=3,
            )

    def load_adapter_async(self, name: str, path: str | Path) -> Future:
        """``MoELoRAMemoryPool.load_adapter_async``: loads in a background thread, returns a Future. With
        several expert sets, :meth:`load_adapter` runs in a background thread of the handle."""
        if len(self.pools) == 1:
            return self.pool.load_adapter_async(name, path)
        if self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moelora-sets-load")
        return self._loader.submit(self.load_adapter, name, path)

    def unload_adapter(self, name: str) -> None:
        """``MoELoRAMemoryPool.unload_adapter`` (refused for a pinned adapter), from every pool that holds
        it. A selection that names it is refused at its next forward, unless the adapter is still in the
        host tier."""
        if len(self.pools) == 1:
            self.pool.unload_adapter(name)
            return
        with self._selector.lock:
            holding = [pool for pool in self.pools.values() if name in pool]
            if not holding:
                self.pool.unload_adapter(name)  # refuses the unknown name, worded as the pool words it
            if any(pool.is_pinned(name) for pool in holding):  # before any pool lets it go
                raise ValueError(f"adapter {name!r} is pinned; unpin it before unloading")
            for pool in holding:
                pool.unload_adapter(name)
            self._selector.covers.pop(name, None)

    @contextlib.contextmanager
    def adapters(
        self, names: Sequence[str | None], seq_lens: Sequence[int] | None = None
    ) -> Iterator[MoELoRAHandle]:
        """Selects one adapter per batch row (``None`` = base model) for forwards and ``generate`` inside
        the ``with`` block.

        Args:
            names: one entry per batch row, in batch order. A ``generate`` that expands rows in place
                (``num_return_sequences``, beams) applies each name to its row's copies.
            seq_lens: only for packed (padding-free) inputs: tokens per sequence in the flattened order;
                every forward in the block must then have ``sum(seq_lens)`` tokens.

        Contexts nest (the innermost wins). The batch infos built inside are released on exit.
        """
        self._require_attached()
        with self._active(self._selector.make(names, seq_lens), keep=False):
            yield self

    @contextlib.contextmanager
    def step(self, names: Sequence[str | None], seq_lens: Sequence[int] | None = None
             ) -> Iterator[MoELoRAHandle]:
        """Like :meth:`adapters`, for a serving loop's steps: one selection lives across steps, and its
        batch infos (one per token count) are rebuilt in place each step (``prepare_batch(..., out=)``)
        instead of allocated. On exit they release their slots, so between steps nothing keeps an
        adapter from LRU eviction. One serving loop per handle: its steps do not nest or overlap."""
        self._require_attached()
        fresh = self._selector.make(names, seq_lens)
        with self._selector.lock:
            if self._step_selection is None:
                self._step_selection = fresh
            else:
                self._step_selection.retarget(fresh)
        with self._active(self._step_selection, keep=True):
            yield self

    @contextlib.contextmanager
    def _active(self, sel: _Selection, *, keep: bool) -> Iterator[None]:
        """``sel`` is the innermost choice inside the block; its batch infos release their slots on exit
        (and are forgotten unless ``keep``)."""
        with self._selector.lock:
            self._selector.stack.append(sel)
        try:
            yield
        finally:
            with self._selector.lock:
                if sel in self._selector.stack:
                    self._selector.stack.remove(sel)
                sel.release(keep=keep)

    def set_adapters(self, names: Sequence[str | None] | None, seq_lens: Sequence[int] | None = None) -> None:
        """Like :meth:`adapters`, but in effect until changed (``None`` = base model again) outside any
        ``with handle.adapters(...)`` block."""
        self._require_attached()
        sel = None if names is None else self._selector.make(names, seq_lens)
        with self._selector.lock:
            if self._selector.default is not None:
                self._selector.default.release()
            self._selector.default = sel

    def batch_infos_built(self) -> int:
        """How many batch infos the active selection has built (one per distinct token count)."""
        sel = self._selector.active()
        return 0 if sel is None else sel.builds

    # ---------------------------------------------------------------------------------------------- detach

    def detach(self) -> None:
        """Puts the original experts modules back (the model computes exactly what it did before attach),
        removes the forward pre-hook and releases the active selections. The pool stays usable through
        :attr:`pool`; a pool created by :func:`attach` has its loader thread stopped. Idempotent."""
        if not self._attached:
            return
        self._selector.clear()
        if self._step_selection is not None:
            self._step_selection.release()
            self._step_selection = None
        for _, _, parent, original, attr in self._sites:
            setattr(parent, attr, original)
        for hook in self._hooks:
            hook.remove()
        self._attached = False
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        if self._owns_pool:
            for pool in self.pools.values():
                pool.close()

    def __enter__(self) -> MoELoRAHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # ---------------------------------------------------------------------------------------------- internals

    def _require_attached(self) -> None:
        if not self._attached:
            raise RuntimeError("this MoELoRAHandle is detached")

    def _check_rows(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        sel = self._selector.active()
        if sel is None or not sel.any_adapter or sel.seq_lens is not None:
            return
        rows = _rows_of(args, kwargs)
        if rows is not None and rows % len(sel.names):
            raise ValueError(
                f"the model got a batch of {rows} rows but handle.adapters names {len(sel.names)} "
                f"({list(sel.names)}): give one name per batch row"
            )


# --------------------------------------------------------------------------------------------------
# attach
# --------------------------------------------------------------------------------------------------


def attach(
    model: nn.Module,
    pool: MoELoRAMemoryPool | None = None,
    *,
    max_loras: int = 8,
    max_rank: int = 64,
    max_cpu_loras: int = 0,
    path: str = "auto",
    verify: bool | None = None,
    cuda_graphs: bool = True,
    graph_max_tokens: int = 64,
    base_experts: str = "auto",
) -> MoELoRAHandle:
    """Swaps every routed-experts module of a transformers-5 MoE ``model`` for a :class:`MoELoRAExperts`
    and returns the :class:`MoELoRAHandle`.

    Args:
        model: a transformers-5 MoE model (``...ForCausalLM`` or its decoder), on its final device and
            dtype (the pool is created there; move the model before attaching).
        pool: an existing pool to use; it must match the experts' E, H, I, dtype and hold every MoE layer
            id. ``None``: a :class:`moelora.MoELoRAMemoryPool` is created from the expert tensors
            (E, H, I, the model's MoE layer ids, their dtype and device).
        max_loras, max_rank, max_cpu_loras: sizes of the created pool (ignored with ``pool``).
        path: ``FusedMoEWithLoRA`` path ("auto", "fused", "split", "staged", "torch").
        verify: run each experts module against the §1 formula on random tokens before swapping it;
            ``None`` (default): only for classes not in :data:`KNOWN_EXPERTS_CLASSES` and not
            transformers' ``FP8Experts`` (whose forward needs transformers' hub kernels to run).
        cuda_graphs: each MoE layer replays its forward from a CUDA graph per token count of at most
            ``graph_max_tokens`` (default 64: decode steps, every one after the first two of a batch size;
            prompts run eagerly, so each prompt length does not keep buffers of its own in every layer),
            instead of planning and launching its kernels on every call
            (``FusedMoEWithLoRA(cuda_graphs=True)``); ``False``: eager.
        base_experts: what runs a step inside an adapter context in which no row has an adapter (a
            server's step of base-model requests): ``"kernels"`` (the layer's fused MoE, as rows with
            adapters do), ``"model"`` (the model's own experts module: exactly the model's numbers), or
            ``"auto"`` (default): the kernels on CUDA, where they are faster than transformers' own experts
            loop, the model's module elsewhere. Outside any adapter context the model's own module runs.

    Raises:
        UnsupportedModelError: a MoE layer that cannot be served exactly (the message says why), or no fused
            experts module at all. Nothing is swapped then.
        ValueError: a pool that does not fit, an unknown path, or a model already attached.
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if base_experts not in ("auto", "kernels", "model"):
        raise ValueError(f"base_experts must be 'auto', 'kernels' or 'model', got {base_experts!r}")
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "base_layer"):
            raise UnsupportedModelError(
                f"{type(model).__name__} is wrapped by PEFT ({name or 'the model'} is a "
                f"{type(module).__name__}); attach to the plain base model and load the adapters with "
                "handle.load_adapter"
            )
    found = find_experts_modules(model)
    if not found:
        stacked = next((n for n, m in model.named_modules()
                        if all(isinstance(getattr(m, w, None), torch.Tensor) and getattr(m, w).dim() == 2
                               for w in ("w1", "v1", "w2"))), None)
        if stacked is not None:
            raise UnsupportedModelError(
                f"{type(model).__name__} stores its experts as stacked 2-D matrices ({stacked!r}: w1, v1, w2 "
                "(E*I, H), DBRX) that no fused routed-experts module holds; not supported")
        raise UnsupportedModelError(
            f"{type(model).__name__} has no fused routed-experts module (gate_up_proj (E, 2I, H) and "
            "down_proj (E, H, I) parameters, transformers 5); experts as one module each (nn.Linear pairs, "
            "transformers 4 and the encoder-decoder Switch Transformers / NLLB-MoE) and dense models are not "
            "supported"
        )
    sites: list[tuple[str, int, nn.Module, nn.Module, str]] = []
    activations: dict[str, str | GatedActivation] = {}
    parallel: dict[str, tuple[int, int, object] | None] = {}
    views: dict[str, nn.Module] = {}
    for name, lid, block in found:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if _is_mxfp4_packed(block) and type(parent).__name__ != "Mxfp4GptOssMLP":  # before dequantizing
            raise UnsupportedModelError(
                f"experts module {name!r}: MXFP4 experts under a {type(parent).__name__}, not transformers' "
                "Mxfp4GptOssMLP (which sends its routes through the experts' forward once they are swapped): "
                "this transformers runs them through its hub kernels' routing; load the model with "
                "quantization_config=Mxfp4Config(dequantize=True) and attach that"
            )
        module = views[name] = _experts_view(name, block, _activation_dtype(model))
        activations[name] = _check_supported(name, module, parent)
        parallel[name] = _sharding_of(name, module, model)
        if parallel[name] is None and getattr(module, "_is_expert_parallel", False):
            raise UnsupportedModelError(f"experts module {name!r} ({type(module).__name__}) is marked "
                                      "expert-parallel but its tensors are not DTensors moelora can read the "
                                      "shard of")
        known = (type(module).__name__ in KNOWN_EXPERTS_CLASSES or type(module).__name__ == _FP8_EXPERTS_CLASS
                 or isinstance(module, _DequantizedMxfp4Experts))  # its forward is the layer's torch path
        if parallel[name] is None and (verify or (verify is None and not known)):
            _verify_math(name, module, activations[name])
        sites.append((name, lid, parent, block, attr))
    layouts = {p[0] if p else None for p in parallel.values()}
    if len(layouts) > 1:
        raise UnsupportedModelError(f"MoE layers sharded differently ({sorted(map(str, layouts))}); one pool "
                                  "holds one layout")
    sharding = next(iter(parallel.values()))
    group = sharding[1] if sharding is not None else None

    # The expert sets: one for most models; a layer may hold several, chosen per token by a token-type mask
    # (ERNIE-4.5-VL's text and vision experts), each served from a pool of its own (its own I).
    expert_sets: dict[str, list[str]] = {}
    for name, lid, _ in found:
        expert_sets.setdefault(_expert_set_of(name, lid), []).append(name)
    several = len(expert_sets) > 1
    token_types: dict[int, tuple[nn.Module, _TokenTypes]] = {}
    marked: dict[str, bool] = {}
    if several:
        if pool is not None:
            raise ValueError(f"the model's layers hold {len(expert_sets)} expert sets "
                             f"({', '.join(expert_sets)}) served from a pool each: attach creates them, give "
                             "no pool")
        if sharding is not None:
            raise UnsupportedModelError("several expert sets per layer are served unsharded")
        for name, lid, _ in found:
            block, marked[name] = _token_type_block(model, name)
            if lid not in token_types:
                token_types[lid] = (block, _TokenTypes())

    pools: dict[str, MoELoRAMemoryPool] = {}
    owns_pool = pool is None
    try:
        _make_pools(pools, pool, expert_sets, views, found, several, sharding, model, max_loras, max_rank,
                    max_cpu_loras)
        selector = _Selector(pools)
        modules: dict[str, MoELoRAExperts] = {}
        for name, lid, _parent, _module, _attr in sites:  # build all before swapping any
            set_name = _expert_set_of(name, lid)
            modules[name] = MoELoRAExperts(
                views[name], pool=pools[set_name], layer_id=lid, activation=activations[name], path=path,
                selector=selector, cuda_graphs=cuda_graphs, graph_max_tokens=graph_max_tokens,
                process_group=group, expert_set=set_name if several else None,
                token_types=token_types[lid][1] if several else None, marked_tokens=marked.get(name, False),
                base_on_kernels=base_experts == "kernels" or (
                    base_experts == "auto" and pools[set_name].device.type == "cuda"),
            )
    except BaseException:
        if owns_pool:
            for created in pools.values():
                created.close()
        raise
    for name, _lid, parent, _module, attr in sites:
        setattr(parent, attr, modules[name])
    hooks = [block.register_forward_pre_hook(types.record, with_kwargs=True)
             for block, types in token_types.values()]
    return MoELoRAHandle(model, pools, sites, modules, selector, owns_pool, hooks)


def _shard_layout(shard: MoEShard | None) -> tuple | None:
    return None if shard is None else (shard.tp_rank, shard.tp_size, shard.experts)


def _make_pools(pools: dict[str, MoELoRAMemoryPool], pool: MoELoRAMemoryPool | None,
                expert_sets: dict[str, list[str]], views: dict[str, nn.Module],
                found: list[tuple[str, int, nn.Module]], several: bool,
                sharding: tuple[MoEShard, object] | None, model: nn.Module, max_loras: int, max_rank: int,
                max_cpu_loras: int) -> None:
    """Fills ``pools`` (expert set -> pool): each set's experts checked for one shape, dtype, device and
    layout; a pool created per set, or the given ``pool`` checked against the one set."""
    shard = sharding[0] if sharding is not None else None
    for set_name, names in expert_sets.items():
        first = views[names[0]]
        shape, dtype, device = _expert_shape(first), first.down_proj.dtype, first.down_proj.device
        layout = _expert_layout(first)
        if several:
            layout = dataclasses.replace(layout, expert_set=set_name)
        fp8 = dtype == torch.float8_e4m3fn
        if fp8 and sharding is not None:
            raise UnsupportedModelError("FP8 experts sharded by a tensor- or expert-parallel plan are not "
                                        "served yet (their block scales would need sharding too)")
        for name in names[1:]:
            module = views[name]
            w2 = module.down_proj
            if _expert_shape(module) != shape:
                raise UnsupportedModelError(
                    f"MoE layers of different shapes ({names[0]}: {shape}, {name}: {_expert_shape(module)}); "
                    "one pool holds one (E, H, I)"
                )
            if w2.dtype != dtype or w2.device != device:
                raise UnsupportedModelError(
                    f"experts on different dtypes/devices ({names[0]}: {dtype} {device}, {name}: {w2.dtype} "
                    f"{w2.device}); the pool lives on one device with one dtype"
                )
            if _expert_layout(module) != _expert_layout(first):
                raise UnsupportedModelError(
                    f"MoE layers stored differently ({names[0]}: {_storage_of(first)}, {name}: "
                    f"{_storage_of(module)}); one pool reads one adapter layout"
                )
        num_experts, two_i, hidden = shape
        layer_ids = [lid for name, lid, _ in found if name in names]
        if pool is None:
            pools[set_name] = MoELoRAMemoryPool(
                num_experts=num_experts, hidden_size=hidden, intermediate_size=two_i // 2,
                layer_ids=layer_ids, max_loras=max_loras, max_rank=max_rank,
                dtype=_activation_dtype(model) if fp8 else dtype, device=device, max_cpu_loras=max_cpu_loras,
                shard=shard, expert_layout=layout,
            )
            continue
        got = (pool.num_experts, pool.hidden_size, pool.intermediate_size)
        want = (num_experts, hidden, two_i // 2) if shard is None else (
            shard.local_num_experts, hidden, shard.local_intermediate_size)
        if got != want or _shard_layout(pool.shard) != _shard_layout(shard):
            raise ValueError(f"the pool has (E, H, I) = {got} (shard {pool.shard}), the model's experts on "
                             f"this rank {want} (shard {shard})")
        if pool.expert_layout != layout:
            raise ValueError(f"the pool reads adapters as {pool.expert_layout}, the model's experts need "
                             f"{layout} ({_storage_of(first)})")
        missing = [lid for lid in layer_ids if lid not in pool.layer_ids]
        if missing:
            raise ValueError(
                f"the pool has no buffers for MoE layers {missing} (pool layer_ids {list(pool.layer_ids)})"
            )
        pools[set_name] = pool
