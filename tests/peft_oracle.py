"""Helpers the integration tests share to build PEFT oracles and compare against them (not a test module)."""

from __future__ import annotations

import torch
from torch import nn


def fill_lora(model: nn.Module, seed: int) -> None:
    """Seeded random LoRA factors (scale 0.1) for every ``lora_A`` / ``lora_B`` of a PEFT model, in
    parameter-name order, so the same seed gives the same adapter on any device."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def left_padded(row_lens: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of one seeded batch: row ``i`` has ``row_lens[i]`` tokens, left
    padded with id 0 to the longest row."""
    gen = torch.Generator().manual_seed(3)
    s = max(row_lens)
    ids = torch.randint(2, vocab, (len(row_lens), s), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(row_lens):
        ids[row, : s - n] = 0
        mask[row, s - n :] = 1
    return ids, mask


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs difference relative to the reference's scale."""
    return float((got - want).abs().max()) / (float(want.abs().max()) + 1e-12)
