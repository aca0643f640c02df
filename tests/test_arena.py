"""Tests of the rank-row buddy allocator of the adapter arena (CPU only, pure Python + numpy).

Every state is checked against an independent model built from a numpy occupancy array: live blocks
never overlap and stay inside ``[reserved, total)``, starts are aligned, and the allocator's free blocks
are exactly the maximal aligned blocks of the free space (which is what full buddy coalescing means).
Refusals are checked the same way: ``alloc`` returns None exactly when the free space holds fewer than
``count`` aligned slots of the request's order, and then leaves the state untouched.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from moelora.arena import RankRowAllocator


def _order(rank: int) -> int:
    return (rank - 1).bit_length()


def _maximal_blocks(free: np.ndarray) -> list[tuple[int, int]]:
    """``(start, order)`` of the maximal aligned power-of-two blocks tiling the free units (the model)."""
    padded = np.concatenate(([False], free, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    blocks = []
    for lo, hi in zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True):
        pos = lo
        while pos < hi:
            size = pos & -pos if pos else 1 << (hi - pos).bit_length()
            while pos + size > hi:
                size >>= 1
            blocks.append((pos, size.bit_length() - 1))
            pos += size
    return blocks


def _check(arena: RankRowAllocator, live: dict[int, int]) -> list[tuple[int, int]]:
    """Check ``arena`` against the blocks the test believes are live (start -> rank); return the model's
    free blocks."""
    total, reserved = arena.total_units, arena.reserved_units
    occupancy = np.zeros(total, dtype=np.int32)
    for start, rank in live.items():
        assert start % (1 << _order(rank)) == 0, f"block {start} of rank {rank} is not aligned"
        assert reserved <= start and start + rank <= total, f"block {start}+{rank} outside the arena"
        occupancy[start : start + rank] += 1
    assert occupancy.max(initial=0) <= 1, "live blocks overlap"
    assert arena.used_units == sum(live.values())
    assert arena.free_units == total - reserved - arena.used_units

    free = occupancy == 0
    free[:reserved] = False
    blocks = _maximal_blocks(free)
    histogram = [0] * total.bit_length()
    for _, order in blocks:
        histogram[order] += 1
    stats = arena.stats()
    assert stats["free_blocks_per_order"] == histogram, "free blocks are not fully coalesced"
    largest = max((1 << order for _, order in blocks), default=0)
    assert arena.largest_free_block() == largest
    assert stats["free_units"] == int(free.sum())
    assert stats["live_blocks"] == len(live)
    if arena.free_units:
        assert arena.fragmentation() == pytest.approx(1 - largest / arena.free_units)
    else:
        assert arena.fragmentation() == 0.0
    return blocks


def _slots(blocks: list[tuple[int, int]], rank: int) -> int:
    """How many aligned blocks of ``rank``'s order the free space holds: the most one alloc can get."""
    order = _order(rank)
    return sum(1 << (k - order) for _, k in blocks if k >= order)


def test_exact_sizes_and_alignment() -> None:
    # 1000 units with 64 reserved: not a power of two, and the reserved zero block of a max_rank-64 pool.
    arena = RankRowAllocator(1000, reserved_units=64)
    live: dict[int, int] = {}
    for rank in (1, 3, 4, 8, 12, 16, 24, 64):
        (start,) = arena.alloc(rank, 1)
        live[start] = rank
        _check(arena, live)
    assert arena.used_units == 1 + 3 + 4 + 8 + 12 + 16 + 24 + 64


def test_tail_goes_back() -> None:
    # rank 12 takes an aligned 16 and gives units 12..15 back as one aligned 4-block, which rank 4 reuses.
    arena = RankRowAllocator(16)
    assert arena.alloc(12, 1) == [0]
    assert arena.free_units == 4 and arena.largest_free_block() == 4
    assert arena.alloc(4, 1) == [12]
    assert arena.free_units == 0 and arena.alloc(1, 1) is None
    arena.free([0])
    # Freed as [0, 8) + [8, 12); [8, 12) cannot merge while [12, 16) is live.
    assert arena.largest_free_block() == 8 and arena.free_units == 12
    arena.free([12])
    assert arena.largest_free_block() == 16


