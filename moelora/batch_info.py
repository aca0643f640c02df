"""Per-step batch description for the MoE LoRA layers (docs/design.md §2).

A :class:`MoELoRABatchInfo` is built once per forward step by
:meth:`moelora.pool.MoELoRAMemoryPool.prepare_batch` and shared, unchanged, by every MoE layer of the
model in that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["MoELoRABatchInfo", "StaleBatchError"]


class StaleBatchError(ValueError):
    """A batch's adapter was unloaded, evicted or replaced in its slot since the batch was built: running it
    would use other weights, so layers refuse it. ``pool.refresh(batch)`` rebuilds it in place while its
    adapters are still held."""


@dataclass
class MoELoRABatchInfo:
    """Which adapter each token of a batch uses, plus the pool's per-slot rank and scaling tables.

    Built once per step (by ``MoELoRAMemoryPool.prepare_batch``) and shared by all MoE layers: the
    slot index of a token is the same in every layer, and each layer reads its own weights from its
    own :class:`moelora.pool.LoRALayerBuffers` at that slot.

    Nothing here needs a GPU->CPU sync. The device tensors are filled by one host->device copy of
    host-built data; every plain Python field (``has_lora``, ``max_rank``, ``slots_used``, ...) was
    computed on the host from the adapter names and sequence lengths, so a layer may branch on it
    without reading the device. For CUDA-graph replay with a new adapter mapping, ``prepare_batch(...,
    out=info)`` rewrites ``token_slots`` in place (same tensor, same address) and refreshes the host
    fields.

    Attributes:
        token_slots: ``(M,)`` int32 on the pool's device; the pool slot of each token, ``-1`` = no
            adapter (the token gets exactly the base MoE output).
        slot_ranks: ``(L,)`` int32, the pool's own tensor (shared, not a copy): real rank of each slot
            (0 for an empty slot). Buffers are zero-padded beyond it.
        slot_scalings: ``(L,)`` float32, the pool's own tensor: the LoRA scaling ``s`` of each slot.
        num_tokens: ``M``.
        has_lora: whether any token uses an adapter.
        max_rank: the largest real rank among the slots this batch uses, 0 if none.
        slots_used: sorted distinct slots used by at least one token.
        adapter_names: one entry per sequence, ``None`` = no adapter.
        seq_lens: tokens per sequence (the ``token_slots`` entries of sequence ``i`` are contiguous).
        pool: the pool that built this batch; a layer of another pool refuses it.
        slot_generations: the generation of each slot of ``slots_used`` when the batch was built. The pool
            bumps a slot's generation whenever it empties or rewrites the slot, so a layer refuses a batch
            whose adapter was unloaded or replaced since (``prepare_batch(..., out=batch)`` refreshes it).
        slot_adapters: the adapter name in each slot of ``slots_used`` when the batch was built.
    """

    token_slots: torch.Tensor
    slot_ranks: torch.Tensor
    slot_scalings: torch.Tensor
    num_tokens: int
    has_lora: bool
    max_rank: int
    slots_used: tuple[int, ...]
    adapter_names: tuple[str | None, ...]
    seq_lens: tuple[int, ...]
    pool: object | None = field(default=None, repr=False, compare=False)
    slot_generations: tuple[int, ...] = field(default=(), repr=False, compare=False)
    slot_adapters: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def release(self) -> None:
        """Tells the pool this batch is done, so LRU eviction may take its adapters again.

        Optional: the pool also notices when the batch object is garbage collected. Call it when a
        batch object outlives its use (e.g. kept in a list). Idempotent. A released batch can still run
        as long as its slots are unchanged; once one of its adapters is evicted or unloaded, layers
        refuse it.
        """
        finalizer = self.__dict__.get("_pool_finalizer")
        if finalizer is not None:
            finalizer()  # queues the batch's hold; the pool's next operation drops it
