"""MoE shape of a Hugging Face model from its ``config.json``: experts, sizes and which layers are MoE.

Covers the families moelora targets (Qwen2/Qwen3-MoE, OLMoE, Mixtral, DeepSeek-V2/V3); the layer ids
are the model's own indices, as they appear in PEFT keys (``...layers.{n}.mlp.experts...``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MoEShape:
    num_experts: int
    hidden_size: int
    intermediate_size: int
    layer_ids: tuple[int, ...]
    top_k: int
    model_type: str


def _first(cfg: dict, *names: str):
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return None


def moe_shape_from_config(cfg: dict) -> MoEShape:
    """Reads E, H, I, the MoE layer ids and top-k from a config dict; ValueError naming what is missing."""
    model_type = str(cfg.get("model_type", "?"))
    experts = _first(cfg, "num_experts", "num_local_experts", "n_routed_experts")
    hidden = cfg.get("hidden_size")
    # Mixtral-style configs have one intermediate size; MoE families with dense layers name the expert one.
    inter = _first(cfg, "moe_intermediate_size", "intermediate_size")
    layers = cfg.get("num_hidden_layers")
    top_k = _first(cfg, "num_experts_per_tok", "top_k") or 0
    missing = [n for n, v in (("experts", experts), ("hidden_size", hidden), ("intermediate size", inter),
                              ("num_hidden_layers", layers)) if v is None]
    if missing:
        raise ValueError(f"config ({model_type}) lacks {', '.join(missing)}: is this an MoE model?")
    dense = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step") or 1)
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    ids = tuple(
        n for n in range(int(layers))
        if n not in dense and (n + 1) % step == 0 and n >= first_dense and (n - first_dense) % freq == 0
    )
    return MoEShape(int(experts), int(hidden), int(inter), ids, int(top_k), model_type)


def moe_shape_from_dir(model_dir: str | Path) -> MoEShape:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{path}: not found (--model expects a Hugging Face model directory)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: invalid JSON ({err})") from None
    return moe_shape_from_config(cfg)
