"""Integrations of the moelora MoE LoRA layer into model libraries.

``moelora.integrations.attach(model, ...)`` swaps the routed-experts modules of a transformers-5 MoE
model (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, DeepSeek-V3, ...) for :class:`MoELoRAExperts`, which run
:class:`moelora.FusedMoEWithLoRA` on the model's own expert tensors, and returns a
:class:`MoELoRAHandle` to load adapters and pick one per sequence::

    import moelora.integrations

    handle = moelora.integrations.attach(model, max_loras=8, max_rank=64)
    handle.load_adapter("sql", "adapters/sql")
    with handle.adapters(["sql", None, "chat"]):         # one entry per batch row
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=32)
    handle.detach()                                      # the original modules are back

Importing this package does not import transformers.
"""

from moelora.integrations.gpt_oss import load_packed_gpt_oss
from moelora.integrations.transformers import (
    KNOWN_EXPERTS_CLASSES,
    MoELoRAExperts,
    MoELoRAHandle,
    UnsupportedModelError,
    attach,
    find_experts_modules,
)

__all__ = [
    "KNOWN_EXPERTS_CLASSES",
    "MoELoRAExperts",
    "MoELoRAHandle",
    "UnsupportedModelError",
    "attach",
    "find_experts_modules",
    "load_packed_gpt_oss",
]
