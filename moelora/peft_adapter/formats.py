"""PEFT's key names and the formats they come in: the vocabulary the rest of the loader matches keys with.

F1, per-expert modules (``target_modules``)::

    base_model.model.<...>layers.{L}.<...>.experts.{e}.{gate_proj|up_proj|down_proj}.lora_{A|B}.weight

F2, fused expert parameters (``target_parameters``, one ``lora.ParamWrapper`` per parameter, the first
registered innermost)::

    base_model.model.<...>layers.{L}.<...>.experts[.base_layer].lora_{A|B}.weight

:data:`FORMAT_F2_SWAPPED` is F2 as PEFT 0.17.0-0.19.0 wrote it (A and B transposed). The module
docstring of :mod:`moelora.peft_loader` describes the layouts in full.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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


# our projections in the order a layer's modules are sorted and reported
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
