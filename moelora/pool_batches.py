"""Batches of a pool: the per-token slot mapping of a step, and the holds that keep its adapters resident.

:class:`_PoolBatches` holds :class:`moelora.pool.MoELoRAMemoryPool`'s batch methods (a mixin: ``self`` is
the pool, its state changed only inside the pool's transactions, docs/architecture.md "Pool state").
"""

from __future__ import annotations

import array
import weakref
from collections.abc import Iterable, Sequence

import torch

from moelora.batch_info import MoELoRABatchInfo, StaleBatchError
from moelora.stager import _is_int

# The token index of a batch is int32 on the device.
_MAX_TOKENS = (1 << 31) - 1
_NAME_TYPES = frozenset((str, type(None)))


class _Hold:
    """A live batch's claim on its slots: LRU eviction passes over a slot while a hold records its current
    generation. ``names`` are the batch's adapters in the order a step touches them (first use first)."""

    __slots__ = ("every_name_held", "generations", "names", "slots")

    def __init__(self, slots: tuple[int, ...], generations: tuple[int, ...], names: tuple[str, ...],
                 every_name_held: bool) -> None:
        self.slots, self.generations, self.names = slots, generations, names
        self.every_name_held = every_name_held  # no adapter of the batch is named with zero tokens


class _PoolBatches:
    """Batch building and checking of :class:`moelora.pool.MoELoRAMemoryPool` (a mixin)."""

    def is_current(self, batch: MoELoRABatchInfo) -> bool:
        """True when ``batch`` was built by this pool and none of its slots changed since."""
        gens = self._slot_generation
        return batch.pool is self and all(
            gens[s] == g for s, g in zip(batch.slots_used, batch.slot_generations, strict=True))

    def trained_experts(self, batch: MoELoRABatchInfo, layer_id: int) -> int:
        """The experts of MoE layer ``layer_id`` that ``batch``'s adapters train, summed over its adapters
        (host facts: the arena blocks each slot holds in that layer)."""
        self.layer(layer_id)  # a ValueError naming the valid ids for any other
        layer = self.layer_ids.index(layer_id)
        return sum(len(units[layer]) for units in (self._slot_units[s] for s in batch.slots_used) if units)

    def check_batch(self, batch: MoELoRABatchInfo) -> None:
        """Refuses a batch that would run with weights other than its own: one built by another pool
        (ValueError), or one whose adapter was unloaded, evicted or replaced in its slot since it was built
        (:class:`StaleBatchError`; :meth:`refresh` rebuilds it in place). Host-side comparisons only (no
        device read)."""
        if not isinstance(batch, MoELoRABatchInfo):
            raise TypeError(
                f"batch must be a MoELoRABatchInfo from pool.prepare_batch, got {type(batch).__name__}")
        if batch.pool is not self:
            owner = "no pool (built by hand)" if batch.pool is None else f"another pool ({batch.pool!r})"
            raise ValueError(
                f"this batch was built by {owner}, not by this layer's pool {self!r}: build it with this "
                "pool's prepare_batch"
            )
        gens = self._slot_generation
        seen = zip(batch.slots_used, batch.slot_generations, batch.slot_adapters, strict=True)
        for slot, gen, name in seen:
            if gens[slot] != gen:
                now = self.slot_adapters[slot]
                now = f"now holds {now!r}" if isinstance(now, str) else "is now empty"
                raise StaleBatchError(
                    f"stale batch: adapter {name!r} was unloaded or evicted since this batch was built (its "
                    f"slot {slot} {now}); call pool.refresh(batch) (or pool.prepare_batch(..., out=batch)) "
                    "before this forward"
                )

    def _hold(self, batch: MoELoRABatchInfo, slots: tuple[int, ...], generations: tuple[int, ...],
              names: tuple[str, ...], every_name_held: bool) -> None:
        """Makes ``batch`` a live user of ``slots`` (at ``generations``) until it is released, garbage
        collected, or rebuilt in place (which moves the hold)."""
        hold = batch.__dict__.get("_pool_hold")
        if hold is not None and hold in self._holds:  # rebuilt in place: the batch's hold moves
            self._count_hold(hold, -1)
            hold.slots, hold.generations, hold.names = slots, generations, names
            hold.every_name_held = every_name_held
        else:
            hold = _Hold(slots, generations, names, every_name_held)
            self._holds.add(hold)
            batch.__dict__["_pool_hold"] = hold
            # The finalizer only queues the hold: the next transaction drops it.
            batch.__dict__["_pool_finalizer"] = weakref.finalize(batch, self._released.append, hold)
        self._count_hold(hold, +1)

    def _count_hold(self, hold: _Hold, sign: int) -> None:
        gens = self._slot_generation
        for slot, gen in zip(hold.slots, hold.generations, strict=True):
            if gens[slot] == gen:  # a slot emptied or rewritten since no longer counts this hold
                self._slot_users[slot] += sign

    def _drop_released_holds(self) -> None:
        released = self._released
        while released:
            hold = released.popleft()
            if hold in self._holds:
                self._holds.discard(hold)
                self._count_hold(hold, -1)

    def prepare_batch(
        self,
        adapter_names: Sequence[str | None],
        seq_lens: Sequence[int] | None = None,
        *,
        out: MoELoRABatchInfo | None = None,
    ) -> MoELoRABatchInfo:
        """Builds the per-token slot mapping of one step.

        Args:
            adapter_names: one entry per sequence, an adapter name or ``None`` (no adapter).
            seq_lens: tokens per sequence (default: 1 each, i.e. decode). Tokens of a sequence are
                contiguous, sequences in the given order.
            out: an earlier batch info to update in place (same total token count required): its
                ``token_slots`` tensor keeps its address, e.g. for CUDA-graph replay.

        Adapters named that are in the host tier are brought back into slots first (never evicting
        another adapter of this batch). The batch is a live user of its adapters' slots until it is
        released, garbage collected or rebuilt (LRU eviction passes over them), and its adapters become
        the most recently used, in the order of their first use. The slot ids are built on the host and
        sent with a single non-blocking host->device copy; nothing is read back from the device. With
        ``out=`` and the same names and lengths as ``out`` was built with, while its slots still hold the
        same adapters, ``out`` is returned as it is.
        """
        if isinstance(adapter_names, (str, bytes)):
            raise ValueError("adapter_names must be a sequence with one entry per sequence, not a str")
        if not isinstance(adapter_names, Iterable):
            raise TypeError(
                "adapter_names must be a sequence with one entry per sequence (str or None), "
                f"got {type(adapter_names).__name__}"
            )
        names = tuple(adapter_names)
        if not set(map(type, names)) <= _NAME_TYPES:  # the exact check only where the quick one fails
            bad_names = [n for n in names if n is not None and not isinstance(n, str)]
            if bad_names:
                raise TypeError(f"adapter names must be str or None, got {bad_names!r}")
        if seq_lens is None:
            lens = (1,) * len(names)
            num_tokens = len(names)
        else:
            if isinstance(seq_lens, (str, bytes)) or not isinstance(seq_lens, Iterable):
                raise TypeError(f"seq_lens must be a sequence of ints, got {type(seq_lens).__name__}")
            lens = tuple(seq_lens)
            if len(lens) != len(names):
                raise ValueError(f"seq_lens has {len(lens)} entries for {len(names)} sequences")
            bad = [n for n in lens if not _is_int(n) or n < 0]
            if bad:
                raise ValueError(f"seq_lens must be non-negative ints, got {bad!r}")
            lens = tuple(int(n) for n in lens)
            num_tokens = sum(lens)
        if num_tokens > _MAX_TOKENS:
            raise ValueError(f"a batch of {num_tokens} tokens is more than the {_MAX_TOKENS} a batch's int32 "
                             "token index can address; split it into steps")
        if out is not None:
            if not isinstance(out, MoELoRABatchInfo):
                raise TypeError(
                    f"out must be a MoELoRABatchInfo from prepare_batch, got {type(out).__name__}")
            if out.pool is not self:
                raise ValueError("out= was built by another pool; in-place updates need a batch of this pool")
            if out.num_tokens != num_tokens or out.token_slots.numel() != num_tokens:
                raise ValueError(
                    f"out= holds {out.token_slots.numel()} tokens but this batch has {num_tokens}; "
                    "in-place update needs the same token count"
                )
            if out.token_slots.device != self.slot_ranks.device:
                raise ValueError(f"out.token_slots is on {out.token_slots.device}, the pool on {self.device}")

        with self._transaction:
            return self._prepare_batch_locked(names, lens, num_tokens, out, one_token_each=seq_lens is None)

    def refresh(self, batch: MoELoRABatchInfo) -> bool:
        """Makes a stale ``batch`` current again, in place, when every adapter it names is still held
        (resident, or in the host tier: brought back): what a serving loop calls when an unload or an
        eviction landed between its ``prepare_batch`` and its forward, so the step is not lost. Returns
        False (and changes nothing) for a current batch, True after a rebuild; ValueError naming the
        adapters that are gone when one is. Its tokens then use the same adapters' weights, in whatever
        slots they now occupy; ``token_slots`` keeps its tensor (CUDA-graph replay)."""
        if not isinstance(batch, MoELoRABatchInfo):
            raise TypeError(f"batch must be a MoELoRABatchInfo from pool.prepare_batch, got "
                            f"{type(batch).__name__}")
        with self._transaction:
            if self.is_current(batch):
                return False
            self.prepare_batch(batch.adapter_names, batch.seq_lens, out=batch)
            return True

    def _prepare_batch_locked(
        self, names: tuple[str | None, ...], lens: tuple[int, ...], num_tokens: int,
        out: MoELoRABatchInfo | None, *, one_token_each: bool = False
    ) -> MoELoRABatchInfo:
        if out is not None and out.adapter_names == names and out.seq_lens == lens:
            hold = out.__dict__.get("_pool_hold")
            # Unless a name has no tokens: it holds no slot, so only the full check below sees it is gone.
            if hold is not None and hold in self._holds and hold.every_name_held and self.is_current(out):
                # The same mapping as when ``out`` was built, and each of its slots still holds the same
                # adapter (a decode step whose rows did not change): token_slots already says it all.
                self._touch(hold.names)
                return out
        distinct = dict.fromkeys(names)
        distinct.pop(None, None)
        # An adapter being loaded asynchronously is not usable until published, host copy or not.
        unknown = [n for n in distinct if n in self._pending
                   or (n not in self.adapter_slots and n not in self._host_tier)]
        if unknown:
            loading = sorted(n for n in unknown if n in self._pending)
            gone = sorted(n for n in unknown if n not in self._pending)
            what = [f"unknown adapter(s) {gone}"] if gone else []
            what += [f"adapter(s) {loading} still loading (load_adapter_async)"] if loading else []
            raise ValueError(f"{'; '.join(what)}; {self._known()}")
        # A name with no tokens takes no slot (it may stay in the host tier).
        every_sequence_has_tokens = one_token_each or min(lens, default=1) > 0
        if every_sequence_has_tokens:
            wanted = tuple(distinct)
        else:
            wanted = tuple(dict.fromkeys(n for n, k in zip(names, lens, strict=True)
                                         if n is not None and k > 0))
        slot_of = self.adapter_slots
        # Taken out of the host tier before anything is placed: placing one can evict a resident adapter
        # into the host tier, which may push another wanted one out of it. The batch's resident adapters
        # and those brought back are protected, so bringing one back never evicts another of the batch.
        missing = [self._host_tier[n] for n in wanted if n not in slot_of]
        if missing:
            protected = {slot_of[n] for n in wanted if n in slot_of}
            for staged in missing:
                protected.add(self._place(staged, protected=protected))
        self._touch(wanted)
        if every_sequence_has_tokens:
            table = {n: slot_of[n] for n in wanted}
            table[None] = -1
            seq_slots = array.array("i", [table[n] for n in names])
        else:
            seq_slots = array.array("i", (slot_of[n] if n is not None and k > 0 else -1
                                          for n, k in zip(names, lens, strict=True)))
        used = tuple(sorted(map(slot_of.__getitem__, wanted)))
        max_rank = max(map(self.slot_rank_host.__getitem__, used), default=0)
        generations = tuple(map(self._slot_generation.__getitem__, used))
        slot_names = tuple(map(self.slot_adapters.__getitem__, used))

        # One int per token: per sequence, repeated on the host by torch (not a Python list of M ints).
        host = (torch.frombuffer(seq_slots, dtype=torch.int32) if seq_slots
                else torch.empty((0,), dtype=torch.int32))
        if not (every_sequence_has_tokens and num_tokens == len(names)):  # not one token each (decode)
            host = host.repeat_interleave(torch.tensor(lens))
        # From pageable memory: the driver stages a host->device copy this small before returning (no
        # device sync), which costs the host less than pinning a buffer for it.
        on_cuda = self.device.type == "cuda"

        if out is None:
            batch = MoELoRABatchInfo(
                token_slots=host.to(self.device, non_blocking=on_cuda),
                slot_ranks=self.slot_ranks,
                slot_scalings=self.slot_scalings,
                num_tokens=num_tokens,
                has_lora=bool(used),
                max_rank=max_rank,
                slots_used=used,
                adapter_names=names,
                seq_lens=lens,
                pool=self,
                slot_generations=generations,
                slot_adapters=slot_names,
            )
            self._hold(batch, used, generations, wanted, len(wanted) == len(distinct))
            return batch

        out.token_slots.copy_(host, non_blocking=on_cuda)
        out.slot_ranks = self.slot_ranks
        out.slot_scalings = self.slot_scalings
        out.has_lora = bool(used)
        out.max_rank = max_rank
        out.slots_used = used
        out.adapter_names = names
        out.seq_lens = lens
        out.slot_generations = generations
        out.slot_adapters = slot_names
        self._hold(out, used, generations, wanted, len(wanted) == len(distinct))
        return out
