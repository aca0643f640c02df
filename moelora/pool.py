"""Fixed-size memory pool of MoE LoRA adapters, one set of slot buffers per MoE layer (DESIGN.md §2).

Layout, per MoE layer (``L = max_loras`` slots, ``E`` experts, ``R = max_rank``)::

    gate_up_a (L, E, 2R, H)   rows [0, R) gate A, rows [R, 2R) up A
    gate_up_b (L, E, 2I, R)   rows [0, I) gate B, rows [I, 2I) up B
    down_a    (L, E, R, I)
    down_b    (L, E, H, R)

An adapter of rank ``r < R`` occupies rows/columns ``[0, r)`` of its rank axis (``[R, R + r)`` for the
up A); the rest of its slot is exactly zero, so using all ``R`` rank columns gives the same numbers as
using ``r`` of them. Every slot has one rank (the adapter's largest module rank) and one scaling; a
module whose own scaling differs (PEFT ``alpha_pattern`` / ``rank_pattern``) has its B pre-multiplied
by ``its scaling / slot scaling`` so that one scaling per slot still gives PEFT's numbers.

All buffers and the per-slot tables are allocated once, zeroed, at construction; loading and unloading
only write into them in place (kernels and captured CUDA graphs hold these tensors).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from moelora.batch_info import MoELoRABatchInfo
from moelora.reference import LoRAProjection, ReferenceLoRA

__all__ = ["AdapterLoadError", "LoRALayerBuffers", "MoELoRAMemoryPool"]

_POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PROJECTIONS = ("gate", "up", "down")


class AdapterLoadError(ValueError):
    """An adapter that cannot be served exactly. The pool is left unchanged when this is raised."""


@dataclass
class LoRALayerBuffers:
    """One MoE layer's adapter buffers, all slots (DESIGN.md §2).

    Attributes:
        gate_up_a: ``(L, E, 2R, H)``; rows ``[0, R)`` gate A, ``[R, 2R)`` up A.
        gate_up_b: ``(L, E, 2I, R)``; rows ``[0, I)`` gate B, ``[I, 2I)`` up B.
        down_a: ``(L, E, R, I)``.
        down_b: ``(L, E, H, R)``.
    """

    gate_up_a: torch.Tensor
    gate_up_b: torch.Tensor
    down_a: torch.Tensor
    down_b: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The four buffers, in the order gate_up_a, gate_up_b, down_a, down_b."""
        return (self.gate_up_a, self.gate_up_b, self.down_a, self.down_b)

    @property
    def nbytes(self) -> int:
        """Bytes held by the four buffers."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


@dataclass
class _Module:
    """One validated, host-staged LoRA module of an adapter (already in the pool dtype)."""

    layer_id: int
    expert: int
    proj: str
    a: torch.Tensor  # (r, in), CPU, pool dtype
    b: torch.Tensor  # (out, r), CPU, pool dtype, already rescaled to the slot scaling
    rank: int


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_positive_int(name: str, v: object) -> int:
    if not _is_int(v) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class MoELoRAMemoryPool:
    """GPU (or CPU) memory pool holding up to ``max_loras`` LoRA adapters of one MoE model.

    Args:
        num_experts: ``E``, routed experts per MoE layer.
        hidden_size: ``H``.
        intermediate_size: ``I``, the per-expert FFN width (``w13`` is ``(E, 2I, H)``).
        layer_ids: the model's own indices of its MoE layers, as in PEFT keys (``...layers.{n}...``).
        max_loras: ``L``, adapter slots.
        max_rank: ``R``, the largest rank a slot can hold.
        dtype: buffer dtype: float32, float16 or bfloat16.
        device: where the buffers live.

    Attributes:
        layers: layer id -> :class:`LoRALayerBuffers`.
        slot_ranks: ``(L,)`` int32 on ``device``, real rank per slot (0 = empty). Updated in place.
        slot_scalings: ``(L,)`` float32 on ``device``, scaling per slot. Updated in place.
        slot_rank_host, slot_scaling_host: host mirrors of the two tables.
        adapter_slots: adapter name -> slot.
        slot_adapters: slot -> adapter name, ``None`` for a free slot.
    """

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
    ) -> None:
        self.num_experts = _check_positive_int("num_experts", num_experts)
        self.hidden_size = _check_positive_int("hidden_size", hidden_size)
        self.intermediate_size = _check_positive_int("intermediate_size", intermediate_size)
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

        n_slots, e, r, h, i = self.max_loras, self.num_experts, self.max_rank, hidden_size, intermediate_size
        kw = {"dtype": dtype, "device": self.device}
        self.layers: dict[int, LoRALayerBuffers] = {
            lid: LoRALayerBuffers(
                gate_up_a=torch.zeros(n_slots, e, 2 * r, h, **kw),
                gate_up_b=torch.zeros(n_slots, e, 2 * i, r, **kw),
                down_a=torch.zeros(n_slots, e, r, i, **kw),
                down_b=torch.zeros(n_slots, e, h, r, **kw),
            )
            for lid in self.layer_ids
        }
        self.slot_ranks = torch.zeros(n_slots, dtype=torch.int32, device=self.device)
        self.slot_scalings = torch.zeros(n_slots, dtype=torch.float32, device=self.device)
        self.slot_rank_host: list[int] = [0] * n_slots
        self.slot_scaling_host: list[float] = [0.0] * n_slots
        self.adapter_slots: dict[str, int] = {}
        self.slot_adapters: list[str | None] = [None] * n_slots

    # ----------------------------------------------------------------------------------------------
    # Queries
    # ----------------------------------------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        return name in self.adapter_slots

    def __repr__(self) -> str:
        return (
            f"MoELoRAMemoryPool(E={self.num_experts}, H={self.hidden_size}, I={self.intermediate_size}, "
            f"layers={list(self.layer_ids)}, slots={len(self.adapter_slots)}/{self.max_loras}, "
            f"max_rank={self.max_rank}, dtype={_dtype_name(self.dtype)}, device={self.device})"
        )

    def adapters(self) -> list[str]:
        """Names of the loaded adapters, in slot order."""
        return [n for n in self.slot_adapters if n is not None]

    def slot_of(self, name: str) -> int:
        """The slot holding adapter ``name``; ValueError naming the loaded adapters if none does."""
        try:
            return self.adapter_slots[name]
        except (KeyError, TypeError):
            raise ValueError(f"adapter {name!r} is not loaded; loaded adapters: {self.adapters()}") from None

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
        """Bytes held by the adapter weight buffers of all layers (the small slot tables excluded)."""
        return sum(b.nbytes for b in self.layers.values())

    # ----------------------------------------------------------------------------------------------
    # Loading / unloading
    # ----------------------------------------------------------------------------------------------

    def add_adapter_weights(self, name: str, layers: Mapping[int, ReferenceLoRA]) -> int:
        """Puts one adapter, given as tensors, into the lowest free slot and returns that slot.

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
        pool is left byte-for-byte unchanged. Every byte of the chosen slot is then rewritten, in all
        four buffers of every layer, so nothing of a previous occupant survives.
        """
        if not isinstance(name, str) or not name:
            raise AdapterLoadError(f"adapter name must be a non-empty str, got {name!r}")
        if name in self.adapter_slots:
            raise AdapterLoadError(
                f"adapter {name!r} is already loaded (slot {self.adapter_slots[name]}); unload it first"
            )
        free = self.free_slots
        if not free:
            raise AdapterLoadError(
                f"cannot load adapter {name!r}: the pool is full, all {self.max_loras} slots hold adapters "
                f"({self.adapters()}); unload one first"
            )
        modules, rank, scaling = self._stage(name, layers)
        slot = free[0]

        try:
            self._write_slot(slot, modules)
            self._set_slot_tables(slot, rank, scaling)
        except BaseException:
            # A device-side failure mid-write (e.g. out of memory): leave the slot empty and clean.
            for buf in self.layers.values():
                for t in buf.tensors():
                    t[slot].zero_()
            self._set_slot_tables(slot, 0, 0.0)
            raise
        self.adapter_slots[name] = slot
        self.slot_adapters[slot] = name
        return slot

    def unload_adapter(self, name: str) -> None:
        """Frees adapter ``name``'s slot (its rank and scaling become 0).

        The weights are not erased here (loading into a slot rewrites all of it). A batch prepared
        before the unload still refers to the slot: prepare a new one.
        """
        slot = self.slot_of(name)
        del self.adapter_slots[name]
        self.slot_adapters[slot] = None
        self._set_slot_tables(slot, 0, 0.0)

    def _set_slot_tables(self, slot: int, rank: int, scaling: float) -> None:
        self.slot_rank_host[slot] = int(rank)
        self.slot_scaling_host[slot] = float(scaling)
        # In place: kernels and captured CUDA graphs hold these exact tensors.
        self.slot_ranks.copy_(torch.tensor(self.slot_rank_host, dtype=torch.int32))
        self.slot_scalings.copy_(torch.tensor(self.slot_scaling_host, dtype=torch.float32))

    def _stage(self, name: str, layers: Mapping[int, ReferenceLoRA]) -> tuple[list[_Module], int, float]:
        """Validates the adapter and converts it on the host; raises AdapterLoadError, touches nothing."""
        if not isinstance(layers, Mapping):
            raise AdapterLoadError(
                f"adapter {name!r}: layers must be a dict layer id -> ReferenceLoRA, "
                f"got {type(layers).__name__}"
            )
        for lid, lora in layers.items():
            if not _is_int(lid) or lid not in self.layers:
                raise AdapterLoadError(
                    f"adapter {name!r}: layer {lid!r} is not a MoE layer of this pool "
                    f"(layer_ids {list(self.layer_ids)})"
                )
            if not isinstance(lora, ReferenceLoRA):
                raise AdapterLoadError(
                    f"adapter {name!r} layer {lid}: expected a ReferenceLoRA, got {type(lora).__name__}"
                )

        h, i = self.hidden_size, self.intermediate_size
        dims = {"gate": (h, i), "up": (h, i), "down": (i, h)}  # (in, out)
        raw: list[tuple[int, int, str, LoRAProjection]] = []
        for lid in sorted(layers):
            lora = layers[lid]
            projs = {p: getattr(lora, p) for p in _PROJECTIONS}
            experts: set[int] = set()
            for p, d in projs.items():
                if not isinstance(d, Mapping):
                    raise AdapterLoadError(
                        f"adapter {name!r} layer {lid} {p}: expected a dict expert -> LoRAProjection, "
                        f"got {type(d).__name__}"
                    )
                for e in d:
                    if not _is_int(e) or not 0 <= e < self.num_experts:
                        raise AdapterLoadError(
                            f"adapter {name!r} layer {lid} {p}: expert {e!r} out of range "
                            f"[0, num_experts={self.num_experts})"
                        )
                experts.update(d)
            for e in sorted(experts):
                for p in _PROJECTIONS:
                    if e in projs[p]:
                        raw.append((lid, e, p, projs[p][e]))

        for lid, e, p, proj in raw:
            self._check_module(name, lid, e, p, proj, *dims[p])

        live = [m for m in raw if m[3].a.shape[0] > 0]
        rank = max((m[3].a.shape[0] for m in live), default=0)
        scaling = next((float(m[3].scaling) for m in live if float(m[3].scaling) != 0.0), 0.0)

        staged: list[_Module] = []
        for lid, e, p, proj in live:
            where = f"adapter {name!r} layer {lid} expert {e} {p}"
            a = proj.a.detach().to(device="cpu", dtype=torch.float32)
            b = proj.b.detach().to(device="cpu", dtype=torch.float32)
            s = float(proj.scaling)
            if s != scaling:
                b = b * (s / scaling)
            a_c, b_c = a.to(self.dtype), b.to(self.dtype)
            for what, t in (("A", a_c), ("B", b_c)):
                if not bool(torch.isfinite(t).all()):
                    extra = f" after rescaling by scaling {s} / slot scaling {scaling}" if what == "B" else ""
                    raise AdapterLoadError(
                        f"{where}: LoRA {what} overflows the pool dtype {_dtype_name(self.dtype)}{extra}"
                    )
            staged.append(_Module(lid, e, p, a_c, b_c, int(a.shape[0])))
        return staged, rank, scaling

    def _check_module(self, name: str, lid: int, e: int, p: str, proj: object, in_f: int, out_f: int) -> None:
        where = f"adapter {name!r} layer {lid} expert {e} {p}"
        if not isinstance(proj, LoRAProjection):
            raise AdapterLoadError(f"{where}: expected a LoRAProjection, got {type(proj).__name__}")
        for what, t in (("A", proj.a), ("B", proj.b)):
            if not isinstance(t, torch.Tensor):
                raise AdapterLoadError(f"{where}: LoRA {what} must be a torch.Tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise AdapterLoadError(f"{where}: LoRA {what} must be a float tensor, got dtype {t.dtype}")
            if t.dim() != 2:
                raise AdapterLoadError(f"{where}: LoRA {what} must be 2-D, got shape {tuple(t.shape)}")
        r = int(proj.a.shape[0])
        if proj.a.shape[1] != in_f:
            raise AdapterLoadError(
                f"{where}: LoRA A has wrong shape {tuple(proj.a.shape)}, expected (r, {in_f})"
            )
        if proj.b.shape[0] != out_f:
            raise AdapterLoadError(
                f"{where}: LoRA B has wrong shape {tuple(proj.b.shape)}, expected ({out_f}, r)"
            )
        if proj.b.shape[1] != r:
            raise AdapterLoadError(
                f"{where}: rank mismatch: A has rank {r} ({tuple(proj.a.shape)}) but B has rank "
                f"{proj.b.shape[1]} ({tuple(proj.b.shape)})"
            )
        if r > self.max_rank:
            raise AdapterLoadError(f"{where}: rank {r} exceeds the pool's max_rank {self.max_rank}")
        s = proj.scaling
        if isinstance(s, torch.Tensor):
            s = s.item() if s.numel() == 1 else None
        if not isinstance(s, (int, float)) or isinstance(s, bool) or not math.isfinite(s):
            raise AdapterLoadError(f"{where}: scaling must be a finite number, got {proj.scaling!r}")
        for what, t in (("A", proj.a), ("B", proj.b)):
            if not bool(torch.isfinite(t).all()):
                bad = "NaN" if bool(torch.isnan(t).any()) else "Inf"
                raise AdapterLoadError(f"{where}: LoRA {what} holds non-finite values ({bad})")

    def _write_slot(self, slot: int, modules: list[_Module]) -> None:
        """Rewrites all of ``slot`` in every layer: zeros, then the staged modules.

        Each layer's slot is assembled on the host and sent with one copy per buffer, which both
        zeroes the stale contents and writes the new ones.
        """
        big_r, inter = self.max_rank, self.intermediate_size
        by_layer: dict[int, list[_Module]] = {}
        for m in modules:
            by_layer.setdefault(m.layer_id, []).append(m)
        for lid, buf in self.layers.items():
            mods = by_layer.get(lid)
            if not mods:
                for t in buf.tensors():
                    t[slot].zero_()
                continue
            gua, gub, da, db = (torch.zeros(t.shape[1:], dtype=self.dtype) for t in buf.tensors())
            for m in mods:
                r, e = m.rank, m.expert
                if m.proj == "gate":
                    gua[e, :r] = m.a
                    gub[e, :inter, :r] = m.b
                elif m.proj == "up":
                    gua[e, big_r : big_r + r] = m.a
                    gub[e, inter:, :r] = m.b
                else:
                    da[e, :r] = m.a
                    db[e, :, :r] = m.b
            for t, host in zip(buf.tensors(), (gua, gub, da, db), strict=True):
                t[slot].copy_(host)

    # ----------------------------------------------------------------------------------------------
    # Batches
    # ----------------------------------------------------------------------------------------------

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

        The slot ids are built on the host and sent with a single host->device copy (pinned,
        non-blocking on CUDA); nothing is read back from the device.
        """
        if isinstance(adapter_names, str):
            raise ValueError("adapter_names must be a sequence with one entry per sequence, not a str")
        names = tuple(adapter_names)
        if seq_lens is None:
            lens = (1,) * len(names)
        else:
            lens = tuple(seq_lens)
            if len(lens) != len(names):
                raise ValueError(f"seq_lens has {len(lens)} entries for {len(names)} sequences")
            bad = [n for n in lens if not _is_int(n) or n < 0]
            if bad:
                raise ValueError(f"seq_lens must be non-negative ints, got {bad!r}")
            lens = tuple(int(n) for n in lens)

        unknown = [n for n in names if n is not None and n not in self.adapter_slots]
        if unknown:
            raise ValueError(f"unknown adapter(s) {unknown}; loaded adapters: {self.adapters()}")
        seq_slots = [-1 if n is None else self.adapter_slots[n] for n in names]

        token_slots: list[int] = []
        for s, n in zip(seq_slots, lens, strict=True):
            token_slots.extend([s] * n)
        num_tokens = len(token_slots)
        used = tuple(sorted({s for s, n in zip(seq_slots, lens, strict=True) if s >= 0 and n > 0}))
        max_rank = max((self.slot_rank_host[s] for s in used), default=0)

        host = torch.tensor(token_slots, dtype=torch.int32)
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            host = host.pin_memory()

        if out is None:
            device_slots = host.to(self.device, non_blocking=on_cuda)
            return MoELoRABatchInfo(
                token_slots=device_slots,
                slot_ranks=self.slot_ranks,
                slot_scalings=self.slot_scalings,
                num_tokens=num_tokens,
                has_lora=bool(used),
                max_rank=max_rank,
                slots_used=used,
                adapter_names=names,
                seq_lens=lens,
            )

        if out.num_tokens != num_tokens or out.token_slots.numel() != num_tokens:
            raise ValueError(
                f"out= holds {out.token_slots.numel()} tokens but this batch has {num_tokens}; "
                "in-place update needs the same token count"
            )
        if out.token_slots.device != self.slot_ranks.device:
            raise ValueError(f"out.token_slots is on {out.token_slots.device}, the pool on {self.device}")
        out.token_slots.copy_(host, non_blocking=on_cuda)
        out.slot_ranks = self.slot_ranks
        out.slot_scalings = self.slot_scalings
        out.has_lora = bool(used)
        out.max_rank = max_rank
        out.slots_used = used
        out.adapter_names = names
        out.seq_lens = lens
        return out
