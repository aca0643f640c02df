"""An adapter's weights as plain tensors: what the PEFT loader returns, the pool places and the oracle reads.

``ReferenceLoRA`` holds one adapter's LoRA on one MoE layer, per expert and projection, each a
``LoRAProjection`` (A, B and its own scaling). ``AdapterLoadError`` is what every refusal of an adapter
raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["AdapterLoadError", "LoRAProjection", "ReferenceLoRA"]


class AdapterLoadError(ValueError):
    """An adapter that cannot be served exactly. The pool is left unchanged when this is raised."""


@dataclass
class LoRAProjection:
    """LoRA of one linear projection ``W (out, in)``: ``W' = W + scaling · b @ a``.

    Attributes:
        a: ``(r, in_features)``, LoRA A.
        b: ``(out_features, r)``, LoRA B.
        scaling: ``lora_alpha / r`` (or ``lora_alpha / sqrt(r)`` with rsLoRA), for this module.
    """

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass
class ReferenceLoRA:
    """One adapter's weights on one MoE layer, keyed by expert index.

    A missing expert, or a missing projection of an expert, means no delta there.

    Attributes:
        gate: expert -> gate_proj LoRA (in = H, out = I).
        up: expert -> up_proj LoRA (in = H, out = I).
        down: expert -> down_proj LoRA (in = I, out = H).
    """

    gate: dict[int, LoRAProjection] = field(default_factory=dict)
    up: dict[int, LoRAProjection] = field(default_factory=dict)
    down: dict[int, LoRAProjection] = field(default_factory=dict)
