"""The pool's arena as the kernels and the references read it, and the writes that fill a slot's rows.

:class:`LoRALayerBuffers` is one layer's view of the arena for the kernels, :class:`DenseLoRA` the dense
gather of it for references and the PyTorch path. :class:`_ArenaWrites` holds the pool's slot writes
(``moelora.pool`` owns when they happen: these only touch the rows and table entries of the slot given).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moelora.arena import RankRowAllocator
from moelora.stager import StagedAdapter

if TYPE_CHECKING:  # imported where used: importing moelora does not import Triton
    from triton_ops.lora_weights import LoRAWeights

__all__ = ["DenseLoRA", "LoRALayerBuffers"]


@dataclass(frozen=True)
class DenseLoRA:
    """Adapter weights in the dense layout of docs/design.md §2, gathered from the arena for some slots and
    experts (``LoRALayerBuffers.dense``): what the reference and the PyTorch path read."""

    gate_up_a: torch.Tensor  # (slots, experts, 2R, H): rows [0, R) gate A, [R, 2R) up A
    gate_up_b: torch.Tensor  # (slots, experts, 2I, R): rows [0, I) gate B, [I, 2I) up B
    down_a: torch.Tensor  # (slots, experts, R, I)
    down_b: torch.Tensor  # (slots, experts, H, R)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.gate_up_a, self.gate_up_b, self.down_a, self.down_b)


@dataclass(frozen=True)
class LoRALayerBuffers:
    """One MoE layer's adapters, every slot, as the kernels read them: four :class:`LoRAWeights` views of
    the pool's arena, sharing the layer's block table ``(L, E)`` int32 (first unit of each slot and
    expert), and the pool's per-slot ranks."""

    gate_up_a: LoRAWeights
    gate_up_b: LoRAWeights
    down_a: LoRAWeights
    down_b: LoRAWeights
    slot_ranks: torch.Tensor  # (L,) int32, the pool's

    def tensors(self) -> tuple[LoRAWeights, LoRAWeights, LoRAWeights, LoRAWeights]:
        """The four matrices, in the order gate_up_a, gate_up_b, down_a, down_b."""
        return (self.gate_up_a, self.gate_up_b, self.down_a, self.down_b)

    @property
    def blocks(self) -> torch.Tensor:
        """``(L, E)`` int32: the first arena unit of each (slot, expert)."""
        return self.gate_up_a.blocks

    def dense(self, slots: torch.Tensor | Sequence[int] | None = None,
              experts: torch.Tensor | Sequence[int] | None = None) -> DenseLoRA:
        """The weights of ``slots`` x ``experts`` (default: all) in the dense layout, rank rows past each
        slot's rank zero. A gather (device work, no host sync): for references and the PyTorch path."""
        dev = self.blocks.device
        n_slots, n_experts = self.blocks.shape
        slots = torch.arange(n_slots, device=dev) if slots is None else torch.as_tensor(slots, device=dev)
        experts = (torch.arange(n_experts, device=dev) if experts is None
                   else torch.as_tensor(experts, device=dev))
        big_r = self.gate_up_a.max_rank
        offs = torch.arange(big_r, device=dev)
        units = self.blocks[slots.long()][:, experts.long()].long()  # (s, e)
        live = offs < self.slot_ranks[slots.long()].long()[:, None, None]  # (s, 1, R)
        # Rows past a slot's rank read unit 0: the zero block, always in bounds and always zero.
        rows = torch.where(live, units[..., None] + offs, 0)  # (s, e, R)
        gate_up_a = self.gate_up_a.data
        gate_up_b = self.gate_up_b.data
        return DenseLoRA(
            gate_up_a=torch.cat((gate_up_a[0][rows], gate_up_a[1][rows]), dim=2),
            gate_up_b=gate_up_b[rows].transpose(2, 3),
            down_a=self.down_a.data[rows],
            down_b=self.down_b.data[rows].transpose(2, 3),
        )


def _alloc_blocks(units: RankRowAllocator, needs: dict[int, int]) -> dict[int, list[int]] | None:
    """``needs`` (rank -> block count) from ``units``, largest ranks first: rank -> starts, or None with
    ``units`` as it was."""
    got: dict[int, list[int]] = {}
    for rank in sorted(needs, reverse=True):
        starts = units.alloc(rank, needs[rank])
        if starts is None:
            units.free(u for taken in got.values() for u in taken)
            return None
        got[rank] = starts
    return got


def _block_runs(starts: Sequence[int], rank: int) -> list[tuple[int, int, int, int]]:
    """``starts`` (blocks of ``rank`` units, each aligned to ``step``, the power of two >= rank) as runs of
    blocks ``step`` apart: (first index, end index, first unit, step). A run is one strided copy."""
    step = 1 << (rank - 1).bit_length()
    runs, first = [], 0
    for k in range(1, len(starts) + 1):
        if k == len(starts) or starts[k] != starts[k - 1] + step:
            runs.append((first, k, starts[first], step))
            first = k
    return runs


