"""What a :class:`moelora.pool.MoELoRAMemoryPool` holds, for dashboards: ``pool.memory_report()``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["AdapterMemory", "PoolMemoryReport", "PoolState"]


@dataclass(frozen=True)
class PoolState:
    """Which adapters a pool holds where, at one moment (``pool.state()``, taken under the pool's lock).

    Attributes:
        resident: adapters in slots, least recently used first (the order LRU eviction considers them in).
        host: adapters in the host tier only, least recently used first.
        loading: adapters with an asynchronous load under way (not usable until it ends).
        pinned: resident adapters LRU eviction never takes.
        slots: resident adapter -> slot.
        users: resident adapter -> live batches holding its slot (LRU eviction passes over it while > 0).
        evictions: adapters LRU eviction has taken out of slots since the pool was built (explicit unloads
            not counted).
    """

    resident: tuple[str, ...]
    host: tuple[str, ...]
    loading: tuple[str, ...]
    pinned: frozenset[str]
    slots: dict[str, int]
    users: dict[str, int]
    evictions: int = 0

    def evictable(self) -> tuple[str, ...]:
        """Resident adapters LRU eviction may take, in the order it would."""
        return tuple(n for n in self.resident if n not in self.pinned and not self.users[n])


@dataclass(frozen=True)
class AdapterMemory:
    """One adapter the pool holds.

    Attributes:
        name: the adapter's name.
        tier: ``"gpu"`` (resident) or ``"host"`` (the host tier only).
        slot: its slot, ``None`` in the host tier.
        pinned: never evicted (``pool.pin``).
        users: live batches using its slot.
        rank: its rank (its largest module rank).
        blocks: the (layer, expert) pairs it trains: the arena blocks of ``rank`` rows it takes.
        bytes: device bytes it takes in the arena (``blocks x rank`` rows), 0 in the host tier.
        host_bytes: its host copy's bytes (the host tier's, or what a load staged).
    """

    name: str
    tier: str
    slot: int | None
    pinned: bool
    users: int
    rank: int
    blocks: int
    bytes: int
    host_bytes: int


@dataclass(frozen=True)
class PoolMemoryReport:
    """The pool's memory at one moment.

    Attributes:
        device: where the arena lives.
        slots, free_slots: adapter slots, and those holding nothing.
        arena_bytes: device bytes of the arena for adapter rows (allocated once, whatever it holds).
        table_bytes: device bytes of the block table (a row per layer and slot of E int32 entries).
        used_bytes: arena bytes the resident adapters take (``AdapterMemory.bytes`` summed).
        free_bytes: arena bytes not taken.
        largest_free_bytes: the largest run of free rows a block can take (aligned to a power of two).
        max_rank_free_bytes: free bytes in runs that can take a block of the pool's ``max_rank``.
        host_tier_bytes: host memory of the host tier's copies.
        staging_bytes: pinned host memory of the staging buffer (0 without one).
        adapters: every held adapter, resident ones in slot order, then the host tier, least recent first.
    """

    device: str
    slots: int
    free_slots: int
    arena_bytes: int
    table_bytes: int
    used_bytes: int
    free_bytes: int
    largest_free_bytes: int
    max_rank_free_bytes: int
    host_tier_bytes: int
    staging_bytes: int
    adapters: list[AdapterMemory] = field(default_factory=list)

    @property
    def fragmentation(self) -> float:
        """The share of free bytes a ``max_rank`` block cannot use (0.0 with nothing free)."""
        return 1.0 - self.max_rank_free_bytes / self.free_bytes if self.free_bytes else 0.0

    def as_dict(self) -> dict:
        """The report as plain JSON-ready values."""
        return asdict(self) | {"fragmentation": self.fragmentation}