def test_rank_12_freed_as_pieces() -> None:
    # The brief's example: rank 12 at start 32 is freed as [32, 40) and [40, 44), merging back to 32.
    arena = RankRowAllocator(64, reserved_units=32)
    assert arena.alloc(12, 1) == [32]
    _check(arena, {32: 12})
    arena.free([32])
    assert _check(arena, {}) == [(32, 5)]


def test_all_or_nothing() -> None:
    # [4, 100) is 4+8+16+32+32+4 units: five aligned 16-slots (one in the 16, two in each 32), not six.
    arena = RankRowAllocator(100, reserved_units=4)
    before = arena.stats()
    assert arena.alloc(16, 6) is None
    assert arena.stats() == before
    assert arena.alloc(200, 1) is None  # larger than the arena
    assert arena.stats() == before
    assert arena.alloc(16, 0) == []
    assert arena.stats() == before
    starts = arena.alloc(16, 5)
    assert starts is not None and sorted(starts) == [16, 32, 48, 64, 80]
    _check(arena, dict.fromkeys(starts, 16))


def test_bulk_alloc_spans_orders() -> None:
    # A bulk request first uses every free block of its own order, then splits larger ones; the last
    # one is cut part way and its rest goes back as aligned pieces.
    arena = RankRowAllocator(1 << 12, reserved_units=8)
    live: dict[int, int] = {}
    scattered = arena.alloc(8, 40)
    live.update(dict.fromkeys(scattered, 8))
    arena.free(scattered[::3])
    for start in scattered[::3]:
        del live[start]
    blocks = _check(arena, live)
    count = _slots(blocks, 6) - 5
    starts = arena.alloc(6, count)
    assert starts is not None and len(starts) == count
    live.update(dict.fromkeys(starts, 6))
    _check(arena, live)


# Totals: 1 and 2 are the smallest arenas; 17, 97, 4099 are primes (no power-of-two structure at all);
# 1000 with 64 reserved is the pool's shape; 4096 with 1 reserved makes every top block get split.
ARENAS = [(1, 0), (2, 1), (17, 0), (97, 3), (1000, 64), (4099, 0), (4096, 1), (0, 0)]


@pytest.mark.parametrize(("total", "reserved"), ARENAS)
def test_free_everything_coalesces(total: int, reserved: int) -> None:
    arena = RankRowAllocator(total, reserved)
    initial = arena.stats()
    initial_blocks = _check(arena, {})
    assert initial["free_units"] == total - reserved
    rng = random.Random(total)
    live: dict[int, int] = {}
    for _ in range(200):
        rank = rng.choice((1, 3, 4, 12, 16, 33, 64))
        starts = arena.alloc(rank, rng.randint(1, 4))
        if starts is not None:
            live.update(dict.fromkeys(starts, rank))
    _check(arena, live)
    order = list(live)
    rng.shuffle(order)
    for i in range(0, len(order), 3):
        arena.free(order[i : i + 3])
    assert arena.free_units == total - reserved
    assert arena.largest_free_block() == initial["largest_free_block"]
    assert arena.stats() == initial
    assert _check(arena, {}) == initial_blocks


def test_bad_free_frees_nothing() -> None:
    arena = RankRowAllocator(257, reserved_units=1)
    a = arena.alloc(12, 3)
    b = arena.alloc(4, 2)
    assert a is not None and b is not None
    arena.free([b[0]])
    before = arena.stats()
    cases = [
        ([a[0], 200], "200"),  # never allocated, after a valid start
        ([a[1] + 4], str(a[1] + 4)),  # inside a live block
        ([b[0]], str(b[0])),  # already freed (double free across calls)
        ([a[2], a[2]], str(a[2])),  # twice in one call
        ([a[0], "x"], "int"),
        (5, "iterable"),
    ]
    for starts, named in cases:
        with pytest.raises(ValueError, match=named):
            arena.free(starts)
        assert arena.stats() == before
    arena.free([*a, b[1]])
    # Back to [1, 257)'s maximal blocks: 1, then 2 ** k at 2 ** k up to 128, then 256 alone.
    assert _check(arena, {}) == [(1, 0), *[(1 << k, k) for k in range(1, 8)], (256, 0)]


