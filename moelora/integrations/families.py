"""The transformers Mixture-of-Experts families' cases, each in one place: how a family stores its experts
and what attach maps onto :class:`moelora.FusedMoEWithLoRA`.

The common case (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, DeepSeek-V3, ... :data:`KNOWN_EXPERTS_CLASSES`) is
one module with fused ``gate_up_proj (E, 2I, H)`` ([gate; up] rows) and ``down_proj (E, H, I)``. Every
other case has a section below with its detection and what it needs:

- ungated experts (Nemotron-H): ``up_proj`` alone, read as a ``(E, 2, I, H)`` halves view;
- interleaved gate/up columns (gpt-oss): de-interleaved into one copy;
- transposed storage (Aria, gpt-oss) and the dense form (Llama-4: every expert's input-scaled rows);
- a norm after each expert (MuSE-Spark), run on each routed pair's output;
- identity experts (LongCat-Flash), added by the wrapper;
- routed blocks (JetMoE), swapped whole, seen through :class:`_RoutedBlockExperts`;
- MXFP4 experts packed for transformers' hub kernels (gpt-oss), dequantized once at attach;
- transformers' fine-grained FP8 experts;
- expert sets chosen per token by a token-type mask (ERNIE-4.5-VL).

The tables at the end combine them: the modules served through a view of their own
(:data:`_SPECIAL_MODULES`), the storage in words (:data:`_STORAGE_WORDS`), and the weights, biases, shape
and adapter layout the layer reads. Activations and the checks of a module are in
:mod:`moelora.integrations.checks`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from moelora.activations import GatedActivation
from moelora.peft_loader import ExpertParamLayout
from moelora.torch_path import moe_lora_forward_torch


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


#: The expert dtypes the pool holds LoRA in (FP8 experts are served beside a pool in the compute dtype).
_POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------------
# The common layout: [gate; up] rows (E, 2I, H), down (E, H, I); ungated experts (Nemotron-H)
# --------------------------------------------------------------------------------------------------


def _gate_up_name(module: nn.Module) -> str:
    """The parameter holding the experts' input projections: ``gate_up_proj``, or ``up_proj`` for ungated
    experts (``has_gate`` False, Nemotron-H)."""
    return "up_proj" if getattr(module, "has_gate", True) is False else "gate_up_proj"


def _is_fused_experts(module: nn.Module) -> bool:
    w13 = getattr(module, _gate_up_name(module), None)
    w2 = getattr(module, "down_proj", None)
    return isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor) and w13.dim() == 3 and w2.dim() == 3


def _raw_biases(module: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The module's own gate/up (or up) and down bias tensors, as stored."""
    found = (getattr(module, f"{_gate_up_name(module)}_bias", None), getattr(module, "down_proj_bias", None))
    return tuple(b if isinstance(b, torch.Tensor) else None for b in found)


# --------------------------------------------------------------------------------------------------
# Interleaved gate/up columns (gpt-oss)
# --------------------------------------------------------------------------------------------------


