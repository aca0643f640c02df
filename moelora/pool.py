"""Memory pool of MoE LoRA adapters: one arena per device, adapters stored at their own rank.

Storage (docs/design.md §7): the pool owns one arena of *units*, a unit being one rank row of one (layer,
expert) across the four LoRA matrices::

    gate_up_a (2, U, H)   plane 0 gate A rows, plane 1 up A rows
    gate_up_b (U, 2I)     gate B^T rows (columns [0, I)), up B^T rows (columns [I, 2I))
    down_a    (U, I)
    down_b    (U, H)      down B^T rows

An adapter of rank ``r`` takes ``r`` contiguous units for each (layer, expert) it trains and nothing for
the experts and layers it does not (``moelora.arena``, a buddy allocator, so mixed ranks loaded and
unloaded in any order keep fragmentation bounded). A table ``blocks (layers, L, E)`` int32 on the device
gives each (slot, layer, expert) its first unit; untrained experts and empty slots point at a zero block
(units ``[0, max_rank)``), so every kernel reads an adapter's rows through the table whatever their
place. A slot has one rank per layer (the adapter's largest module rank in that layer: its blocks' rows
there) and one scaling; a module whose own scaling differs (PEFT ``alpha_pattern`` / ``rank_pattern``)
has its B pre-multiplied by ``its scaling / slot scaling``, and a module of lower rank than its layer's
is zero-padded to it.

The arena, the table and the per-slot tables are allocated once, zeroed, at construction; loading and
unloading only write into them in place (kernels and captured CUDA graphs hold these tensors).

Lifecycle: adapters are loaded from PEFT directories (``load_adapter``, ``load_adapter_async``) or given
as tensors (``add_adapter_weights``). When no slot is free or the arena has no room, least recently used
adapters that are neither pinned nor used by a live :class:`MoELoRABatchInfo` are evicted to the host
tier (validated, rank-sized host copies of the last ``max_cpu_loras`` adapters), from which a re-load
or a ``prepare_batch`` naming it is served without reading the disk again. On CUDA every host-to-device
copy goes through one pinned staging buffer the pool allocates at construction (``moelora.staging``):
loads allocate no pinned memory while serving. All public methods are thread-safe.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from moelora.adapter_weights import AdapterLoadError, ReferenceLoRA
from moelora.arena import RankRowAllocator
from moelora.batch_info import StaleBatchError
from moelora.load_worker import LoadWorker
from moelora.parallel import MoEShard
from moelora.peft_loader import ExpertParamLayout, arena_bytes_of, check_adapter_path
from moelora.pool_batches import _Hold, _PoolBatches
from moelora.pool_buffers import DenseLoRA, LoRALayerBuffers, _alloc_blocks, _ArenaWrites
from moelora.pool_invariants import check_pool_invariants
from moelora.pool_report import AdapterMemory, PoolMemoryReport, PoolState
from moelora.stager import AdapterStager, StagedAdapter, _check_positive_int, _dtype_name, _is_int
from moelora.staging import DEFAULT_STAGING_BYTES, PinnedStaging

if TYPE_CHECKING:  # imported where used: importing moelora does not import Triton
    pass

__all__ = ["AdapterLoadError", "DenseLoRA", "LoRALayerBuffers", "MoELoRAMemoryPool", "StaleBatchError"]

_POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOADING = object()  # marks a slot reserved by an asynchronous load that is not visible yet


class _PendingLoad:
    """An asynchronous load from its call to its end: ``slot`` once reserved, ``cancelled`` by an unload."""

    __slots__ = ("cancelled", "name", "slot")

    def __init__(self, name: str) -> None:
        self.name, self.slot, self.cancelled = name, None, False


class _Transaction:
    """``with pool._transaction:`` holds the pool's lock; the outermost one first drops the holds of
    batches released or garbage collected since (their finalizers only queue them, so a collection that
    runs inside a transition never changes the state under it) and, in debug mode, checks the invariants
    on the way out."""

    __slots__ = ("_pool",)

    def __init__(self, pool: MoELoRAMemoryPool) -> None:
        self._pool = pool

    def __enter__(self) -> None:
        pool = self._pool
        pool._lock.acquire()
        pool._depth += 1
        if pool._depth == 1 and pool._released:
            pool._drop_released_holds()

    def __exit__(self, *exc: object) -> None:
        pool = self._pool
        try:
            if pool._depth == 1 and pool.debug_invariants:
                pool.check_invariants()
        finally:
            pool._depth -= 1
            pool._lock.release()


class MoELoRAMemoryPool(_PoolBatches, _ArenaWrites, AdapterStager):
    """GPU (or CPU) memory pool holding up to ``max_loras`` LoRA adapters of one MoE model.

    Args:
        num_experts: ``E``, routed experts per MoE layer.
        hidden_size: ``H``.
        intermediate_size: ``I``, the per-expert FFN width (``w13`` is ``(E, 2I, H)``).
        layer_ids: the model's own indices of its MoE layers, as in PEFT keys (``...layers.{n}...``).
        max_loras: ``L``, adapter slots: how many adapters may be resident at once (hundreds are fine:
            a slot costs a row of the block table, ``layers x E`` int32, not adapter memory).
        max_rank: ``R``, the largest rank an adapter may have.
        dtype: buffer dtype: float32, float16 or bfloat16.
        device: where the buffers live.
        max_cpu_loras: host tier size: validated host copies of this many recently loaded adapters
            are kept so a re-load or a batch naming an evicted adapter skips the disk.
        pin_host_memory: copy adapters into slots through a pinned staging buffer allocated here, once
            (default: on CUDA); False copies from pageable memory (slower, no pinned memory at all).
        staging_bytes: size of that buffer (default 64 MiB, in four chunks: one chunk must hold one
            expert of the largest stack, max_rank x max(H, I) elements).
        load_process: asynchronous loads read, validate and stage adapters in a spawned process
            (``moelora.load_worker``; default: on CUDA), so their host work does not hold this process's
            interpreter lock while it serves; False runs them in a thread of this process.
        arena_bytes: device bytes for adapter weights (default: what ``max_loras`` adapters of
            ``max_rank`` training every expert of every layer take, the dense layout's size). Adapters
            take their own rank's bytes for the experts they train; when one does not fit, least
            recently used evictable adapters make room.
        expert_layout: how the model's fused expert parameters map onto gate, up and down, for PEFT
            ``target_parameters`` adapters (:class:`moelora.peft_loader.ExpertParamLayout`: gpt-oss'
            interleaved gate/up columns, LongCat-Flash's identity experts, Nemotron-H's ungated up_proj);
            ``attach`` sets it from the model.
        shard: a :class:`moelora.parallel.MoEShard` of a tensor- or expert-parallel rank: ``num_experts``
            and ``intermediate_size`` stay the model's, the buffers hold the shard's experts and I share,
            and every adapter (given or read for the whole model) is stored as the shard's part of it.

    Attributes:
        layers: layer id -> :class:`LoRALayerBuffers` (the arena and the layer's block table).
        blocks: ``(layers, L, E)`` int32 on ``device``, first arena unit of each (layer, slot, expert).
            Updated in place.
        slot_ranks: ``(L,)`` int32 on ``device``, real rank per slot (0 = empty): its adapter's largest
            module rank, which sets a batch's rank tile. Updated in place.
        layer_ranks: ``(layers, L)`` int32 on ``device``, each slot's rank in each layer (its adapter's
            largest module rank there, <= ``slot_ranks``): the rows its blocks hold, what the kernels of
            that layer read. Updated in place.
        slot_scalings: ``(L,)`` float32 on ``device``, scaling per slot. Updated in place.
        slot_rank_host, slot_scaling_host: host mirrors of the two tables.
        adapter_slots: adapter name -> slot.
        slot_adapters: slot -> adapter name, ``None`` for a free slot.
    """

    debug_invariants: bool = False  # check_invariants after every transaction (the tests turn it on)

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        layer_ids: Iterable[int],
        max_loras: int = 8,
        max_rank: int = 64,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cuda",
        max_cpu_loras: int = 0,
        pin_host_memory: bool | None = None,
        shard: MoEShard | None = None,
        staging_bytes: int | None = None,
        load_process: bool | None = None,
        arena_bytes: int | None = None,
        expert_layout: ExpertParamLayout | None = None,
    ) -> None:
        self.num_experts = _check_positive_int("num_experts", num_experts)
        if expert_layout is not None and not isinstance(expert_layout, ExpertParamLayout):
            raise TypeError(f"expert_layout must be a moelora.peft_loader.ExpertParamLayout, got "
                            f"{type(expert_layout).__name__}")
        self.expert_layout = expert_layout if expert_layout is not None else ExpertParamLayout()
        self.hidden_size = _check_positive_int("hidden_size", hidden_size)
        self.intermediate_size = _check_positive_int("intermediate_size", intermediate_size)
        if shard is not None:
            if not isinstance(shard, MoEShard):
                raise TypeError(f"shard must be a moelora.parallel.MoEShard, got {type(shard).__name__}")
            if (shard.num_experts, shard.intermediate_size) != (self.num_experts, self.intermediate_size):
                raise ValueError(
                    f"the shard splits E={shard.num_experts}, I={shard.intermediate_size} but the pool is "
                    f"for E={self.num_experts}, I={self.intermediate_size} (give the pool the model's sizes)")
            # From here on the pool's sizes are the shard's: what its buffers hold and its layers take.
            self.num_experts = shard.local_num_experts
            self.intermediate_size = shard.local_intermediate_size
        self.shard = shard
        # Global expert id -> local index (-1: another rank's), for expert-parallel layers.
        self.expert_map = None
        self.max_loras = _check_positive_int("max_loras", max_loras)
        self.max_rank = _check_positive_int("max_rank", max_rank)
        if dtype not in _POOL_DTYPES:
            raise ValueError(f"dtype must be one of {[_dtype_name(d) for d in _POOL_DTYPES]}, got {dtype!r}")
        self.dtype = dtype
        self.device = torch.device(device)

        if isinstance(layer_ids, (str, bytes)) or not isinstance(layer_ids, Iterable):
            raise ValueError(f"layer_ids must be a sequence of ints, got {layer_ids!r}")
        ids = tuple(layer_ids)
        if not ids:
            raise ValueError("layer_ids must name at least one MoE layer")
        bad = [i for i in ids if not _is_int(i) or i < 0]
        if bad:
            raise ValueError(f"layer_ids must be non-negative ints, got {bad!r} in {list(ids)!r}")
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"layer_ids must be unique, {dup} appear more than once in {list(ids)!r}")
        self.layer_ids: tuple[int, ...] = tuple(int(i) for i in ids)

        n_slots, e, r = self.max_loras, self.num_experts, self.max_rank
        h, i = hidden_size, self.intermediate_size
        if shard is not None and shard.local_num_experts < shard.num_experts:
            self.expert_map = shard.expert_map(self.device)
        kw = {"dtype": dtype, "device": self.device}
        self.unit_bytes = self.unit_bytes_for(h, i, dtype)
        # Blocks are aligned to a power of two of units (moelora.arena): the default arena holds max_loras
        # adapters of max_rank training everything, whatever max_rank is.
        aligned_r = 1 << (r - 1).bit_length()
        if arena_bytes is None:
            arena_bytes = n_slots * len(self.layer_ids) * e * aligned_r * self.unit_bytes
        elif not _is_int(arena_bytes) or arena_bytes < aligned_r * self.unit_bytes:
            raise ValueError(f"arena_bytes must be an int of at least {aligned_r * self.unit_bytes} (one "
                             f"rank-{r} block of {self.unit_bytes}-byte rows), got {arena_bytes!r}")
        # Units [0, aligned_r) are the zero block (aligned, so the free space splits into whole blocks); a
        # rank tile loaded past the last unit (kernels may load a tile's rows and mask them later) stays in
        # bounds through the tail.
        units = aligned_r + arena_bytes // self.unit_bytes
        tail = max(16, aligned_r)
        if units + tail >= 1 << 31:
            raise ValueError(f"arena_bytes {arena_bytes} gives {units} units: the block table is int32, at "
                             f"most {(1 << 31) - 1 - tail} units of {self.unit_bytes} bytes")
        self._units = RankRowAllocator(units, reserved_units=aligned_r)
        self.blocks = torch.zeros(len(self.layer_ids), n_slots, e, dtype=torch.int32, device=self.device)
        self._arena = {"gate_up_a": torch.zeros(2, units + tail, h, **kw),
                       "gate_up_b": torch.zeros(units + tail, 2 * i, **kw),
                       "down_a": torch.zeros(units + tail, i, **kw),
                       "down_b": torch.zeros(units + tail, h, **kw)}
        # Each slot's blocks, a list of starts per layer (empty: no adapter): what its write and free use.
        self._slot_units: list[list[list[int]]] = [[] for _ in range(n_slots)]
        self.slot_ranks = torch.zeros(n_slots, dtype=torch.int32, device=self.device)
        self.layer_ranks = torch.zeros(len(self.layer_ids), n_slots, dtype=torch.int32, device=self.device)
        self.layers: dict[int, LoRALayerBuffers] = {
            lid: self._layer_buffers(self.blocks[li], self.layer_ranks[li])
            for li, lid in enumerate(self.layer_ids)}
        self.slot_scalings = torch.zeros(n_slots, dtype=torch.float32, device=self.device)
        self.slot_rank_host: list[int] = [0] * n_slots
        self.slot_scaling_host: list[float] = [0.0] * n_slots
        self.adapter_slots: dict[str, int] = {}
        self.slot_adapters: list[str | None] = [None] * n_slots

        if not _is_int(max_cpu_loras) or max_cpu_loras < 0:
            raise ValueError(f"max_cpu_loras must be a non-negative int, got {max_cpu_loras!r}")
        self.max_cpu_loras = int(max_cpu_loras)
        on_cuda = self.device.type == "cuda"
        self.pin_host_memory = on_cuda if pin_host_memory is None else bool(pin_host_memory)
        self._staging: PinnedStaging | None = None
        if staging_bytes is not None and (not _is_int(staging_bytes) or staging_bytes <= 0):
            raise ValueError(f"staging_bytes must be a positive int, got {staging_bytes!r}")
        if on_cuda and self.pin_host_memory:
            widest = self.max_rank * max(h, i) * torch.empty((), dtype=dtype).element_size()
            self._staging = PinnedStaging(staging_bytes or DEFAULT_STAGING_BYTES, widest_row=widest,
                                          what=f"a rank-{self.max_rank} LoRA stack")
        # The pool's state (docs/architecture.md, "Pool state"): changed only under ``_lock``, inside a
        # ``_Transaction``, by the functions of the "State" section below.
        self._lock = threading.RLock()
        self._depth = 0  # transactions open in the thread holding the lock
        self._transaction = _Transaction(self)
        self._recent: OrderedDict[str, None] = OrderedDict()  # resident adapters, least recent first
        self._pinned: set[str] = set()
        self._slot_users = [0] * n_slots  # holds of live batches on each slot's current content
        # Bumped whenever a slot is emptied or gets new content: a batch records the generations of its
        # slots, and a layer refuses it once they differ (its adapter was unloaded or replaced).
        self._slot_generation = [0] * n_slots
        self._holds: set[_Hold] = set()  # live batches' holds
        self._released: deque[_Hold] = deque()  # holds of released or collected batches, not yet dropped
        self._pending: dict[str, _PendingLoad] = {}  # asynchronous loads by name, until published or ended
        self._loading: dict[int, _PendingLoad] = {}  # slots reserved by asynchronous loads
        self._host_tier: OrderedDict[str, StagedAdapter] = OrderedDict()
        self._staged: dict[str, StagedAdapter] = {}  # resident adapters' host copies (reports, re-loads)
        self._evictions = 0  # adapters LRU eviction took out of a slot (explicit unloads not counted)
        self._executor: ThreadPoolExecutor | None = None
        self._load_worker = LoadWorker() if (on_cuda if load_process is None else load_process) else None

    @staticmethod
    def unit_bytes_for(hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> int:
        """Bytes of one arena unit (one rank row of one (layer, expert) across the four matrices): what
        ``arena_bytes`` is counted in. A rank-r adapter training n (layer, expert) pairs takes
        ``n * r`` units."""
        return arena_bytes_of(1, 1, hidden_size, intermediate_size, dtype)

    # ----------------------------------------------------------------------------------------------
    # Queries (each answers from one consistent state: taken under the lock)
    # ----------------------------------------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        """True for an adapter in a GPU slot or in the host tier (a batch may name either)."""
        with self._transaction:
            return name in self.adapter_slots or name in self._host_tier

    def is_resident(self, name: str) -> bool:
        """True when ``name`` is in a slot (no copy needed before a batch can use it)."""
        with self._transaction:
            return name in self.adapter_slots

    def host_adapters(self) -> list[str]:
        """Adapters held in the host tier, least recently used first."""
        with self._transaction:
            return list(self._host_tier)

    def state(self) -> PoolState:
        """One consistent picture of which adapters are where: resident ones in LRU order, the host tier,
        loads under way, pins and live-batch holds (:class:`PoolState`)."""
        with self._transaction:
            return PoolState(
                resident=tuple(self._recent), host=tuple(self._host_tier), loading=tuple(self._pending),
                pinned=frozenset(self._pinned), slots=dict(self.adapter_slots),
                users={n: self._slot_users[s] for n, s in self.adapter_slots.items()},
                evictions=self._evictions)

    def report(self, name: str) -> object | None:
        """The load report of a resident or host-tier adapter (``None`` for ``add_adapter_weights``)."""
        with self._transaction:
            staged = self._staged.get(name) or self._host_tier.get(name)
            if staged is None:
                raise ValueError(f"adapter {name!r} is not held; {self._known()}")
            return staged.report

    def memory_report(self) -> PoolMemoryReport:
        """Bytes per adapter, arena use and fragmentation, slot use, the host tier and the pinned staging
        buffer, with each adapter's tier, pin and live-batch count (:class:`PoolMemoryReport`)."""
        with self._transaction:
            adapters = []
            for slot, name in enumerate(self.slot_adapters):
                if not isinstance(name, str):
                    continue
                staged = self._staged[name]
                adapters.append(AdapterMemory(
                    name=name, tier="gpu", slot=slot, pinned=name in self._pinned,
                    users=self._slot_users[slot], rank=staged.rank,
                    blocks=sum(map(len, self._slot_units[slot])), bytes=self._arena_bytes(staged),
                    host_bytes=staged.nbytes))
            for name, staged in self._host_tier.items():
                blocks = sum(count for _, count in self._layer_blocks(staged))
                adapters.append(AdapterMemory(name=name, tier="host", slot=None, pinned=False, users=0,
                                              rank=staged.rank, blocks=blocks, bytes=0,
                                              host_bytes=staged.nbytes))
            stats = self._units.stats()
            big_order = (self.max_rank - 1).bit_length()
            per_order = enumerate(stats["free_blocks_per_order"])
            max_rank_free = sum(n << k for k, n in per_order if k >= big_order)
            return PoolMemoryReport(
                device=str(self.device), slots=self.max_loras, free_slots=len(self.free_slots),
                arena_bytes=self.nbytes, table_bytes=self.blocks.nbytes,
                used_bytes=stats["used_units"] * self.unit_bytes,
                free_bytes=stats["free_units"] * self.unit_bytes,
                largest_free_bytes=stats["largest_free_block"] * self.unit_bytes,
                max_rank_free_bytes=max_rank_free * self.unit_bytes,
                host_tier_bytes=sum(s.nbytes for s in self._host_tier.values()),
                staging_bytes=self._staging.nbytes if self._staging is not None else 0, adapters=adapters)

    def pin(self, name: str) -> None:
        """Never evict ``name`` (until ``unpin``); it must be resident."""
        with self._transaction:
            if not isinstance(name, str) or name not in self.adapter_slots:
                self._refuse_not_loaded(name)
            self._pinned.add(name)

    def unpin(self, name: str) -> None:
        with self._transaction:
            self._pinned.discard(name)

    def is_pinned(self, name: str) -> bool:
        """Whether ``name`` is pinned (``pin``)."""
        with self._transaction:
            return name in self._pinned

    def users_of(self, name: str) -> int:
        """Live batches (neither released nor garbage collected) holding adapter ``name``'s slot."""
        with self._transaction:
            return self._slot_users[self.slot_of(name)]

    @property
    def lock(self) -> threading.RLock:
        """The pool's lock. A layer holds it from :meth:`check_batch` until its kernels are queued, so no
        slot write can be queued between the check and the forward that relies on it."""
        return self._lock

    def __repr__(self) -> str:
        return (
            f"MoELoRAMemoryPool(E={self.num_experts}, H={self.hidden_size}, I={self.intermediate_size}, "
            f"layers={list(self.layer_ids)}, slots={len(self.adapter_slots)}/{self.max_loras}, "
            f"max_rank={self.max_rank}, dtype={_dtype_name(self.dtype)}, device={self.device})"
        )

    def adapters(self) -> list[str]:
        """Names of the adapters in GPU slots, in slot order."""
        with self._transaction:
            return [n for n in self.slot_adapters if isinstance(n, str)]

    def slot_of(self, name: str) -> int:
        """The slot holding adapter ``name``; ValueError naming the loaded adapters if none does."""
        with self._transaction:
            if isinstance(name, str) and name in self.adapter_slots:
                return self.adapter_slots[name]
            return self._refuse_not_loaded(name)

    def _refuse_not_loaded(self, name: object) -> int:
        where = " (it is in the host tier)" if name in self._host_tier else ""
        raise ValueError(f"adapter {name!r} is not loaded{where}; {self._known()}")

    def _known(self) -> str:
        """What the pool holds, for a refusal's message. Caller holds the lock."""
        text = f"loaded adapters: {[n for n in self.slot_adapters if isinstance(n, str)]}"
        if self._host_tier:
            text += f", host tier: {list(self._host_tier)}"
        if self._pending:
            text += f", loading: {list(self._pending)}"
        return text

    @property
    def free_slots(self) -> list[int]:
        """Slots not holding an adapter, lowest first."""
        return [s for s, n in enumerate(self.slot_adapters) if n is None]

    def layer(self, layer_id: int) -> LoRALayerBuffers:
        """Buffers of the MoE layer with the model's index ``layer_id``."""
        try:
            return self.layers[layer_id]
        except (KeyError, TypeError):
            raise ValueError(
                f"layer {layer_id!r} is not a MoE layer of this pool; valid layer ids: {list(self.layer_ids)}"
            ) from None

    @property
    def nbytes(self) -> int:
        """Device bytes of the adapter arena (the block table and slot tables excluded)."""
        return sum(t.nbytes for t in self._arena.values())

    # ----------------------------------------------------------------------------------------------
    # Loading / unloading
    # ----------------------------------------------------------------------------------------------

    def add_adapter_weights(self, name: str, layers: Mapping[int, ReferenceLoRA]) -> int:
        """Puts one adapter, given as tensors, into a slot and returns that slot.

        ``layers`` maps the model's layer id to that layer's :class:`ReferenceLoRA` (per-expert
        gate/up/down :class:`LoRAProjection`; a missing layer, expert or projection means no delta
        there). Shapes: gate/up ``a (r, H)``, ``b (I, r)``; down ``a (r, I)``, ``b (H, r)``; ranks may
        differ between modules (the slot rank is the largest), ``r <= max_rank``. A rank-0 module
        contributes nothing and is skipped.

        The slot scaling is the scaling of the first module of rank > 0 with a non-zero scaling, in
        (layer id, expert, gate/up/down) order; every other module's B is multiplied by
        ``its scaling / slot scaling`` in float32 before the cast to the pool dtype.

        Everything is checked on the host before any buffer is touched; on any problem an
        :class:`AdapterLoadError` naming the layer/expert/projection and the reason is raised and the
        pool is left byte-for-byte unchanged. The adapter takes the lowest free slot and, for each (layer,
        expert) it trains, an arena block of that layer's rank (its largest module rank there), every row of
        which is written; the slot's other experts and layers read the zero block. Where no slot is free or
        the arena has no room, least recently used adapters that are neither pinned nor used by a live
        batch are evicted (to the host tier) until both exist; where even that would not make room,
        AdapterLoadError and nothing is evicted.
        """
        if not isinstance(name, str) or not name:
            raise AdapterLoadError(f"adapter name must be a non-empty str, got {name!r}")
        if self.shard is not None:
            layers = self.shard.split_adapter(name, layers)
        staged = self._stage(name, layers)
        with self._transaction:
            return self._place(staged)

    def load_adapter(self, name: str, path: str | Path) -> object:
        """Loads the PEFT adapter directory ``path`` (adapter_config.json + adapter_model.safetensors)
        as ``name`` and returns its load report (format, ranks, scalings, layers/experts, ignored keys,
        pool bytes). The files are read and validated on the host before any slot is touched: on
        :class:`AdapterLoadError` the pool is unchanged. An adapter of the same name and path in the
        host tier is served from there, without reading the disk."""
        with self._transaction:
            refusal = self._refuse_load(name)  # before reading: a name already taken is refused at once
        if refusal is not None:
            raise refusal
        staged = self._stage_from(name, path)
        with self._transaction:
            self._place(staged)
        return staged.report

    def load_adapter_async(self, name: str, path: str | Path) -> Future:
        """Like ``load_adapter``, in the background: reads and validates on the host (in the load process on
        CUDA), copies into a reserved slot on a side CUDA stream while forwards keep running, and makes
        ``name`` visible to ``prepare_batch`` only once its copy has completed. Returns a Future of the load
        report; its exception is the AdapterLoadError, with the pool unchanged. From this call until the
        load ends, ``name`` is loading (:meth:`state`): another load of it is refused, and
        ``unload_adapter(name)`` cancels it (the future then raises AdapterLoadError)."""
        with self._transaction:
            refusal = self._refuse_load(name)
            if refusal is not None:
                done: Future = Future()
                done.set_exception(refusal)
                return done
            pending = self._pending[name] = _PendingLoad(name)
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moelora-load")
            try:
                return self._executor.submit(self._load_async_job, pending, path)
            except BaseException:
                del self._pending[name]
                raise

    def start_load_process(self) -> None:
        """Starts the load process of asynchronous loads now (it otherwise starts at the first
        ``load_adapter_async``, which then waits a few seconds for it to import torch). ValueError for a
        pool built with ``load_process=False`` (or on the CPU, without ``load_process=True``)."""
        if self._load_worker is None:
            raise ValueError("this pool loads asynchronously in a thread: build it with load_process=True "
                             "(the default on CUDA) to have a load process")
        self._load_worker.start()

    def unload_adapter(self, name: str) -> None:
        """Frees adapter ``name``'s slot (its rank and scaling become 0); a host-tier copy stays when
        the host tier is enabled; an adapter only in the host tier is dropped from it; an asynchronous load
        of ``name`` under way is cancelled (its future raises AdapterLoadError, nothing of it is published).

        Refused only for a pinned adapter. Batches built before the unload that use ``name`` become stale:
        layers refuse them until :meth:`refresh` (or ``prepare_batch(..., out=batch)``) rebuilds them.
        Forwards already queued on the device still run with the adapter: the slot writes that follow are
        queued after them."""
        with self._transaction:
            pending = self._pending.pop(name, None) if isinstance(name, str) else None
            if pending is not None:
                pending.cancelled = True
                return
            if name not in self.adapter_slots:
                if isinstance(name, str) and name in self._host_tier:
                    del self._host_tier[name]
                    return
                self._refuse_not_loaded(name)
            if name in self._pinned:
                raise ValueError(f"adapter {name!r} is pinned; unpin it before unloading")
            self._evict_slot(self.adapter_slots[name])

    def close(self) -> None:
        """Stops the background loader thread and the load process (pending loads finish first)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        if self._load_worker is not None:
            self._load_worker.close()

    def _stage_from(self, name: str, path: str | Path, *, in_worker: bool = False) -> StagedAdapter:
        """Host-tier copy of the same adapter if there is one, else read + validate the files (in the load
        process with ``in_worker``)."""
        if not isinstance(name, str) or not name:
            raise AdapterLoadError(f"adapter name must be a non-empty str, got {name!r}")
        # Before resolving: Path("") is the current directory (and would match a host-tier copy read from it).
        path = check_adapter_path(path)
        source = str(path.resolve())
        with self._transaction:
            cached = self._host_tier.get(name)
            if cached is not None and cached.source == source:
                self._host_tier.move_to_end(name)
                return cached

        if in_worker:
            return self._load_worker.stage(AdapterStager.sizes_of(self), name, path)
        return self._read_and_stage(name, path)

    def _load_async_job(self, pending: _PendingLoad, path: str | Path) -> object:
        """The background half of :meth:`load_adapter_async`: stage, reserve, copy outside the lock,
        publish (or give the slot back when the load was cancelled or failed)."""
        name = pending.name
        try:
            staged = self._stage_from(name, path, in_worker=self._load_worker is not None)
            with self._transaction:
                self._check_not_cancelled(pending)
                slot = self._reserve(staged, pending=pending)
        except BaseException:
            with self._transaction:
                self._end_pending(pending)
            raise
        try:
            if self.device.type == "cuda":
                stream = torch.cuda.Stream(device=self.device)
                # Kernels already queued may still read this slot (a batch released before its work
                # ran): the copy waits for them; forwards queued later never see the slot until publish.
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self._write_slot(slot, staged, stream=stream)
                done = torch.cuda.Event()
                done.record(stream)
                done.synchronize()  # in this background thread only: publish after the copy
            else:
                self._write_slot(slot, staged)
            with self._transaction:
                self._check_not_cancelled(pending)
                self._publish(slot, staged)
                self._end_pending(pending)
        except BaseException:
            with self._transaction:
                self._abort(slot)
                self._end_pending(pending)
            raise
        return staged.report

    @staticmethod
    def _check_not_cancelled(pending: _PendingLoad) -> None:
        if pending.cancelled:
            raise AdapterLoadError(f"the load of adapter {pending.name!r} was cancelled: "
                                   f"unload_adapter({pending.name!r}) was called while it loaded")

    # ----------------------------------------------------------------------------------------------
    # State: the only functions that change which adapter is where. Caller holds the lock (inside a
    # transaction); each leaves the invariants of docs/architecture.md ("Pool state") true.
    # ----------------------------------------------------------------------------------------------

    def _refuse_load(self, name: object, pending: _PendingLoad | None = None) -> AdapterLoadError | None:
        """Why ``name`` cannot be loaded now (by ``pending``, or a new load), or None."""
        if not isinstance(name, str) or not name:
            return AdapterLoadError(f"adapter name must be a non-empty str, got {name!r}")
        if name in self.adapter_slots:
            return AdapterLoadError(
                f"adapter {name!r} is already loaded (slot {self.adapter_slots[name]}); unload it first")
        if self._pending.get(name, pending) is not pending:
            return AdapterLoadError(f"adapter {name!r} is already being loaded (load_adapter_async); wait "
                                    "for that load, or unload_adapter it to cancel the load")
        return None

    def _place(self, staged: StagedAdapter, *, protected: frozenset[int] | set[int] = frozenset()) -> int:
        """Reserves a slot for ``staged``, writes it and publishes it (a synchronous load)."""
        slot = self._reserve(staged, protected=protected)
        try:
            self._write_slot(slot, staged)
        except BaseException:
            self._abort(slot)  # a device-side failure mid-write (e.g. out of memory): the slot is free again
            raise
        self._publish(slot, staged)
        return slot

    def _reserve(self, staged: StagedAdapter, *, pending: _PendingLoad | None = None,
                 protected: frozenset[int] | set[int] = frozenset()) -> int:
        """A slot and its arena blocks for ``staged`` (free, else by LRU eviction: :meth:`_take_slot`),
        reserved: neither free nor visible nor evictable until :meth:`_publish` or :meth:`_abort`."""
        refusal = self._refuse_load(staged.name, pending)
        if refusal is not None:
            raise refusal
        slot = self._take_slot(staged, protected)
        self.slot_adapters[slot] = _LOADING
        if pending is not None:
            pending.slot = slot
            self._loading[slot] = pending
        return slot

    def _publish(self, slot: int, staged: StagedAdapter) -> None:
        """Makes a reserved, written slot the resident copy of ``staged`` (most recently used)."""
        self._loading.pop(slot, None)
        self._slot_generation[slot] += 1
        self._slot_users[slot] = 0
        self.adapter_slots[staged.name] = slot
        self.slot_adapters[slot] = staged.name
        live = any(self._slot_units[slot])  # as _write_slot set the device tables
        self.slot_rank_host[slot] = staged.rank if live else 0
        self.slot_scaling_host[slot] = staged.scaling if live else 0.0
        self._recent[staged.name] = None
        self._recent.move_to_end(staged.name)
        self._staged[staged.name] = staged
        self._host_tier.pop(staged.name, None)

    def _abort(self, slot: int) -> None:
        """Gives a reserved slot back, its blocks freed and its tables zero."""
        self._loading.pop(slot, None)
        self.slot_adapters[slot] = None
        self._clear_slot(slot)

    def _end_pending(self, pending: _PendingLoad) -> None:
        if self._pending.get(pending.name) is pending:
            del self._pending[pending.name]

    def _evict_slot(self, slot: int) -> None:
        """Empties a resident slot; its adapter goes to the host tier (if enabled, most recently used there,
        the least recently used host copy dropped past ``max_cpu_loras``)."""
        self._slot_generation[slot] += 1
        self._slot_users[slot] = 0  # batches still holding the old adapter are stale now, not users
        name = self.slot_adapters[slot]
        del self.adapter_slots[name]
        del self._recent[name]
        self._pinned.discard(name)
        staged = self._staged.pop(name)
        if self.max_cpu_loras:
            self._host_tier[name] = staged
            self._host_tier.move_to_end(name)
            while len(self._host_tier) > self.max_cpu_loras:
                self._host_tier.popitem(last=False)
        self.slot_adapters[slot] = None
        self._clear_slot(slot)

    def _touch(self, names: Iterable[str]) -> None:
        """Marks resident ``names`` most recently used, in that order."""
        recent = self._recent
        for name in names:
            recent.move_to_end(name)

    def _take_slot(self, staged: StagedAdapter, protected: frozenset[int] | set[int] = frozenset()) -> int:
        """A free slot and arena blocks for ``staged`` (for each (layer, expert) it trains, a block of that
        layer's rank), evicting least recently used adapters that are neither pinned, nor used by a live
        batch, nor in a slot of ``protected``, as long as either is missing. All or nothing: where evicting
        every such adapter would still not make room, AdapterLoadError and nothing is evicted. The blocks
        are recorded as the slot's."""
        needs = self._block_needs(staged)
        if self.free_slots:
            got = _alloc_blocks(self._units, needs)
            if got is not None:
                return self._assign(self.free_slots[0], staged, got)
        trial = copy.deepcopy(self._units) if needs else None  # the allocator after the evictions so far
        victims: list[int] = []
        for victim in self._recent:
            slot = self.adapter_slots[victim]
            if victim in self._pinned or self._slot_users[slot] or slot in protected:
                continue
            victims.append(slot)
            if trial is not None:
                trial.free(u for starts in self._slot_units[slot] for u in starts)
            if trial is None or _alloc_blocks(trial, needs) is not None:
                break
        else:
            raise AdapterLoadError(self._no_room(staged.name, needs, protected))
        for slot in victims:
            self._evict_slot(slot)
        self._evictions += len(victims)
        got = _alloc_blocks(self._units, needs)  # the trial's state: it fits
        return self._assign(self.free_slots[0], staged, got)

    def _block_needs(self, staged: StagedAdapter) -> dict[int, int]:
        """Blocks ``staged`` takes: rank -> count over its layers."""
        needs: dict[int, int] = {}
        for rank, count in self._layer_blocks(staged):
            if count:
                needs[rank] = needs.get(rank, 0) + count
        return needs

    def _assign(self, slot: int, staged: StagedAdapter, got: dict[int, list[int]]) -> int:
        """Records ``got``'s blocks as ``slot``'s, layer by layer in the order ``_block_needs`` counted."""
        taken = dict.fromkeys(got, 0)
        per_layer = []
        for rank, count in self._layer_blocks(staged):
            per_layer.append(got[rank][taken[rank] : taken[rank] + count] if count else [])
            if count:
                taken[rank] += count
        self._slot_units[slot] = per_layer
        return slot

    def _no_room(self, name: str, needs: dict[int, int], protected: frozenset[int] | set[int]) -> str:
        in_use = [n for n, s in self.adapter_slots.items() if self._slot_users[s] or s in protected]
        held = f"pinned {sorted(self._pinned)}, used by live batches {sorted(in_use)}"
        if self._loading:
            held += f", being loaded {sorted(p.name for p in self._loading.values())}"
        if self.free_slots:
            stats = self._units.stats()
            blocks = ", ".join(f"{count} of rank {rank}" for rank, count in sorted(needs.items()))
            need_bytes = sum(rank * count for rank, count in needs.items()) * self.unit_bytes
            return (
                f"cannot load adapter {name!r}: it needs arena blocks ({blocks}; {need_bytes} bytes) and the "
                f"arena has {stats['free_units'] * self.unit_bytes} bytes free, largest free block "
                f"{stats['largest_free_block']} units; the adapters that may not be evicted ({held}) leave "
                "too little: unload or unpin adapters, release batches, or give the pool a larger arena_bytes"
            )
        return (
            f"cannot load adapter {name!r}: all {self.max_loras} slots hold adapters that are pinned or "
            f"used by live batches ({held}); release a batch, unpin or unload one first"
        )

    def check_invariants(self) -> None:
        """Asserts the invariants of the pool's state (docs/architecture.md, "Pool state"); AssertionError
        naming the first one broken. Reads the device tables (a sync): for tests and debugging. Run after
        every transaction when ``MoELoRAMemoryPool.debug_invariants`` is true (the test suite sets it)."""
        with self._lock:
            self._check_invariants()

    def _check_invariants(self) -> None:
        check_pool_invariants(self, _LOADING)

    # ----------------------------------------------------------------------------------------------
    # Batches
    # ----------------------------------------------------------------------------------------------


