"""The gated activations of MoE experts: ``h = act(g, u)`` from an expert's gate and up projections.

docs/design.md §1 writes ``h = silu(g) ⊙ u``; families differ in what stands there. Every path (the Triton
kernels, the PyTorch path, the reference) takes one :class:`GatedActivation` (or the name of a plain
one) and computes the same function of ``g`` and ``u``, each already holding its LoRA delta.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATION_KINDS", "GatedActivation", "as_gated_activation"]

# kind -> what it computes (the docstring of GatedActivation has the families)
ACTIVATION_KINDS = {
    "silu": "silu(g) * u",
    "gelu": "gelu(g) * u (exact, erf)",
    "gelu_tanh": "gelu_tanh(g) * u (tanh approximation)",
    "relu": "relu(g) * u (with g = u: the squared ReLU of ungated experts)",
    "clamped_swiglu": "g' * sigmoid(alpha * g') * (u' + up_offset), g' = min(g, limit), "
                      "u' = clamp(u, ±limit)",
    "clamped_silu_after": "min(silu(g), limit) * clamp(u, ±limit)",
    "softcapped_swiglu": "cap(g, limit) * sigmoid(g) * cap(u, up_limit), cap(z, c) = c * tanh(z / c)",
}
_CLAMPED = ("clamped_swiglu", "clamped_silu_after", "softcapped_swiglu")


@dataclass(frozen=True)
class GatedActivation:
    """``h = act(g, u)`` of one expert family (``ACTIVATION_KINDS``):

    - ``silu``, ``gelu``, ``gelu_tanh``, ``relu``: ``act(g) * u``. Ungated experts with a squared ReLU
      (Nemotron-H: ``relu(u)^2``) are ``relu`` with the up projection standing as the gate too.
    - ``clamped_swiglu``: gpt-oss and MiniMax-M3 (``alpha`` 1.702, ``up_offset`` 1), DeepSeek-V4,
      GLM-5-next and Hunyuan-V4 (``alpha`` 1, ``up_offset`` 0: a SiLU of the clamped gate).
    - ``clamped_silu_after``: Step-3.7 (the SiLU's output is clamped, not its input).
    - ``softcapped_swiglu``: Inkling-2 (tanh soft caps ``limit`` on the gate's linear factor and
      ``up_limit`` on up; the sigmoid sees the raw gate).

    ``limit`` (clamped and soft-capped kinds only, > 0), ``alpha`` and ``up_offset`` (``clamped_swiglu``
    only) and ``up_limit`` (``softcapped_swiglu`` only, > 0) are the model's constants; each distinct set
    compiles its own kernel variant.
    """

    kind: str = "silu"
    limit: float = 0.0
    alpha: float = 1.0
    up_offset: float = 0.0
    up_limit: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATION_KINDS:
            raise ValueError(f"activation kind must be one of {sorted(ACTIVATION_KINDS)}, got {self.kind!r}")
        for name in ("limit", "alpha", "up_offset", "up_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"activation {name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.kind in _CLAMPED and self.limit <= 0:
            raise ValueError(f"a {self.kind} activation needs its clamp limit > 0, got {self.limit!r}")
        if self.kind not in _CLAMPED and self.limit:
            raise ValueError(f"limit belongs to the clamped activations {_CLAMPED}, not {self.kind!r}")
        if self.kind != "clamped_swiglu" and (self.alpha != 1.0 or self.up_offset != 0.0):
            raise ValueError(f"alpha and up_offset belong to clamped_swiglu, not {self.kind!r}")
        if (self.kind == "softcapped_swiglu") != (self.up_limit != 0.0) or self.up_limit < 0:
            raise ValueError(f"up_limit (> 0) belongs to softcapped_swiglu and it needs one, got "
                             f"{self.up_limit!r} for {self.kind!r}")

    def __call__(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``act(g, u)`` in ``g``'s dtype (callers compute in float32 or float64)."""
        if self.kind == "silu":
            return F.silu(g) * u
        if self.kind == "gelu":
            return F.gelu(g, approximate="none") * u
        if self.kind == "gelu_tanh":
            return F.gelu(g, approximate="tanh") * u
        if self.kind == "relu":
            return F.relu(g) * u
        if self.kind == "softcapped_swiglu":
            gate_cap = torch.tanh(g / self.limit) * self.limit
            return gate_cap * torch.sigmoid(g) * (torch.tanh(u / self.up_limit) * self.up_limit)
        u = u.clamp(min=-self.limit, max=self.limit)
        if self.kind == "clamped_silu_after":
            return F.silu(g).clamp(max=self.limit) * u
        g = g.clamp(max=self.limit)
        return g * torch.sigmoid(g * self.alpha) * (u + self.up_offset)

    def __str__(self) -> str:
        if self.kind not in _CLAMPED:
            return self.kind
        extra = ""
        if self.kind == "clamped_swiglu":
            extra = f", alpha={self.alpha:g}, up_offset={self.up_offset:g}"
        if self.kind == "softcapped_swiglu":
            extra = f", up_limit={self.up_limit:g}"
        return f"{self.kind}(limit={self.limit:g}{extra})"


def as_gated_activation(activation: str | GatedActivation) -> GatedActivation:
    """``activation`` as a :class:`GatedActivation`: one, or the name of a kind without parameters
    (``"silu"``, ``"gelu"``, ``"gelu_tanh"``; any case)."""
    if isinstance(activation, GatedActivation):
        return activation
    if isinstance(activation, str):
        name = activation.lower()
        if name in ACTIVATION_KINDS and name not in _CLAMPED:
            return GatedActivation(name)
        plain = sorted(k for k in ACTIVATION_KINDS if k not in _CLAMPED)
        raise ValueError(f"activation must be one of {plain} or a GatedActivation (for "
                         f"{', '.join(_CLAMPED)}), got {activation!r}")
    raise TypeError(f"activation must be a str or a GatedActivation, got {type(activation).__name__}")
