"""Where the LoRA kernels find each (slot, expert)'s rank rows: one matrix kind of one layer, all slots.

Every kernel that reads LoRA A or B addresses a (slot, expert) through a block table instead of fixed
slot and expert strides (``lora_tiles.lora_block_offset``): rank row ``r``, column ``c`` of (slot, expert)
is at element

    blocks[slot, expert] * stride_unit + r * stride_rank + c * stride_col

of ``data``. The pool's arena stores each adapter at its own rank and only for the experts it trains, and
points every other (slot, expert) at a shared zero block; a dense ``(L, E, R, .)`` buffer (docs/design.md §2,
what tests and benchmarks build) is the table ``slot * E + expert`` with the expert stride as its unit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["LoRAWeights", "arena_lora_weights", "lora_weights"]


class LoRAWeights(NamedTuple):
    """One LoRA matrix of one layer for every slot, as the kernels read it.

    A: rank rows over the K input columns; a gated A (gate_up) has its up rows ``up_offset`` elements
    after the gate rows. B: for each rank row the N output columns (gated: the gate outputs, then the up
    outputs from column N), i.e. B transposed; a dense ``(L, E, N, R)`` B has ``stride_rank = 1``.
    """

    data: torch.Tensor  # the storage the kernels index flat (any shape)
    blocks: torch.Tensor  # (L, E) int32, unit stride 1 along E: first unit of each (slot, expert)
    stride_unit: int  # elements per unit
    stride_rank: int  # elements between rank rows
    stride_col: int  # elements between columns (K for A, outputs for B)
    up_offset: int  # gated A: elements from a gate rank row to its up rank row (0 otherwise)
    max_rank: int  # rank rows a (slot, expert) holds at most
    cols: int  # K for A; N, or 2N for gated B
    # Unit 0 is the zero block, the entry of every (slot, expert) without rows (an expert the adapter does
    # not train, an empty slot): a pool's arena. A dense buffer's unit 0 is slot 0's expert 0.
    zero_unit_empty: bool = False

    @property
    def num_slots(self) -> int:
        return self.blocks.shape[0]

    @property
    def num_experts(self) -> int:
        return self.blocks.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def bundle(self) -> tuple:
        """This operand as one kernel argument (``lora_tiles``' LoRA operand bundle): (data, blocks, block
        table row stride, stride_unit, stride_rank, stride_col)."""
        return (self.data, self.blocks, self.blocks.stride(0), self.stride_unit, self.stride_rank,
                self.stride_col)



def lora_weights(buffer: torch.Tensor | LoRAWeights, *, kind: str) -> LoRAWeights:
    """``buffer`` as the kernels read it. ``kind`` is ``"a"`` (``(L, E, R, K)``), ``"gated_a"``
    (``(L, E, 2R, K)``, gate rows then up rows), or ``"b"`` (``(L, E, N, R)``). A :class:`LoRAWeights` is
    returned as it is. A dense buffer gets the table ``slot * E + expert`` (one small device tensor per
    call: callers that launch often build it once)."""
    if isinstance(buffer, LoRAWeights):
        return buffer
    if kind not in ("a", "gated_a", "b"):
        raise ValueError(f"kind must be 'a', 'gated_a' or 'b', got {kind!r}")
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"a LoRA buffer must be a torch.Tensor or LoRAWeights, got {type(buffer).__name__}")
    if buffer.dim() != 4:
        layout = "(L, E, N, R)" if kind == "b" else "(L, E, R, K)" if kind == "a" else "(L, E, 2R, K)"
        raise ValueError(f"a dense LoRA buffer must be {layout}, got shape {tuple(buffer.shape)}")
    slots, experts, rows, cols = buffer.shape
    if kind == "gated_a" and rows % 2:
        raise ValueError(f"gate_up A must be (L, E, 2R, K) with an even row count, got {tuple(buffer.shape)}")
    if slots > 1 and buffer.stride(0) != experts * buffer.stride(1):
        raise ValueError(f"a dense LoRA buffer's slots must be E expert strides apart, got strides "
                         f"{buffer.stride()} for shape {tuple(buffer.shape)}")
    blocks = torch.arange(slots * experts, dtype=torch.int32, device=buffer.device).view(slots, experts)
    if kind == "b":
        return LoRAWeights(buffer, blocks, stride_unit=buffer.stride(1), stride_rank=buffer.stride(3),
                           stride_col=buffer.stride(2), up_offset=0, max_rank=cols, cols=rows)
    rank = rows // 2 if kind == "gated_a" else rows
    up_offset = rank * buffer.stride(2) if kind == "gated_a" else 0
    return LoRAWeights(buffer, blocks, stride_unit=buffer.stride(1), stride_rank=buffer.stride(2),
                       stride_col=buffer.stride(3), up_offset=up_offset, max_rank=rank, cols=cols)


def arena_lora_weights(gate_up_a: torch.Tensor, gate_up_b: torch.Tensor, down_a: torch.Tensor,
                       down_b: torch.Tensor, blocks: torch.Tensor, max_rank: int) -> dict[str, LoRAWeights]:
    """The four matrices of a rank-row arena (``moelora.pool``'s layout) as the kernels read them: a unit
    is one rank row, ``gate_up_a (2, U, H)`` (gate rows, then up rows), ``gate_up_b (U, 2I)``,
    ``down_a (U, I)`` and ``down_b (U, H)`` (B as rank rows), all addressed through ``blocks`` (L, E)."""
    hidden, inter = gate_up_a.shape[2], down_a.shape[1]

    def rows(data: torch.Tensor, width: int, up_offset: int = 0) -> LoRAWeights:
        return LoRAWeights(data, blocks, stride_unit=width, stride_rank=width, stride_col=1,
                           up_offset=up_offset, max_rank=max_rank, cols=width, zero_unit_empty=True)

    return {"gate_up_a": rows(gate_up_a, hidden, up_offset=gate_up_a.stride(0)),
            "gate_up_b": rows(gate_up_b, 2 * inter), "down_a": rows(down_a, inter),
            "down_b": rows(down_b, hidden)}
