"""What a :class:`moelora.pool.MoELoRAMemoryPool` holds, for dashboards: ``pool.memory_report()``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["AdapterMemory", "PoolMemoryReport"]


@dataclass(frozen=True)
class AdapterMemory:
    """One adapter the pool holds.

    Attributes:
        name: the adapter's name.
        tier: ``"gpu"`` (in a slot) or ``"host"`` (the host tier only).
        slot: its slot, ``None`` in the host tier.
        pinned: never evicted (``pool.pin``).
        users: live batches using its slot.
        rank: the slot rank (its largest module rank).
        bytes: its weights at that rank, every layer and expert stack it has (the host copy's size, and
            what a slot write copies).
        slot_bytes: device bytes its slot reserves (every layer at ``max_rank``), 0 in the host tier.
    """

    name: str
    tier: str
    slot: int | None
    pinned: bool
    users: int
    rank: int
    bytes: int
    slot_bytes: int


@dataclass(frozen=True)
class PoolMemoryReport:
    """The pool's memory at one moment.

    Attributes:
        device: where the slots live.
        slots, free_slots: adapter slots, and those holding nothing.
        device_bytes: bytes of all slot buffers (allocated once, whatever they hold).
        slot_bytes: bytes of one slot.
        resident_bytes: the resident adapters' own bytes (``AdapterMemory.bytes`` summed).
        padding_bytes: bytes the resident adapters' slots reserve beyond their adapters' own (rank below
            ``max_rank``, experts or layers an adapter does not train): the slot layout's waste.
        host_tier_bytes: host memory of the host tier's copies.
        staging_bytes: pinned host memory of the staging buffer (0 without one).
        adapters: every held adapter, resident ones in slot order, then the host tier, least recent first.
    """

    device: str
    slots: int
    free_slots: int
    device_bytes: int
    slot_bytes: int
    resident_bytes: int
    padding_bytes: int
    host_tier_bytes: int
    staging_bytes: int
    adapters: list[AdapterMemory] = field(default_factory=list)

    @property
    def padding_fraction(self) -> float:
        """``padding_bytes`` over the bytes the resident adapters' slots reserve (0.0 with none)."""
        occupied = sum(a.slot_bytes for a in self.adapters)
        return self.padding_bytes / occupied if occupied else 0.0

    def as_dict(self) -> dict:
        """The report as plain JSON-ready values."""
        return asdict(self) | {"padding_fraction": self.padding_fraction}
