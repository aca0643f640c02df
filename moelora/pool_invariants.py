"""The pool's invariants, checked after every transaction in debug mode (``MoELoRAMemoryPool
.check_invariants``; docs/architecture.md, "Pool state"). One function over the pool's state, apart from
the class that owns it: what must hold between its host maps, the allocator, the live-batch holds and the
device tables."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moelora.pool import MoELoRAMemoryPool


def check_pool_invariants(pool: MoELoRAMemoryPool, loading_marker: object) -> None:
    """AssertionError naming the first invariant of ``pool`` broken (``loading_marker``: what a slot
    reserved by an asynchronous load holds). Reads the device tables (a sync) unless a CUDA graph is being
    captured. The caller holds the pool's lock."""

    def expect(ok: bool, what: str) -> None:
        if not ok:
            raise AssertionError(f"pool invariant broken: {what}")

    resident = {n: s for s, n in enumerate(pool.slot_adapters) if isinstance(n, str)}
    loading = {s for s, n in enumerate(pool.slot_adapters) if n is loading_marker}
    expect(resident == pool.adapter_slots, f"slot_adapters {pool.slot_adapters} and adapter_slots "
           f"{pool.adapter_slots} disagree")
    expect(all(n is None or n is loading_marker or isinstance(n, str) for n in pool.slot_adapters),
           "a slot holds something other than a name, None or a reservation")
    expect(loading == set(pool._loading), f"reserved slots {sorted(loading)} are not the loads' "
           f"{sorted(pool._loading)}")
    expect(all(p.slot == s for s, p in pool._loading.items()), "a load's slot is not the one it reserved")
    expect(not set(pool._pending) & set(resident), f"adapters both loading and resident: "
           f"{sorted(set(pool._pending) & set(resident))}")
    expect(set(pool._recent) == set(resident), f"LRU order {list(pool._recent)} is not the resident "
           f"adapters {sorted(resident)}")
    expect(set(pool._staged) == set(resident), "host copies of resident adapters do not match them")
    expect(pool._pinned <= set(resident), f"pinned adapters not resident: {pool._pinned - set(resident)}")
    expect(not set(pool._host_tier) & set(resident), "an adapter is both resident and in the host tier")
    expect(len(pool._host_tier) <= pool.max_cpu_loras, "host tier over max_cpu_loras")
    users = [0] * pool.max_loras
    for hold in pool._holds:  # a hold queued by a finalizer still counts until the next transaction
        for slot, gen in zip(hold.slots, hold.generations, strict=True):
            users[slot] += pool._slot_generation[slot] == gen
    expect(users == pool._slot_users, f"live-batch counts {pool._slot_users} are not the holds' {users}")
    expect(all(users[s] == 0 for s in range(pool.max_loras) if s not in resident.values()),
           "an empty or reserved slot counts live batches")
    occupied = set(resident.values()) | loading
    starts = [u for s in range(pool.max_loras) for layer in pool._slot_units[s] for u in layer]
    expect(all(not pool._slot_units[s] for s in range(pool.max_loras) if s not in occupied),
           "an empty slot owns arena blocks")
    expect(len(starts) == len(set(starts)) and set(starts) == pool._units.live_starts(),
           "the slots' arena blocks are not the allocator's live blocks")
    for s in range(pool.max_loras):
        if s not in resident.values():
            expect(pool.slot_rank_host[s] == 0 and pool.slot_scaling_host[s] == 0.0,
                   f"empty slot {s} has a rank or scaling")
    if pool.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return  # the device tables cannot be read while a CUDA graph is being captured
    settled = [s for s in range(pool.max_loras) if s not in loading]  # a load writes its slot unlocked
    expect(pool.slot_ranks[settled].tolist() == [pool.slot_rank_host[s] for s in settled],
           f"device slot ranks {pool.slot_ranks.tolist()} are not the host's {pool.slot_rank_host}")
    free = [s for s in range(pool.max_loras) if s not in occupied]
    if free:
        expect(not bool(pool.blocks[:, free].any()) and not bool(pool.layer_ranks[:, free].any()),
               "an empty slot's block table or layer ranks are not zero")