def test_numpy_ints_accepted() -> None:
    arena = RankRowAllocator(np.int64(64))
    starts = arena.alloc(np.int32(4), np.int64(3))
    assert starts is not None and all(type(s) is int for s in starts)
    arena.free(np.array(starts))
    assert arena.largest_free_block() == 64


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("64",), "total_units must be an int"),
        ((64.0,), "total_units must be an int"),
        ((True,), "total_units must be an int, got bool"),
        ((-1,), "total_units must be >= 0"),
        ((64, -1), "reserved_units must be >= 0"),
        ((64, 65), r"reserved_units \(65\) exceeds total_units \(64\)"),
        ((64, None), "reserved_units must be an int"),
    ],
)
def test_constructor_errors(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RankRowAllocator(*args)


@pytest.mark.parametrize(
    ("rank", "count", "match"),
    [
        (0, 1, "rank must be >= 1"),
        (-4, 1, "rank must be >= 1"),
        (4, -1, "count must be >= 0"),
        (4.0, 1, "rank must be an int"),
        (True, 1, "rank must be an int, got bool"),
        (4, "2", "count must be an int"),
    ],
)
def test_alloc_errors(rank: object, count: object, match: str) -> None:
    arena = RankRowAllocator(64)
    before = arena.stats()
    with pytest.raises(ValueError, match=match):
        arena.alloc(rank, count)  # type: ignore[arg-type]
    assert arena.stats() == before


# Storm arenas: 4099 is prime; 3001 (prime) with 64 reserved is the pool's shape; 2048 with 1 reserved
# unbalances a power of two. All are small enough that requests of up to 20 x 64 units often fail.
@pytest.mark.parametrize(("total", "reserved", "seed"), [(4099, 0, 1), (3001, 64, 2), (2048, 1, 3)])
def test_storm(total: int, reserved: int, seed: int) -> None:
    rng = random.Random(seed)
    arena = RankRowAllocator(total, reserved)
    allocations: list[list[int]] = []
    live: dict[int, int] = {}
    blocks = _check(arena, live)
    refused = 0
    for _ in range(1000):
        op = rng.random()
        if op < 0.55 or not allocations:
            rank, count = rng.choice((4, 8, 12, 16, 32, 64)), rng.randint(1, 20)
        elif op < 0.65:
            # Any rank up to the largest free block must fit on its own.
            fitting = [r for r in (1, 3, 4, 8, 12, 16, 32, 64) if r <= arena.largest_free_block()]
            if not fitting:
                continue
            rank, count = rng.choice(fitting), 1
        else:
            starts = allocations.pop(rng.randrange(len(allocations)))
            if len(starts) > 1 and rng.random() < 0.3:
                # Free part of an allocation: blocks are freed individually, not per alloc call.
                keep = rng.sample(starts, len(starts) // 2)
                allocations.append(keep)
                starts = [s for s in starts if s not in keep]
            arena.free(starts)
            for start in starts:
                del live[start]
            blocks = _check(arena, live)
            continue

        before = arena.stats()
        starts = arena.alloc(rank, count)
        if starts is None:
            assert _slots(blocks, rank) < count, f"alloc({rank}, {count}) refused although it fits"
            assert arena.stats() == before
            refused += 1
            continue
        assert len(starts) == count
        allocations.append(starts)
        live.update(dict.fromkeys(starts, rank))
        blocks = _check(arena, live)
    assert refused > 20  # the storm did press against a full arena
    for starts in allocations:
        arena.free(starts)
    assert arena.stats() == RankRowAllocator(total, reserved).stats()
