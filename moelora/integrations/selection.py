"""The adapter choice of an attached model: names per batch row and the batch infos built for them
(:class:`_Selection`), and the handle's choice that every swapped module reads (:class:`_Selector`)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from moelora.batch_info import MoELoRABatchInfo
from moelora.pool import MoELoRAMemoryPool


class _Selection:
    """One active adapter choice: names per batch row and the batch infos built for it, by token count."""

    def __init__(self, names: tuple[str | None, ...], seq_lens: tuple[int, ...] | None) -> None:
        self.names = names
        self.seq_lens = seq_lens
        self.padding: torch.Tensor | None = None  # (tokens,) bool: filler tokens, routed to no expert
        self.any_adapter = any(n is not None for n in names)
        self.batches: dict[Any, MoELoRABatchInfo] = {}  # by token count (and set, copies, rows)
        self.built: dict[Any, int] = {}  # the epoch each batch was last built for
        self.epoch = 0
        self.builds = 0

    def retarget(self, other: _Selection) -> None:
        """Takes ``other``'s names and lengths for the next step; the batch infos are kept and rebuilt in
        place (``prepare_batch(..., out=)``) at their first use in that step."""
        self.names, self.seq_lens, self.any_adapter = other.names, other.seq_lens, other.any_adapter
        self.padding = other.padding
        self.epoch += 1

    def lens_for(self, num_tokens: int) -> tuple[int, ...]:
        if self.seq_lens is not None:
            if sum(self.seq_lens) != num_tokens:
                raise ValueError(
                    f"the MoE layer got {num_tokens} tokens but seq_lens {list(self.seq_lens)} sum to "
                    f"{sum(self.seq_lens)}"
                )
            return self.seq_lens
        rows = len(self.names)
        if num_tokens % rows:
            raise ValueError(
                f"the MoE layer got {num_tokens} tokens, not a multiple of the {rows} batch rows named in "
                f"handle.adapters({list(self.names)}): give one name per batch row"
            )
        return (num_tokens // rows,) * rows

    def release(self, *, keep: bool = False) -> None:
        """Releases the batch infos' holds on their slots (and forgets them unless ``keep``)."""
        for batch in self.batches.values():
            batch.release()
        if not keep:
            self.batches.clear()
            self.built.clear()


class _Selector:
    """The handle's adapter choice, read by every swapped module of the model.

    Shared by all threads (a ``generate`` running in a worker thread, e.g. with a streamer, sees the
    context entered by the caller); one choice is active per model at a time: contexts nest, the
    innermost wins, and ``set_adapters`` gives the choice used outside any context.
    """

    def __init__(self, pools: dict[str, MoELoRAMemoryPool]) -> None:
        self.pools = pools  # expert set -> its pool; one set (the first is the primary) for most models
        self.pool = next(iter(pools.values()))
        # adapter name -> the expert sets it has LoRA in (recorded where a layer has several sets; an
        # adapter not listed is every set's)
        self.covers: dict[str, frozenset[str]] = {}
        self.lock = threading.RLock()
        self.stack: list[_Selection] = []
        self.default: _Selection | None = None

    def make(self, names: Sequence[str | None], seq_lens: Sequence[int] | None) -> _Selection:
        if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
            raise ValueError(f"adapter names must be a list with one entry per batch row, got {names!r}")
        names_t = tuple(names)
        if not names_t:
            raise ValueError("adapter names must name at least one batch row")
        bad = [n for n in names_t if n is not None and not isinstance(n, str)]
        if bad:
            raise ValueError(f"adapter names must be str or None, got {bad!r}")
        unknown = sorted({n for n in names_t
                          if n is not None and not any(n in pool for pool in self.pools.values())})
        if unknown:
            raise ValueError(f"unknown adapter(s) {unknown}; loaded adapters: {self.pool.adapters()}")
        lens_t = None
        if seq_lens is not None:
            lens_t = tuple(seq_lens)
            if len(lens_t) != len(names_t) or any(
                not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in lens_t
            ):
                raise ValueError(
                    f"seq_lens must hold one non-negative int per name ({len(names_t)}), got {list(lens_t)}"
                )
        return _Selection(names_t, lens_t)

    def active(self) -> _Selection | None:
        with self.lock:
            return self.stack[-1] if self.stack else self.default

    def batch_for(self, num_tokens: int, copies: int = 1, repeat: int = 1, *, expert_set: str | None = None,
                  token_rows: torch.Tensor | None = None) -> MoELoRABatchInfo | None:
        """The batch info of the active choice for ``num_tokens`` tokens; None = every token base. With
        ``copies`` the batch covers that many copies of those tokens one after the other (the dense form's
        rows of every expert); with ``repeat`` each token stands ``repeat`` times in a row (a row per
        routed pair). ``expert_set``: the batch of that set's pool (default the primary), where an adapter
        without LoRA in the set runs its rows as base; ``token_rows``: the set gets only these of the
        layer's tokens (a bool per token, :class:`_TokenTypes`), whose count per sequence is read on the
        host."""
        with self.lock:
            sel = self.stack[-1] if self.stack else self.default
            if sel is None or not sel.any_adapter:
                return None
            pool = self.pool if expert_set is None else self.pools[expert_set]
            names = sel.names
            if expert_set is not None and self.covers:
                names = tuple(n if n is None or expert_set in self.covers.get(n, (expert_set,)) else None
                              for n in names)
                if all(n is None for n in names):
                    return None
            if token_rows is None:
                lens = sel.lens_for(num_tokens)
                key: Any = num_tokens if copies == repeat == 1 else (num_tokens, copies, repeat)
            else:
                ends = torch.tensor(sel.lens_for(token_rows.numel()), device=token_rows.device).cumsum(0)
                counts = token_rows.long().cumsum(0)[ends - 1] if token_rows.numel() else ends * 0
                lens = tuple(int(n) for n in torch.diff(counts, prepend=counts.new_zeros(1)).tolist())
                if sum(lens) != num_tokens:
                    raise ValueError(f"the expert set {expert_set!r} got {num_tokens} tokens, its token-type "
                                     f"mask marks {sum(lens)}")
                key = ("rows", lens, copies, repeat)
            if expert_set is not None and pool is not self.pool:
                key = (expert_set, key)
            batch = sel.batches.get(key)
            if batch is None or sel.built[key] != sel.epoch or not pool.is_current(batch):
                # (Re)built: first use, or an adapter was unloaded or evicted since (rebuilt in place; an
                # unloaded one that is not in the host tier is refused here, by name).
                lens = tuple(n * repeat for n in lens) * copies
                if batch is None:
                    batch = sel.batches[key] = pool.prepare_batch(names * copies, lens)
                else:
                    pool.prepare_batch(names * copies, lens, out=batch)
                sel.built[key] = sel.epoch
                sel.builds += 1
            return batch

    def clear(self) -> None:
        with self.lock:
            for sel in self.stack:
                sel.release()
            self.stack.clear()
            if self.default is not None:
                self.default.release()
            self.default = None