def _deinterleaved(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A copy of ``t`` with its alternating gate/up entries along ``dim`` (gpt-oss) as gate first, then
    up."""
    index = [slice(None)] * t.dim()
    gate, up = list(index), list(index)
    gate[dim], up[dim] = slice(0, None, 2), slice(1, None, 2)
    return torch.cat((t[tuple(gate)], t[tuple(up)]), dim=dim)


# --------------------------------------------------------------------------------------------------
# Transposed storage (Aria, gpt-oss) and the dense form (Llama-4)
# --------------------------------------------------------------------------------------------------


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


def _dense_routing(x: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of the dense form's stacked rows (``(E * M, H)``, expert-major): row ``j`` is one pair of
    expert ``j // M`` with weight 1 (the scores already scale the rows); an all-zero row (an expert its
    token is not routed to) gets id -1, which the layer skips, since it contributes exactly zero. No host
    sync: ``(E * M, 1)`` weights and ids."""
    rows = x.shape[0]
    ids = torch.arange(num_experts, device=x.device).repeat_interleave(rows // num_experts)
    ids = ids.masked_fill(~x.ne(0).any(dim=-1), -1)
    return torch.ones(rows, 1, device=x.device, dtype=x.dtype), ids[:, None]


# --------------------------------------------------------------------------------------------------
# A norm after each expert (MuSE-Spark)
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# Identity experts (LongCat-Flash)
# --------------------------------------------------------------------------------------------------


def _identity_experts(module: nn.Module) -> int:
    """Router ids past the FFN experts that are identity experts (LongCat-Flash's zero-computation
    experts: ``out += w * x``): the extra experts ``gate_up_proj`` holds beyond ``down_proj``'s."""
    w13 = getattr(module, _gate_up_name(module))
    return max(0, int(w13.shape[0]) - int(module.down_proj.shape[0]))


def _identity_term(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   num_experts: int) -> torch.Tensor:
    """``sum_k w_k * x`` over the pairs routed to an identity expert (id ``>= num_experts``): LongCat-Flash's
    zero-computation experts return their input. No host sync."""
    identity = (weights * (ids >= num_experts)).sum(dim=-1, keepdim=True)
    return (identity * x).to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Routed blocks (JetMoE)
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# MXFP4 experts packed for transformers' hub kernels (gpt-oss)
# --------------------------------------------------------------------------------------------------


def _is_mxfp4_hub(module: nn.Module) -> bool:
    """gpt-oss' experts as transformers loads them for its MXFP4 hub kernels (``Mxfp4GptOssExperts``)."""
    return type(module).__name__ == "Mxfp4GptOssExperts"


def _is_mxfp4_packed(module: nn.Module) -> bool:
    """gpt-oss' MXFP4 experts: transformers' hub module, or the checkpoint's tensors as
    ``moelora.integrations.gpt_oss.load_packed_gpt_oss`` loads them (``PackedGptOssExperts``)."""
    return _is_mxfp4_hub(module) or type(module).__name__ == "PackedGptOssExperts"


def _mxfp4_packed_tensors(name: str, packed: nn.Module, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``packed``'s ``proj`` blocks ``(E, rows, K / 32, 16)`` and scales ``(E, rows, K / 32)`` (uint8): the
    checkpoint's own (``PackedGptOssExperts``), or unswizzled from the hub tensors by transformers' own
    reverse conversion (a copy)."""
    if not _is_mxfp4_hub(packed):
        return getattr(packed, f"{proj}_blocks"), getattr(packed, f"{proj}_scales")
    try:
        from transformers.integrations.mxfp4 import Mxfp4ReverseDeserialize

        packed_tensors = Mxfp4ReverseDeserialize(None).convert({}, model=packed,
                                                               full_layer_name=f"{proj}_blocks")
        return packed_tensors[f"{proj}_blocks"], packed_tensors[f"{proj}_scales"]
    except Exception as exc:  # plain uint8 tensors without their scales, another hub or transformers version
        raise UnsupportedModelError(
            f"experts module {name!r} ({type(packed).__name__}) holds MXFP4 weights whose blocks and scales "
            f"cannot be read ({type(exc).__name__}: {exc}); load the model with quantization_config="
            "Mxfp4Config(dequantize=True) (the experts in bfloat16) and attach that"
        ) from exc


def _mxfp4_dequantized(name: str, packed: nn.Module, proj: str, dtype: torch.dtype) -> torch.Tensor:
    """``packed``'s ``proj`` ("gate_up_proj" or "down_proj") in ``dtype``, stored as gpt-oss' bf16 experts
    store it: ``(E, H, 2I)`` (gate/up columns interleaved) or ``(E, I, H)``. The hub tensors are unswizzled
    and the FP4 values decoded by transformers' own conversion (what it runs to save such a model, and to
    load one with ``Mxfp4Config(dequantize=True)``)."""
    blocks, scales = _mxfp4_packed_tensors(name, packed, proj)
    try:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        with torch.no_grad():
            return convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    except Exception as exc:  # another transformers version's conversion
        raise UnsupportedModelError(
            f"experts module {name!r} ({type(packed).__name__}) holds MXFP4 weights that cannot be "
            f"dequantized at attach ({type(exc).__name__}: {exc}); attach it packed (the default) or load "
            "the model with quantization_config=Mxfp4Config(dequantize=True) and attach that"
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


class _PackedMxfp4Experts(_DequantizedMxfp4Experts):
    """gpt-oss' MXFP4 experts served packed: the layer's GEMMs decode the E2M1 blocks and E8M0 scales in
    their K-loops (``FusedMoEWithLoRA(mxfp4=)``), so the experts take their MXFP4 bytes once more (the
    blocks and scales as transformers' reverse conversion unswizzles them), not four times in bf16. Gate/up
    rows stay interleaved (row 2n gate n, row 2n + 1 up n) and are read in place through an (E, 2, I, H / 2)
    halves view of the blocks and of the scales; the biases are de-interleaved (gate then up) as the
    dequantized view's are. ``gate_up_proj`` / ``down_proj`` are stride-0 placeholders of the dense
    storage's shape, dtype and device for attach's checks: they hold no values (the torch forward decodes
    the blocks)."""

    def __init__(self, name: str, packed: nn.Module, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        from triton_ops.mxfp4 import Mxfp4Weights

        object.__setattr__(self, "packed", packed)  # not a child: the view owns nothing of the model's
        self.alpha, self.limit = float(packed.alpha), float(packed.limit)
        gu_blocks, gu_scales = _mxfp4_packed_tensors(name, packed, "gate_up_proj")
        down_blocks, down_scales = _mxfp4_packed_tensors(name, packed, "down_proj")
        experts, two_i, groups = (int(d) for d in gu_scales.shape)
        hidden = int(down_scales.shape[1])
        inter = two_i // 2

        def halves(t: torch.Tensor) -> torch.Tensor:  # interleaved rows -> (E, 2, I, ...): gate, then up
            return t.reshape(experts, inter, 2, t.shape[-1]).transpose(1, 2)

        self.w13_blocks = halves(gu_blocks.reshape(experts, two_i, groups * 16))
        self.w2_blocks = down_blocks.reshape(experts, hidden, -1)
        self.mxfp4 = Mxfp4Weights(halves(gu_scales), down_scales)
        device = gu_blocks.device
        self.gate_up_proj = torch.empty((), dtype=dtype, device=device).expand(experts, hidden, two_i)
        self.down_proj = torch.empty((), dtype=dtype, device=device).expand(experts, inter, hidden)
        bias = packed.gate_up_proj_bias.detach().to(dtype)
        self.gate_up_proj_bias = nn.Parameter(_deinterleaved(bias, dim=1), requires_grad=False)
        self.down_proj_bias = nn.Parameter(packed.down_proj_bias.detach().to(dtype), requires_grad=False)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """The dequantized view's forward on the blocks decoded for this call (PyTorch)."""
        from triton_ops.mxfp4 import dequantize_mxfp4_torch

        dtype = self.gate_up_proj.dtype
        w13 = dequantize_mxfp4_torch(self.w13_blocks, self.mxfp4.w13_scale, dtype).flatten(1, 2)
        w2 = dequantize_mxfp4_torch(self.w2_blocks, self.mxfp4.w2_scale, dtype)
        activation = GatedActivation("clamped_swiglu", self.limit, self.alpha, 1.0)
        return moe_lora_forward_torch(hidden_states, w13, w2, top_k_weights, top_k_index, None, None,
                                      activation=activation, w13_bias=self.gate_up_proj_bias,
                                      w2_bias=self.down_proj_bias)


# --------------------------------------------------------------------------------------------------
# transformers' fine-grained FP8 experts (any family's, quantized)
# --------------------------------------------------------------------------------------------------


# transformers' fine-grained FP8 experts: any family's experts, quantized. Not run to verify the math (its
# forward needs transformers' hub kernels); _check_supported reads its scales and gate variants instead.
_FP8_EXPERTS_CLASS = "FP8Experts"
# FP8Experts overrides _apply_gate for these variants; without them it is the plain act(gate) * up.
_FP8_GATE_VARIANTS = ("gate_softcap", "up_softcap", "swiglu_alpha", "swiglu_limit", "limit")


# --------------------------------------------------------------------------------------------------
# Expert sets chosen per token by a token-type mask (ERNIE-4.5-VL)
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# The tables: special modules, storage in words
# --------------------------------------------------------------------------------------------------


# A view's constructor: (qualified name, the model's module, the compute dtype) -> the view.
_ViewOf = Callable[[str, nn.Module, torch.dtype], nn.Module]

#: The modules served through a view of their own, tried in order: (detection, view). Any other module
#: holding fused 3-D expert tensors is served as it is.
_SPECIAL_MODULES: tuple[tuple[Callable[[nn.Module], bool], _ViewOf], ...] = (
    (_is_mxfp4_packed, _PackedMxfp4Experts),  # gpt-oss, MXFP4
    (_is_routed_block, lambda name, module, dtype: _RoutedBlockExperts(module)),  # JetMoE
)


def _is_experts_module(module: nn.Module) -> bool:
    """A routed-experts module attach serves: fused 3-D expert tensors, or one of :data:`_SPECIAL_MODULES`."""
    return _is_fused_experts(module) or any(detect(module) for detect, _ in _SPECIAL_MODULES)


def _experts_view(name: str, module: nn.Module, dtype: torch.dtype, *, dequantize_mxfp4: bool = False
                  ) -> nn.Module:
    """What attach checks and serves: the module itself, the experts of a routed block, or MXFP4 experts
    packed (``_PackedMxfp4Experts``) or, with ``dequantize_mxfp4``, dequantized into ``dtype``."""
    if dequantize_mxfp4 and _is_mxfp4_packed(module):
        return _DequantizedMxfp4Experts(name, module, dtype)
    for detect, view in _SPECIAL_MODULES:
        if detect(module):
            return view(name, module, dtype)
    return module


def _model_module(view: nn.Module) -> nn.Module:
    """The model's own module behind an experts view (its parameters and children stay the model's)."""
    if isinstance(view, _RoutedBlockExperts):
        return view.block
    return view.packed if isinstance(view, _DequantizedMxfp4Experts) else view


def _adapter_gate_up_interleaved(module: nn.Module) -> bool:
    """Whether PEFT adapters of this module address interleaved gate/up columns (gpt-oss, bf16 or MXFP4)."""
    return getattr(module, "adapter_gate_up_interleaved", not getattr(module, "is_concatenated", True))


#: The storage cases in words, in the order the coverage table lists them: each entry gives its words for
#: a module, or "" where its case does not apply.
_STORAGE_WORDS: tuple[Callable[[nn.Module], str], ...] = (
    lambda m: "ungated up_proj" if _gate_up_name(m) == "up_proj" else "gate_up_proj",  # Nemotron-H
    lambda m: ("MXFP4 (packed)" if isinstance(m, _PackedMxfp4Experts) else "MXFP4 (dequantized at attach)"
               if isinstance(m, _DequantizedMxfp4Experts) else ""),  # gpt-oss
    lambda m: "interleaved gate/up" if _adapter_gate_up_interleaved(m) else "",  # gpt-oss
    lambda m: "transposed" if _transposed(m) else "",  # Aria, gpt-oss, Llama-4
    lambda m: "biases" if any(b is not None for b in _raw_biases(m)) else "",  # gpt-oss
    lambda m: f"{_identity_experts(m)} identity experts" if _identity_experts(m) else "",  # LongCat-Flash
    lambda m: "post-expert norm" if _post_expert_norm(m) is not None else "",  # MuSE-Spark
)


def _storage_of(module: nn.Module) -> str:
    """The experts' storage in words, as the coverage table lists it."""
    return ", ".join(words for words in (case(module) for case in _STORAGE_WORDS) if words)


# --------------------------------------------------------------------------------------------------
# What the layer reads: weights, biases, shape and adapter layout of any case
# --------------------------------------------------------------------------------------------------


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
    if isinstance(module, _PackedMxfp4Experts):  # uint8 blocks: FusedMoEWithLoRA(mxfp4=module.mxfp4)
        return module.w13_blocks, module.w2_blocks
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
        gate_up_interleaved=_adapter_gate_up_interleaved(module),
        gate_up_experts=int(module.down_proj.shape[0]) + identity if identity else None,
        up_only=_gate_up_name(module) == "up_proj",
        unflagged_transposed=_transposed(module) and not getattr(module, "is_transposed", False),
    )