class _ArenaWrites:
    """The slot writes of :class:`moelora.pool.MoELoRAMemoryPool` (a mixin: ``self`` is the pool)."""

    def _layer_buffers(self, blocks: torch.Tensor, ranks: torch.Tensor) -> LoRALayerBuffers:
        """The kernels' view of the arena for one layer whose block table is ``blocks`` (L, E) and whose
        slots' ranks in this layer are ``ranks`` (L,)."""
        from triton_ops.lora_weights import arena_lora_weights

        return LoRALayerBuffers(**arena_lora_weights(**self._arena, blocks=blocks, max_rank=self.max_rank),
                                slot_ranks=ranks)

    def _arena_rows(self, key: str) -> torch.Tensor:
        """The (units, width) rows of the arena a host stack ``key`` (``gate_a``, ``up_b``, ...) goes to."""
        i = self.intermediate_size
        return {"gate_a": self._arena["gate_up_a"][0], "up_a": self._arena["gate_up_a"][1],
                "gate_b": self._arena["gate_up_b"][:, :i], "up_b": self._arena["gate_up_b"][:, i:],
                "down_a": self._arena["down_a"], "down_b": self._arena["down_b"]}[key]

    def _write_slot(self, slot: int, staged: StagedAdapter, *, stream: torch.cuda.Stream | None = None
                    ) -> None:
        """Writes ``staged`` into the arena blocks :meth:`_take_slot` gave ``slot`` (each layer's rank rows
        of each block, zeros where the adapter has no module), then the slot's block table entries and the
        device rank and scaling tables (the host mirrors change at :meth:`_publish`). Only the adapter's own
        rows cross the bus, through the pinned staging buffer on CUDA. Queued on ``stream`` (default: the
        current stream). Touches only ``slot``'s rows and entries, so it may run outside the lock while
        the slot is reserved."""
        if self._staging is not None and stream is None:
            stream = torch.cuda.current_stream(self.device)
        table = torch.zeros(len(self.layer_ids), self.num_experts, dtype=torch.int32)
        ranks = torch.zeros(len(self.layer_ids), dtype=torch.int32)
        for li, lid in enumerate(self.layer_ids):
            layer_starts = self._slot_units[slot][li]
            if not layer_starts:
                continue
            experts, rank = staged.experts[lid], staged.layer_ranks[lid]
            table[li, experts] = torch.tensor(layer_starts, dtype=torch.int32)
            ranks[li] = rank
            stacks = staged.layers[lid]
            for first, end, unit, step in _block_runs(layer_starts, rank):
                run = experts[first:end]
                if run[-1] - run[0] == end - first - 1:
                    pick = slice(run[0], run[-1] + 1)
                else:
                    pick = torch.tensor(run)
                for key in ("gate_a", "up_a", "gate_b", "up_b", "down_a", "down_b"):
                    dst = self._arena_rows(key)[unit : unit + (end - first) * step]
                    dst = dst.unflatten(0, (end - first, step))[:, :rank]
                    host = stacks.get(key)
                    if host is None:  # no module of this projection: the rows still held an older adapter
                        dst.zero_()
                        continue
                    if key.endswith("_b"):  # (n, out, r) on the host: the device copy transposes it
                        dst, src = dst.transpose(1, 2), host[pick][:, :, :rank]
                    else:
                        src = host[pick][:, :rank]
                    if self._staging is not None:
                        self._staging.copy(dst, src, stream)
                    else:
                        dst.copy_(src)
        self.blocks[:, slot].copy_(table.to(self.device))
        self.layer_ranks[:, slot].copy_(ranks.to(self.device))
        live = any(self._slot_units[slot])
        self._fill_slot_tables(slot, staged.rank if live else 0, staged.scaling if live else 0.0)

    def _clear_slot(self, slot: int) -> None:
        """Gives the slot's arena blocks back and points every (layer, expert) of it at the zero block, with
        rank and scaling 0. Kernels queued before read the old entries (the fills are queued after them)."""
        self._units.free(u for starts in self._slot_units[slot] for u in starts)
        self._slot_units[slot] = []
        self.blocks[:, slot].zero_()
        self.layer_ranks[:, slot].zero_()
        self.slot_rank_host[slot] = 0
        self.slot_scaling_host[slot] = 0.0
        self._fill_slot_tables(slot, 0, 0.0)

    def _fill_slot_tables(self, slot: int, rank: int, scaling: float) -> None:
        # In place, one element (a device fill, no host round trip): kernels and captured CUDA graphs
        # hold these exact tensors.
        self.slot_ranks[slot].fill_(int(rank))
        self.slot_scalings[slot].fill_(float(scaling))
