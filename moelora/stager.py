"""Adapters checked and converted on the host before any slot of a pool is touched.

:class:`AdapterStager` validates an adapter (given as tensors, or read from a PEFT directory) and converts
it into rank-sized host stacks in the pool dtype (:class:`StagedAdapter`): everything a pool does to an
adapter before it writes a slot, so a refused adapter leaves the pool as it was. It needs only the pool's
sizes, so a copy of them (``AdapterStager.sizes_of``) stages in the load process (``moelora.load_worker``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moelora.adapter_weights import AdapterLoadError, LoRAProjection, ReferenceLoRA
from moelora.parallel import MoEShard
from moelora.peft_loader import ExpertParamLayout, arena_bytes_of, read_peft_adapter

__all__ = ["AdapterStager", "StagedAdapter"]

_PROJECTIONS = ("gate", "up", "down")
_FLOAT32_MAX = torch.finfo(torch.float32).max
_STAGE_THREADS = 8

@dataclass
class StagedAdapter:
    """A validated adapter on the host, rank-sized: what a slot write copies, and the host tier keeps.

    ``layers[lid]`` holds the stacks present of ``gate_a``/``up_a`` (E, r, H), ``gate_b``/``up_b``
    (E, I, r), ``down_a`` (E, r, I), ``down_b`` (E, H, r), zero where an expert has no module, in the pool
    dtype, with every B already rescaled to the slot scaling. B keeps PEFT's orientation on the host (a
    contiguous cast); the slot write transposes it into the arena's rank rows on the device.
    ``experts[lid]`` lists the experts of layer ``lid`` with a module of rank > 0: the only ones that take
    arena rows, ``layer_ranks[lid]`` (<= ``rank``) rows each: its largest module rank there.
    """

    name: str
    rank: int
    scaling: float
    layers: dict[int, dict[str, torch.Tensor]]
    experts: dict[int, list[int]] = field(default_factory=dict)
    layer_ranks: dict[int, int] = field(default_factory=dict)
    source: str | None = None
    report: object | None = None
    nbytes: int = 0



def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_positive_int(name: str, v: object) -> int:
    if not _is_int(v) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")



class AdapterStager:
    """Validates an adapter and converts it into rank-sized host stacks in the pool dtype: everything a
    pool does to an adapter before touching a slot. Needs only the pool's sizes (``num_experts``,
    ``hidden_size``, ``intermediate_size``, ``layer_ids``, ``max_rank``, ``dtype``, ``shard``), so a
    copy of them (``sizes_of``) stages in another process."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    layer_ids: tuple[int, ...]
    max_rank: int
    dtype: torch.dtype
    shard: MoEShard | None
    expert_layout: ExpertParamLayout

    @classmethod
    def sizes_of(cls, pool: AdapterStager) -> AdapterStager:
        """A stager with ``pool``'s sizes and nothing else (picklable)."""
        stager = cls()
        for attr in ("num_experts", "hidden_size", "intermediate_size", "layer_ids", "max_rank", "dtype",
                     "shard", "expert_layout"):
            setattr(stager, attr, getattr(pool, attr))
        return stager

    def _read_and_stage(self, name: str, path: Path) -> StagedAdapter:
        """Reads and validates the PEFT directory ``path`` (checked) and stages it as ``name``."""
        shard = self.shard
        layers, report = read_peft_adapter(
            path, num_experts=shard.num_experts if shard else self.num_experts, hidden_size=self.hidden_size,
            intermediate_size=shard.intermediate_size if shard else self.intermediate_size,
            layer_ids=self.layer_ids, max_rank=self.max_rank,
            dtype=torch.float32, pool_dtype=self.dtype,  # one rounding, after any per-module rescale
            layout=self.expert_layout,
        )
        if shard is not None:
            layers = shard.split_adapter(name, layers)
        staged = self._stage(name, layers)
        report.pool_bytes = self._arena_bytes(staged)
        staged.source = str(path.resolve())
        report.dtype = str(self.dtype).removeprefix("torch.")  # the staged tensors are in the pool dtype
        staged.report = report
        return staged

    def _layer_blocks(self, staged: StagedAdapter) -> list[tuple[int, int]]:
        """(rank, block count) ``staged`` takes in each of the pool's layers, in layer order; (0, 0) where it
        trains nothing."""
        blocks = []
        for lid in self.layer_ids:
            rank, count = staged.layer_ranks.get(lid, 0), len(staged.experts.get(lid, ()))
            blocks.append((rank, count) if rank and count else (0, 0))
        return blocks

    def _arena_bytes(self, staged: StagedAdapter) -> int:
        """Device bytes ``staged`` takes in the pool's arena."""
        return sum(arena_bytes_of(count, rank, self.hidden_size, self.intermediate_size, self.dtype)
                   for rank, count in self._layer_blocks(staged))

    def _stack_shapes(self, rank: int) -> dict[str, tuple[int, int, int]]:
        """The shape of each host stack of one layer at ``rank``: A (E, rank, in), B (E, out, rank)."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        return {"gate_a": (e, rank, h), "up_a": (e, rank, h), "down_a": (e, rank, i),
                "gate_b": (e, i, rank), "up_b": (e, i, rank), "down_b": (e, h, rank)}

    def _stage(self, name: str, layers: Mapping[int, ReferenceLoRA]) -> StagedAdapter:
        """Validates the adapter and converts it on the host; raises AdapterLoadError, touches nothing."""
        if not isinstance(layers, Mapping):
            raise AdapterLoadError(
                f"adapter {name!r}: layers must be a dict layer id -> ReferenceLoRA, "
                f"got {type(layers).__name__}"
            )
        for lid, lora in layers.items():
            if not _is_int(lid) or lid not in self.layer_ids:
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

        staged = self._stage_stacked(name, raw, dims)
        if staged is not None:
            return staged

        # Module by module: the reference path, and the one that names the first problem exactly.
        for lid, e, p, proj in raw:
            self._check_module(name, lid, e, p, proj, *dims[p])

        live = [m for m in raw if m[3].a.shape[0] > 0]
        rank = max((m[3].a.shape[0] for m in live), default=0)
        scaling = next((float(m[3].scaling) for m in live if float(m[3].scaling) != 0.0), 0.0)

        shapes = self._stack_shapes(rank)
        stacks: dict[int, dict[str, torch.Tensor]] = {}
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
            layer = stacks.setdefault(lid, {})
            r = int(a.shape[0])
            for key, t in ((f"{p}_a", a_c), (f"{p}_b", b_c)):
                if key not in layer:
                    layer[key] = torch.zeros(shapes[key], dtype=self.dtype)
                if key.endswith("_a"):
                    layer[key][e, :r] = t
                else:
                    layer[key][e, :, :r] = t
        nbytes = sum(t.nbytes for st in stacks.values() for t in st.values())
        experts = {lid: sorted({e for m_lid, e, _, _ in live if m_lid == lid}) for lid in stacks}
        layer_ranks = {lid: max(m[3].a.shape[0] for m in live if m[0] == lid) for lid in stacks}
        return StagedAdapter(name=name, rank=rank, scaling=scaling, layers=stacks, experts=experts,
                              layer_ranks=layer_ranks, nbytes=nbytes)

    def _stage_stacked(
        self,
        name: str,
        raw: list[tuple[int, int, str, LoRAProjection]],
        dims: Mapping[str, tuple[int, int]],
    ) -> StagedAdapter | None:
        """:meth:`_stage` with a few tensor ops per (layer, projection) stack instead of per module.

        Gives exactly the stacks of the module-by-module path, or ``None`` when that path must run: a
        problem anywhere (it then raises the first one, in its order, with its message), or tensors off
        the CPU. Values are checked once, on the final stacks in the pool dtype: a non-finite input stays
        non-finite through the float32 cast, the rescale and the pool-dtype cast, and an overflow shows
        as an infinity, so a stack is finite exactly when every module check of that path passes.
        """
        try:
            for lid, e, p, proj in raw:
                self._check_module(name, lid, e, p, proj, *dims[p], values=False)
        except AdapterLoadError:
            return None
        std = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
        if any(t.device.type != "cpu" or t.dtype not in std for m in raw for t in (m[3].a, m[3].b)):
            return None

        live = [m for m in raw if m[3].a.shape[0] > 0]
        rank = max((m[3].a.shape[0] for m in live), default=0)
        scaling = next((float(m[3].scaling) for m in live if float(m[3].scaling) != 0.0), 0.0)

        e_count, f32 = self.num_experts, torch.float32
        shapes = self._stack_shapes(rank)
        groups: dict[int, dict[str, list[tuple[int, LoRAProjection]]]] = {}
        for lid, e, p, proj in live:
            groups.setdefault(lid, {}).setdefault(p, []).append((e, proj))

        def build(lid: int, p: str, key: str) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
            mods = groups[lid][p]
            ratios = [float(proj.scaling) / scaling if float(proj.scaling) != scaling else 1.0
                      for _, proj in mods]
            full = len(mods) == e_count and all(proj.a.shape[0] == rank for _, proj in mods)
            is_b = key.endswith("_b")
            ts = [proj.b if is_b else proj.a for _, proj in mods]
            ts = [t if t.dtype == f32 else t.to(f32) for t in ts]
            with torch.no_grad():
                if full:  # every expert at the slot rank: one pass (a rescale first where needed)
                    dst = torch.empty(shapes[key], dtype=self.dtype)
                    if is_b and any(r != 1.0 for r in ratios):
                        ratio = torch.tensor(ratios, dtype=torch.float64).to(f32).view(-1, 1, 1)
                        dst.copy_(torch.stack(ts).mul_(ratio))
                    else:  # cast as copied: no float32 stack in between
                        torch._foreach_copy_(list(dst.unbind(0)), ts)
                else:  # missing experts or lower ranks: zeros, then module by module
                    dst = torch.zeros(shapes[key], dtype=self.dtype)
                    for (e, _), t, ratio_e in zip(mods, ts, ratios, strict=True):
                        r = t.shape[1] if is_b else t.shape[0]
                        if is_b and ratio_e != 1.0:
                            t = t * ratio_e
                        (dst[e, :, :r] if is_b else dst[e, :r]).copy_(t)
            return dst, torch.aminmax(dst)

        # The stacks are independent and their copies release the interpreter lock: built side by side.
        wanted = [(lid, p, f"{p}{ab}") for lid, projs in groups.items() for p in _PROJECTIONS if p in projs
                  for ab in ("_a", "_b")]
        with ThreadPoolExecutor(max_workers=_STAGE_THREADS, thread_name_prefix="moelora-stage") as threads:
            built = list(threads.map(lambda job: build(*job), wanted))
        stacks: dict[int, dict[str, torch.Tensor]] = {}
        for (lid, _, key), (dst, _) in zip(wanted, built, strict=True):
            stacks.setdefault(lid, {})[key] = dst
        ranges = [bound for _, bounds in built for bound in bounds]
        if ranges and not bool(torch.isfinite(torch.stack(ranges)).all()):
            return None  # NaN propagates through aminmax; the module path names the problem
        nbytes = sum(t.nbytes for st in stacks.values() for t in st.values())
        experts = {lid: sorted({e for mods in projs.values() for e, _ in mods})
                   for lid, projs in groups.items()}
        layer_ranks = {lid: max(proj.a.shape[0] for mods in projs.values() for _, proj in mods)
                       for lid, projs in groups.items()}
        return StagedAdapter(name=name, rank=rank, scaling=scaling, layers=stacks, experts=experts,
                              layer_ranks=layer_ranks, nbytes=nbytes)

    def _check_module(
        self, name: str, lid: int, e: int, p: str, proj: object, in_f: int, out_f: int, *, values: bool = True
    ) -> None:
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
        if abs(s) > _FLOAT32_MAX:  # the slot table is float32: it would overflow there
            raise AdapterLoadError(f"{where}: scaling {s!r} does not fit float32 (|s| <= {_FLOAT32_MAX:.4g})")
        if not values:
            return
        for what, t in (("A", proj.a), ("B", proj.b)):
            if not bool(torch.isfinite(t).all()):
                bad = "NaN" if bool(torch.isnan(t).any()) else "Inf"
                raise AdapterLoadError(f"{where}: LoRA {what} holds non-finite values ({bad})")
