"""Tensor- and expert-parallel MoE layers: which part of the experts and of each adapter a rank holds.

A :class:`MoEShard` names one rank's part of a MoE layer of ``E`` experts of intermediate size ``I``
(docs/design.md §7). With T tensor-parallel ranks, rank t holds the rows ``[t I/T, (t+1) I/T)`` of the gate
and of the up projection and the same columns of the down projection; with P expert-parallel ranks, rank p
holds ``E/P`` experts (contiguous, or any list). A pool built with a shard stores only that part of every
adapter (``MoELoRAMemoryPool(..., shard=)``: gate/up A whole, gate/up B the local rows, down A the local
columns, down B whole, local experts only), and a layer on that pool takes the local base weights
(``shard.split_weights``) and global ``topk_ids``.

Math. Each rank computes, for its experts and its I share, the layer of docs/design.md §1: its gate/up rows
give exactly its share ``h_t`` of every pair's activated ``h`` (the gate/up delta ``s B_t (A x)`` is
row-local), and its down projection adds ``W2_t h_t + s B (A_t h_t)``. Summed over the tensor-parallel ranks
that is ``W2 h + s B (A h)``, since ``A h = sum_t A_t h_t``: the down LoRA needs no communication of its own
and rides in the all-reduce that sums the base's partial outputs. A pair routed to another expert-parallel
rank's expert has expert id -1 here (``expert_map``) and contributes nothing (docs/design.md §4), so summing
the ranks' outputs over the expert-parallel ranks too gives the whole layer: ``FusedMoEWithLoRA(...,
process_group=, reduce_results=True)`` all-reduces over the group that spans both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from moelora.adapter_weights import AdapterLoadError, LoRAProjection, ReferenceLoRA

__all__ = ["MoEShard"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class MoEShard:
    """One rank's part of a MoE layer (module docstring).

    Args:
        num_experts: E, the model's expert count.
        intermediate_size: I, the model's expert intermediate size.
        tp_rank, tp_size: this rank's index among the T tensor-parallel ranks (I must divide by T).
        ep_rank, ep_size: this rank's index among the P expert-parallel ranks.
        experts: the global ids of this rank's experts, in the order of its local weights; default the
            contiguous ``[ep_rank E/P, (ep_rank + 1) E/P)`` (E must then divide by P).
    """

    num_experts: int
    intermediate_size: int
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    experts: tuple[int, ...] | None = None
    _local_index: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_experts", "intermediate_size", "tp_size", "ep_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name, size in (("tp_rank", self.tp_size), ("ep_rank", self.ep_size)):
            value = getattr(self, name)
            if not _is_int(value) or not 0 <= value < size:
                raise ValueError(f"{name} must be an int in [0, {size}), got {value!r}")
        if self.intermediate_size % self.tp_size:
            raise ValueError(f"intermediate_size {self.intermediate_size} does not divide into tp_size "
                             f"{self.tp_size} equal shares")
        if self.experts is None:
            if self.num_experts % self.ep_size:
                raise ValueError(f"num_experts {self.num_experts} does not divide into ep_size "
                                 f"{self.ep_size} equal shares; pass experts= (this rank's expert ids)")
            per_rank = self.num_experts // self.ep_size
            experts = tuple(range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank))
        else:
            if isinstance(self.experts, (str, bytes)) or not isinstance(self.experts, Sequence):
                raise ValueError(f"experts must be a sequence of expert ids, got {self.experts!r}")
            experts = tuple(self.experts)
            bad = [e for e in experts if not _is_int(e) or not 0 <= e < self.num_experts]
            if bad or not experts:
                raise ValueError(f"experts must be distinct ids in [0, {self.num_experts}), at least one; "
                                 f"got {list(experts)!r}")
            if len(set(experts)) != len(experts):
                raise ValueError(f"experts must be distinct, got {list(experts)!r}")
        object.__setattr__(self, "experts", experts)
        object.__setattr__(self, "_local_index", {e: i for i, e in enumerate(experts)})

    @property
    def local_num_experts(self) -> int:
        return len(self.experts)

    @property
    def local_intermediate_size(self) -> int:
        return self.intermediate_size // self.tp_size

    @property
    def intermediate_slice(self) -> slice:
        """This rank's rows of gate (and of up) and columns of down, in the model's intermediate dim."""
        share = self.local_intermediate_size
        return slice(self.tp_rank * share, (self.tp_rank + 1) * share)

    def expert_map(self, device: torch.device | str) -> torch.Tensor:
        """(E,) int32: the local index of each global expert on this rank, -1 for another rank's."""
        table = torch.full((self.num_experts,), -1, dtype=torch.int32)
        table[list(self.experts)] = torch.arange(self.local_num_experts, dtype=torch.int32)
        return table.to(device)

    def split_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of the full base weights ``w13 (E, 2I, H)`` (gate rows, then up rows) and
        ``w2 (E, H, I)``: ``(E_local, 2 I/T, H)`` and ``(E_local, H, I/T)``, contiguous copies."""
        e, i = self.num_experts, self.intermediate_size
        if w13.dim() != 3 or w13.shape[0] != e or w13.shape[1] != 2 * i:
            raise ValueError(f"w13 must be (E={e}, 2I={2 * i}, H), got {tuple(w13.shape)}")
        if w2.dim() != 3 or w2.shape[0] != e or w2.shape[2] != i or w2.shape[1] != w13.shape[2]:
            raise ValueError(f"w2 must be (E={e}, H={w13.shape[2]}, I={i}), got {tuple(w2.shape)}")
        experts = list(self.experts)
        rows = self.intermediate_slice
        gate, up = w13[experts, :i][:, rows], w13[experts, i:][:, rows]
        return torch.cat([gate, up], dim=1).contiguous(), w2[experts][:, :, rows].contiguous()

    def split_adapter(self, name: str, layers: Mapping[int, ReferenceLoRA]) -> dict[int, ReferenceLoRA]:
        """This rank's part of one adapter given for the whole model (global expert ids, full I): the local
        experts renumbered in local order, gate/up B's local rows, down A's local columns; A of gate/up
        and B of down whole. Raises :class:`AdapterLoadError` for an expert id or a tensor shape that does
        not fit the whole model (a slice must never turn a wrong shape into a plausible one)."""
        if not isinstance(layers, Mapping):
            return layers  # the pool refuses it with its own message
        rows = self.intermediate_slice
        local: dict[int, ReferenceLoRA] = {}
        for lid, lora in layers.items():
            if not isinstance(lora, ReferenceLoRA):
                local[lid] = lora
                continue
            part = ReferenceLoRA()
            for proj in ("gate", "up", "down"):
                by_expert = getattr(lora, proj)
                if not isinstance(by_expert, Mapping):
                    setattr(part, proj, by_expert)
                    continue
                kept = {}
                for e, module in by_expert.items():
                    where = f"adapter {name!r} layer {lid} {proj} expert {e!r}"
                    if not _is_int(e) or not 0 <= e < self.num_experts:
                        raise AdapterLoadError(
                            f"{where}: expert out of range [0, num_experts={self.num_experts})")
                    if e not in self._local_index:
                        continue
                    kept[self._local_index[e]] = self._split_module(where, proj, module, rows)
                setattr(part, proj, kept)
            local[lid] = part
        return local

    def _split_module(self, where: str, proj: str, module: object, rows: slice) -> object:
        if self.tp_size == 1 or not isinstance(module, LoRAProjection):
            return module
        a, b = module.a, module.b
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() != 2 or b.dim() != 2:
            return module  # the pool refuses it with its own message
        i = self.intermediate_size
        if proj == "down":
            if a.shape[1] != i:
                raise AdapterLoadError(f"{where}: LoRA A must be (r, I={i}) before tensor-parallel slicing, "
                                       f"got {tuple(a.shape)}")
            return LoRAProjection(a[:, rows], b, module.scaling)
        if b.shape[0] != i:
            raise AdapterLoadError(f"{where}: LoRA B must be (I={i}, r) before tensor-parallel slicing, "
                                   f"got {tuple(b.shape)}")
        return LoRAProjection(a, b[rows], module.scaling)
