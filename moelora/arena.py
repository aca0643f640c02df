"""Rank-row allocator of the per-device adapter arena: a buddy allocator over *units*.

One unit is one rank row of one (layer, expert) block; a block of rank ``r`` is ``r`` contiguous units
(the kernels read rows ``start .. start + r - 1`` with a fixed stride). The scheme:

* Free space is kept as aligned power-of-two blocks, one set of starts per order (block of order ``k``
  = ``2**k`` units, start a multiple of ``2**k``). ``[reserved, total)`` starts as its decomposition
  into maximal aligned blocks, so ``total`` need not be a power of two.
* ``alloc(r, n)`` takes ``n`` aligned blocks of order ``ceil(log2 r)`` (smallest orders first, larger
  blocks split in bulk) and gives each block's tail beyond ``r`` units straight back, so a block uses
  exactly ``r`` units. It is all or nothing: the capacity is counted before anything moves.
* ``free`` returns a block as the aligned pieces it is made of (the binary decomposition of ``r`` from
  its start) and merges each piece with its buddy as a classic buddy free does.

Free blocks are always the maximal aligned blocks of the free space (no two free buddies), so the free
state depends only on which blocks are live and fragmentation stays bounded whatever the load order.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

__all__ = ["RankRowAllocator"]


def _as_int(name: str, value: Any) -> int:
    # bool is an int subclass, but alloc(True, 1) is a bug in the caller, not a rank of 1.
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def _order_of(rank: int) -> int:
    """Smallest ``k`` with ``2**k >= rank``."""
    return (rank - 1).bit_length()


def _aligned_pieces(offset: int, end: int) -> list[tuple[int, int]]:
    """``(offset, order)`` of the aligned pieces tiling ``[offset, end)``, where ``end`` is a multiple of a
    power of two larger than ``end - offset`` (so each piece is the lowest set bit of its start)."""
    pieces = []
    while offset < end:
        size = offset & -offset
        pieces.append((offset, size.bit_length() - 1))
        offset += size
    return pieces


class RankRowAllocator:
    """Buddy allocator of rank rows (units) in ``[reserved_units, total_units)``; see the module doc."""

    def __init__(self, total_units: int, reserved_units: int = 0) -> None:
        total_units = _as_int("total_units", total_units)
        reserved_units = _as_int("reserved_units", reserved_units)
        if total_units < 0:
            raise ValueError(f"total_units must be >= 0, got {total_units}")
        if reserved_units < 0:
            raise ValueError(f"reserved_units must be >= 0, got {reserved_units}")
        if reserved_units > total_units:
            raise ValueError(f"reserved_units ({reserved_units}) exceeds total_units ({total_units})")
        self._total = total_units
        self._reserved = reserved_units
        # Orders 0 .. floor(log2 total): no aligned block can be larger than the arena.
        self._free: list[set[int]] = [set() for _ in range(total_units.bit_length())]
        self._live: dict[int, int] = {}  # start -> rank; free needs the rank to know the block's size
        self._used = 0
        start = reserved_units
        while start < total_units:
            order = (start & -start).bit_length() - 1 if start else len(self._free) - 1
            while start + (1 << order) > total_units:
                order -= 1
            self._free[order].add(start)
            start += 1 << order

    # -- queries -------------------------------------------------------------------------------------------

    @property
    def total_units(self) -> int:
        return self._total

    @property
    def reserved_units(self) -> int:
        return self._reserved

    @property
    def used_units(self) -> int:
        return self._used

    @property
    def free_units(self) -> int:
        return self._total - self._reserved - self._used

    def live_starts(self) -> frozenset[int]:
        """First units of the blocks allocated and not freed."""
        return frozenset(self._live)

    def largest_free_block(self) -> int:
        """Units of the largest aligned free block: any rank up to this fits with ``count=1``."""
        for order in range(len(self._free) - 1, -1, -1):
            if self._free[order]:
                return 1 << order
        return 0

    def fragmentation(self) -> float:
        """``1 - largest_free_block / free_units``; 0.0 when nothing is free."""
        free = self.free_units
        return 0.0 if free == 0 else 1.0 - self.largest_free_block() / free

    def stats(self) -> dict[str, Any]:
        """The numbers above plus the free-block histogram, as plain ints/floats/lists (JSON-friendly)."""
        return {
            "total_units": self._total,
            "reserved_units": self._reserved,
            "used_units": self._used,
            "free_units": self.free_units,
            "live_blocks": len(self._live),
            "largest_free_block": self.largest_free_block(),
            "fragmentation": self.fragmentation(),
            "free_blocks_per_order": [len(bucket) for bucket in self._free],
        }

    # -- alloc / free --------------------------------------------------------------------------------------

    def alloc(self, rank: int, count: int) -> list[int] | None:
        """Start units of ``count`` blocks of ``rank`` contiguous units each, or None (state unchanged)
        if they do not all fit."""
        rank = _as_int("rank", rank)
        count = _as_int("count", count)
        if rank <= 0:
            raise ValueError(f"rank must be >= 1, got {rank}")
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count == 0:
            return []
        order = _order_of(rank)
        if not self._fits(order, count):
            return None
        starts = self._take_aligned(order, count)
        size = 1 << order
        if rank < size:
            # The tail's pieces have their buddies inside the block's own used rows, so none can merge:
            # they go straight into the free sets, one bulk update per piece position.
            for offset, piece_order in _aligned_pieces(rank, size):
                self._free[piece_order].update([start + offset for start in starts])
        self._live.update(dict.fromkeys(starts, rank))
        self._used += rank * count
        return starts

    def can_alloc(self, rank: int, count: int) -> bool:
        """Whether :meth:`alloc` of ``count`` blocks of ``rank`` would succeed now (nothing changes)."""
        rank = _as_int("rank", rank)
        count = _as_int("count", count)
        if rank <= 0 or count < 0:
            raise ValueError(f"rank must be >= 1 and count >= 0, got rank {rank}, count {count}")
        return count == 0 or self._fits(_order_of(rank), count)

    def free(self, starts: Iterable[int]) -> None:
        """Free blocks returned by :meth:`alloc`. Every start is checked before anything is freed."""
        try:
            items = list(starts)
        except TypeError:
            raise ValueError(f"free: starts must be an iterable of ints, got {starts!r}") from None
        if not all(type(s) is int for s in items):  # exact ints (the usual case) skip the slow check
            try:
                items = [_as_int("start", s) for s in items]
            except ValueError as err:
                raise ValueError(f"free: {err}; nothing freed") from None
        live = self._live
        unique = set(items)
        if not unique <= live.keys():
            missing = sorted(unique - live.keys())
            shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
            raise ValueError(
                f"free: not the start of a live block (never allocated, already freed, or inside a block): "
                f"{shown}; nothing freed"
            )
        if len(unique) != len(items):
            seen: set[int] = set()
            dup = next(s for s in items if s in seen or seen.add(s))
            raise ValueError(f"free: start {dup} given more than once; nothing freed")

        ranks = list(map(live.pop, items))
        self._used -= sum(ranks)
        free = self._free
        pieces_of: dict[int, list[tuple[int, int]]] = {}
        for start, rank in zip(items, ranks, strict=True):
            pieces = pieces_of.get(rank)
            if pieces is None:
                pieces = pieces_of[rank] = self._rank_pieces(rank)
            for offset, order in pieces:
                # Classic buddy free: while the buddy is free, absorb it and go up one order. A merge
                # never leaves the arena, since a free buddy is itself a valid block. (A level-by-level
                # bulk merge with set algebra was measured: no faster in CPython.)
                pos = start + offset
                bucket = free[order]
                buddy = pos ^ (1 << order)
                while buddy in bucket:
                    bucket.remove(buddy)
                    pos &= ~(1 << order)
                    order += 1
                    bucket = free[order]
                    buddy = pos ^ (1 << order)
                bucket.add(pos)

    # -- internals -----------------------------------------------------------------------------------------

    @staticmethod
    def _rank_pieces(rank: int) -> list[tuple[int, int]]:
        """``(offset, order)`` of the aligned pieces of a rank-``rank`` block, largest first (rank 12 ->
        ``[(0, 3), (8, 2)]``): the block's start is aligned to ``2**ceil(log2 rank)``, so each is aligned."""
        pieces = []
        offset = 0
        for order in range(rank.bit_length() - 1, -1, -1):
            if rank >> order & 1:
                pieces.append((offset, order))
                offset += 1 << order
        return pieces

    def _fits(self, order: int, count: int) -> bool:
        # Free blocks below `order` cannot help: they are maximal, so they never merge into one of
        # `order`. Each free block of order k >= `order` holds exactly 2**(k - order) aligned slots.
        available = 0
        for k in range(order, len(self._free)):
            available += len(self._free[k]) << (k - order)
            if available >= count:
                return True
        return False

    def _take_aligned(self, order: int, count: int) -> list[int]:
        """Remove ``count`` aligned blocks of ``order`` from the free sets (they must fit: see
        :meth:`_fits`) and return their starts."""
        size = 1 << order
        starts: list[int] = []
        need = count
        k = order
        # Smallest orders first, so large blocks survive for large ranks. A block of order k is split
        # in bulk: its first slots are taken as a range, not by repeated halving.
        while need:
            bucket = self._free[k]
            if bucket:
                per = 1 << (k - order)
                block = 1 << k
                whole, part = divmod(need, per)
                if len(bucket) <= whole:
                    taken = list(bucket)
                    bucket.clear()
                    part = 0  # the remainder comes from a larger order
                else:
                    taken = [bucket.pop() for _ in range(whole)]
                if per == 1:
                    starts.extend(taken)
                else:
                    for b in taken:
                        starts.extend(range(b, b + block, size))
                need -= len(taken) * per
                if part:
                    # Only the last block is cut; the bucket still holds one since it had more than
                    # `whole` blocks.
                    b = bucket.pop()
                    cut = b + part * size
                    starts.extend(range(b, cut, size))
                    # The rest of this block: its pieces' buddies lie in the slots just taken.
                    for pos, piece_order in _aligned_pieces(cut, b + block):
                        self._free[piece_order].add(pos)
                    need = 0
            k += 1
        return starts
