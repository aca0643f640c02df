"""Checks of an adapter's tensors and what it costs a pool: finite values, dtype overflow, exactly-zero
rank components; :class:`AdapterLoadReport` and the arena bytes of a layer's experts."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moelora.adapter_weights import ReferenceLoRA
from moelora.peft_adapter.config import _is_int
from moelora.peft_adapter.messages import _fail
from moelora.peft_adapter.safetensors_file import _LORA_DTYPES, _TensorMeta


@dataclass
class AdapterLoadReport:
    """What :func:`read_peft_adapter` found in an adapter directory.

    Attributes:
        path: the adapter directory.
        format: :data:`FORMAT_F1`, :data:`FORMAT_F2` or :data:`FORMAT_F2_SWAPPED`.
        ranks: PEFT module name (F1, e.g. ``model.layers.0.mlp.experts.3.gate_proj``) or parameter path
            (F2, e.g. ``model.layers.0.mlp.experts.gate_up_proj``) -> its rank, as in the file and the
            config (``rank_pattern`` applied).
        scalings: the same names -> ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA).
        layers: model layer ids holding expert LoRA weights.
        experts_per_layer: layer id -> experts with LoRA weights in the file.
        ignored_keys: safetensors key -> why it was not used (attention, shared expert, dense MLP, router,
            modules_to_save, ...).
        pool_bytes: device bytes the adapter takes in a pool's arena: for each (layer, expert) it trains,
            rank rows of the four matrices in the pool's dtype, as many as its largest module rank in that
            layer (a tensor- or expert-parallel pool stores its shard's part).
        max_rank: the adapter's largest effective rank over all expert modules (exactly-zero rank
            components dropped), i.e. the rank its pool slot gets.
        pool_max_rank: the ``max_rank`` the adapter was checked against.
        dtype: the dtype of the returned tensors (after ``pool.load_adapter``: the pool's dtype).
        peft_version: ``peft_version`` from the config (``None`` when absent).
        notes: remarks worth a log line (dropped zero rank components, how the F2 orientation was decided).
    """

    path: str
    format: str
    ranks: dict[str, int]
    scalings: dict[str, float]
    layers: list[int]
    experts_per_layer: dict[int, list[int]]
    ignored_keys: dict[str, str]
    pool_bytes: int
    max_rank: int
    pool_max_rank: int = 0
    dtype: str = "float32"
    peft_version: str | None = None
    notes: list[str] = field(default_factory=list)


# dtypes torch.aminmax reduces directly (others are widened to float32 first, as a float32 cast is exact)
_STAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _batches(
    ts: Sequence[torch.Tensor], kinds: Sequence[Any] | None = None
) -> list[tuple[list[int], torch.Tensor]]:
    """Zero-copy batches of ``ts``: ``(indices, view)`` pairs where ``view[j]`` is ``ts[indices[j]]``.

    Tensors of one kind (``kinds[i]``, e.g. the gate lora_A of one layer's experts), dtype and shape lying
    at a constant stride in one storage (as the per-expert slices of a fused F2 tensor do) share one
    ``(n, *shape)`` strided view, so an op over thousands of small tensors runs as a few large ops; any
    other tensor is a batch of its own.
    """
    out: list[tuple[list[int], torch.Tensor]] = []
    same: dict[tuple[Any, torch.dtype, tuple[int, ...], int], list[int]] = {}
    for i, t in enumerate(ts):
        if t.numel() == 0 or not t.is_contiguous():
            out.append(([i], t.unsqueeze(0)))
        else:
            kind = kinds[i] if kinds is not None else None
            same.setdefault((kind, t.dtype, tuple(t.shape), t.untyped_storage().data_ptr()), []).append(i)
    for (_, dtype, shape, _), idx in same.items():
        idx.sort(key=lambda i: ts[i].data_ptr())
        ptrs = [ts[i].data_ptr() for i in idx]
        size = ts[idx[0]].numel() * dtype.itemsize
        j = 0
        while j < len(idx):
            k, step = j + 1, 0
            while k < len(idx):
                d = ptrs[k] - ptrs[k - 1]
                if (step and d != step) or (not step and (d < size or d % dtype.itemsize)):
                    break
                step, k = d, k + 1
            t0 = ts[idx[j]]
            stride = (step or size) // dtype.itemsize
            view = t0.as_strided((k - j, *shape), (stride, *t0.stride()), t0.storage_offset())
            out.append((idx[j:k], view))
            j = k
    return out


def _aminmax_each(ts: Sequence[torch.Tensor]) -> list[tuple[float, float]]:
    """Exact (min, max) of each non-empty tensor (NaN when it holds a NaN: ``torch.aminmax`` propagates
    NaN), gathered with one host transfer per dtype."""
    lows: dict[torch.dtype, list[torch.Tensor]] = {}
    highs: dict[torch.dtype, list[torch.Tensor]] = {}
    where: list[tuple[torch.dtype, int]] = []
    for t in ts:
        lo, hi = torch.aminmax(t)
        where.append((t.dtype, len(lows.setdefault(t.dtype, []))))
        lows[t.dtype].append(lo)
        highs.setdefault(t.dtype, []).append(hi)
    got = {
        dt: (torch.stack(lows[dt]).double().tolist(), torch.stack(highs[dt]).double().tolist()) for dt in lows
    }
    return [(got[dt][0][j], got[dt][1][j]) for dt, j in where]


def _value_bounds(
    regions: Sequence[tuple[Sequence[str], torch.Tensor]], tensors: Mapping[str, torch.Tensor]
) -> dict[str, tuple[float, float]]:
    """key -> (lo, hi) for each non-empty floating-point tensor of ``regions`` (:class:`_FileTensors`),
    from one reduction per region.

    ``lo`` or ``hi`` is NaN exactly when the tensor holds a NaN; otherwise one is infinite exactly when it
    holds an infinity; and always ``lo <= min`` and ``max <= hi``: the range of its region, or its own
    range (from ``tensors``) where its region holds a non-finite value.
    """
    live = [
        (keys, view if view.dtype in _STAT_DTYPES else view.float())
        for keys, view in regions
        if view.is_floating_point() and view.numel()
    ]
    out: dict[str, tuple[float, float]] = {}
    recheck: list[str] = []
    for (keys, _), value_range in zip(live, _aminmax_each([v for _, v in live]), strict=True):
        if len(keys) == 1 or (math.isfinite(value_range[0]) and math.isfinite(value_range[1])):
            out.update(dict.fromkeys(keys, value_range))
        else:
            recheck.extend(keys)  # which tensors of the region: each one's own range
    own = [tensors[k] if tensors[k].dtype in _STAT_DTYPES else tensors[k].float() for k in recheck]
    out.update(zip(recheck, _aminmax_each(own), strict=True))
    return out


def _check_factor_meta(file: Path, key: str, m: _TensorMeta) -> None:
    """dtype and 2-D of one LoRA factor, from the header (before any tensor data is read)."""
    if m.dtype not in _LORA_DTYPES:
        if m.dtype.startswith(("I", "U", "BOOL")):
            why = "not a floating-point type"
        elif m.dtype.startswith("C"):
            why = "a complex type"
        else:
            why = "a packed or scale-only format that does not become float32 by a plain cast"
        raise _fail(
            file,
            f"LoRA weights must be a floating-point tensor of one of the dtypes {', '.join(_LORA_DTYPES)}; "
            f"got dtype {m.describe_dtype()}: {why}",
            key,
        )
    if m.dim() != 2:
        raise _fail(file, f"LoRA weights must be 2-D, got shape {m.shape}", key)


def _check_finite(file: Path, key: str, value_range: tuple[float, float] | None) -> None:
    """Finiteness of one file tensor; ``value_range`` from :func:`_value_bounds` (None: empty)."""
    if value_range is None:
        return
    lo, hi = value_range
    if math.isnan(lo) or math.isnan(hi):
        raise _fail(file, "tensor holds non-finite values (NaN)", key)
    if math.isinf(lo) or math.isinf(hi):
        raise _fail(file, "tensor holds non-finite values (Inf)", key)


def _overflows(abs_max: list[float], dtype: torch.dtype) -> list[bool]:
    """Whether a finite value of magnitude ``abs_max[i]``, cast to float32 and then to ``dtype``, is no
    longer finite. Casts round monotonically, so this is whether any element of a tensor with that largest
    magnitude overflows (exactly what casting the whole tensor and testing it would find)."""
    if not abs_max:
        return []
    x = torch.tensor(abs_max, dtype=torch.float64).to(torch.float32).to(dtype)
    return (~torch.isfinite(x)).tolist()


def _compact(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drops rank components that are exactly zero (an all-zero B column or A row): they add exactly 0."""
    keep = (b != 0).any(dim=0) & (a != 0).any(dim=1)
    if bool(keep.all()):
        return a, b
    return a[keep], b[:, keep]


def _maybe_zero_components(
    a_batches: Sequence[tuple[Sequence[Any], torch.Tensor]],
    b_batches: Sequence[tuple[Sequence[Any], torch.Tensor]],
) -> set[Any]:
    """The labels whose A may have an all-zero row (``a_batches``: ``(labels, (n, r, in) view)``) or whose
    B may have an all-zero column (``b_batches``: ``(labels, (n, out, r) view)``); :func:`_compact`
    decides exactly.

    A component whose first element is non-zero is live, so only the first elements of all components
    are read; where one is zero, its module's components are summed (an all-zero row or column sums to
    exactly 0, so a non-zero sum, an infinite or NaN one too, proves the component live).
    """
    maybe: set[Any] = set()
    for batches, dim in ((a_batches, 2), (b_batches, 1)):  # the dim A rows / B columns run along
        if not batches:
            continue
        # per module: whether a component starts with a zero (every module, where components are empty)
        heads = [
            (view.select(dim, 0) == 0).any(dim=1) if view.shape[dim] else torch.ones(len(view), dtype=bool)
            for _, view in batches
        ]
        suspect = torch.cat(heads).tolist()
        pos = 0
        for labels, view in batches:
            picked = [j for j, head_is_zero in enumerate(suspect[pos : pos + len(labels)]) if head_is_zero]
            pos += len(labels)
            if picked:
                zero_sum = (view[picked].sum(dim=dim) == 0).any(dim=1).tolist()
                maybe.update(labels[j] for j, z in zip(picked, zero_sum, strict=True) if z)
    return maybe


def _live_experts_and_rank(lora: ReferenceLoRA) -> tuple[set[int], int]:
    """The experts of one layer's adapter with a module, and its largest module rank: the arena blocks
    the pool gives that layer (one of that rank per expert)."""
    mods = [(e, proj) for p in ("gate", "up", "down") for e, proj in getattr(lora, p).items()
            if proj.a.shape[0] > 0]
    return {e for e, _ in mods}, max((proj.a.shape[0] for _, proj in mods), default=0)


def arena_bytes_of(blocks: int, rank: int, hidden: int, inter: int, dtype: torch.dtype) -> int:
    """Arena bytes of ``blocks`` (layer, expert) blocks of ``rank`` rows: each row holds gate and up A
    (2H), gate and up B (2I), down A (I) and down B (H)."""
    return blocks * rank * 3 * (hidden + inter) * torch.empty((), dtype=dtype).element_size()


def _check_positive_int(name: str, v: Any) -> int:
    if not _is_int(v) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)

