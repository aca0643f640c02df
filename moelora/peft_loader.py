"""Reads PEFT LoRA adapters of Mixture-of-Experts models into per-layer :class:`ReferenceLoRA` objects.

:func:`read_peft_adapter` reads a PEFT adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``) on the host, validates all of it and returns, per MoE layer, the
gate/up/down LoRA of every expert in the form :meth:`MoELoRAMemoryPool.add_adapter_weights` takes. It
never touches a pool: :meth:`MoELoRAMemoryPool.load_adapter` reads with the pool's sizes through it and
places the result (validating again, and leaving the pool unchanged on any failure).

Layouts understood (facts checked against PEFT 0.21.2 with transformers 5.23, and the PEFT 0.17.1,
0.18.1, 0.19.0 and 0.19.1 sources):

F1, per-expert modules (transformers 4 MoE models, custom models): one ``nn.Linear`` per expert and
projection, ``target_modules``::

    base_model.model.<...>layers.{L}.<...>.experts.{e}.{gate_proj|up_proj|down_proj}.lora_{A|B}.weight
    base_model.model.<...>layers.{L}.block_sparse_moe.experts.{e}.{w1|w3|w2}.lora_{A|B}.weight  (Mixtral)

``A (r, in)``, ``B (out, r)``; ``w1`` is gate, ``w3`` up, ``w2`` down. ``rank_pattern`` /
``alpha_pattern`` may give single experts their own rank and alpha.

F2, fused expert parameters (transformers 5: ``experts.gate_up_proj (E, 2I, H)``, rows gate then up, and
``experts.down_proj (E, H, I)``, adapted through ``target_parameters`` with ``lora.ParamWrapper``). PEFT
nests one wrapper per targeted parameter in the order the experts module *registers* its parameters
(``named_parameters``), the first one innermost; every transformers-5 experts class registers
``gate_up_proj`` before ``down_proj``. So with both targets the gate_up LoRA is
``...experts.base_layer.lora_{A|B}.weight`` and the down LoRA ``...experts.lora_{A|B}.weight``, whatever
the order of ``target_parameters`` (PEFT's transformers-5 config conversion turns that list into a set,
so the saved order is arbitrary and says nothing about the nesting). With one target its LoRA is
``...experts.lora_{A|B}.weight``. Per parameter ``(E, out, in)``::

    A (E*r, in)    expert-major:  A_e = A[e*r:(e+1)*r]
    B (out, E*r)   rank-major:    B_e = B[:, e::E]          delta_e = scaling * B_e @ A_e

The gate_up A is shared by gate and up: gate uses ``A_e`` with ``B_e[:I]``, up ``A_e`` with ``B_e[I:]``.
PEFT 0.17.0 to 0.19.0 read the 3-D parameter as ``(E, in, out)`` and wrote ``A (E*r, out)``,
``B (in, E*r)`` (the same delta, transposed); then ``A_e = B[:, e::E].T`` and ``B_e = A[e*r:(e+1)*r].T``.
That layout is recognised by the shapes, and where the shapes cannot tell (``in == out``: ``H == 2I``
for gate_up, ``H == I`` for down, and no other F2 tensor of the file decides it) by ``peft_version``
in the config (written since PEFT 0.18.0; fixed in 0.19.1); with no readable ``peft_version`` such an
adapter is refused rather than guessed. gpt-oss (``gate_up_proj`` with interleaved gate/up columns) is
refused.

Scaling is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), with ``r`` and ``alpha``
taken from ``rank_pattern`` / ``alpha_pattern`` exactly as PEFT's ``get_pattern_key`` does: the first
key ``k`` (in the config's order) with ``re.match(rf"(.*\\.)?({k})$", name)``, where ``name`` is the
module path as PEFT sees it, without ``base_model.model.`` (``model.layers.3.mlp.experts.5.w1``), and
for F2 the parameter path (``model.layers.3.mlp.experts.gate_up_proj``). A config PEFT converted from a
transformers-4 adapter (``target_parameters`` with ``.*\\.gate_up_proj`` at rank ``2r``, alpha ``2*alpha``,
a block-diagonal gate_up B) is honoured as written.

Rank components that are exactly zero (an all-zero column of B or row of A) add exactly nothing and are
dropped, so the block-diagonal gate_up of a converted adapter costs rank ``r``, not ``2r``, and experts
a training run never routed to (B still zero) cost nothing; the ``max_rank`` limit applies to this
effective rank.

Keys of non-expert modules (attention, shared experts, dense MLPs, routers, embeddings) and
``modules_to_save`` copies are listed in :attr:`AdapterLoadReport.ignored_keys`, never merged into the
experts. Anything that cannot be served exactly raises :class:`AdapterLoadError` naming the file, the
key (where there is one) and the reason. The safetensors header (names, dtypes, shapes, data offsets) is
read and checked first; tensor data is read only once every shape and dtype of the adapter has passed.

The work is split by concern over :mod:`moelora.peft_adapter` (config parsing, key classification, the
safetensors header, the F2 layout, value checks, the steps of a read, describing an adapter); this module
holds the entry points and the reading of tensor data, and re-exports the names other code imports
from it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from moelora.adapter_weights import AdapterLoadError, ReferenceLoRA
from moelora.adapter_weights import LoRAProjection as LoRAProjection
from moelora.peft_adapter.assembly import (
    _build_layers,
    _check_layers_and_experts,
    _check_read_args,
    _check_tensor_values,
    _load_report,
    _module_rows,
    _plan_from_header,
)
from moelora.peft_adapter.config import _REFUSED_FEATURES as _REFUSED_FEATURES
from moelora.peft_adapter.config import _RESIDUAL_INITS as _RESIDUAL_INITS
from moelora.peft_adapter.config import _parse_config
from moelora.peft_adapter.describe import AdapterInputError, AdapterSummary, describe_peft_adapter
from moelora.peft_adapter.formats import _F1_PROJ as _F1_PROJ
from moelora.peft_adapter.formats import _F2_PARAMS as _F2_PARAMS
from moelora.peft_adapter.formats import FORMAT_F1, FORMAT_F2, FORMAT_F2_SWAPPED, ExpertParamLayout
from moelora.peft_adapter.keys import OTHER_EXPERT_SET, _classify_keys, in_expert_set, lora_module_names
from moelora.peft_adapter.messages import _fail
from moelora.peft_adapter.paths import BIN_NAME, CONFIG_NAME, WEIGHTS_NAME, _adapter_files, check_adapter_path
from moelora.peft_adapter.safetensors_file import _LORA_DTYPES as _LORA_DTYPES
from moelora.peft_adapter.safetensors_file import _ST_DTYPES as _ST_DTYPES
from moelora.peft_adapter.safetensors_file import (
    _bad_file,
    _file_views,
    _FileTensors,
    _Header,
    _header_length,
    _parse_header,
    _read_safetensors_header,
    _UseSafetensorsReader,
)
from moelora.peft_adapter.validation import AdapterLoadReport
from moelora.peft_adapter.validation import arena_bytes_of as arena_bytes_of

__all__ = [
    "BIN_NAME",
    "CONFIG_NAME",
    "FORMAT_F1",
    "FORMAT_F2",
    "FORMAT_F2_SWAPPED",
    "OTHER_EXPERT_SET",
    "WEIGHTS_NAME",
    "AdapterInputError",
    "AdapterLoadReport",
    "AdapterSummary",
    "check_adapter_path",
    "describe_peft_adapter",
    "in_expert_set",
    "lora_module_names",
    "read_peft_adapter",
]


# --------------------------------------------------------------------------------------------------
# Reading tensor data (the header is read and checked first: :func:`_read_safetensors_header`)
# --------------------------------------------------------------------------------------------------


def _owned_buffer(n: int) -> tuple[Any, torch.Tensor]:
    """``n`` bytes of private anonymous memory as (writable Python buffer, uint8 tensor on it).

    Transparent huge pages are asked for where the OS has them: faulting a 1 GB adapter in 4 KiB at a
    time costs about as much as reading it (on the H200 machine: 0.25 s instead of 0.38 s for the file,
    and 0.007 s instead of 0.03 s to free it). The tensor, and every view of it, keeps the memory alive.
    """
    try:
        import mmap

        raw: Any = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (ImportError, AttributeError, OSError, ValueError):  # pragma: no cover - not Linux / macOS
        raw = bytearray(n)
    else:
        try:
            raw.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):  # pragma: no cover - no transparent huge pages here
            pass
    return raw, torch.frombuffer(raw, dtype=torch.uint8)


# Files past this size are read by several threads at once, each a part (a read of the page cache is
# a copy, and one thread's copy runs at a fraction of the memory's bandwidth).
_PARALLEL_READ_BYTES = 64 << 20
_READ_THREADS = 8


def _read_into(fd: int, view: memoryview, size: int) -> int:
    """Reads bytes [0, size) of ``fd`` into ``view``; returns how many the file gave (fewer if it shrank)."""

    def read_part(start: int, end: int) -> int:
        got = start
        while got < end:
            k = os.preadv(fd, [view[got:end]], got)
            if not k:
                break
            got += k
        return got - start

    parts = min(_READ_THREADS, os.cpu_count() or 1) if size > _PARALLEL_READ_BYTES else 1
    if parts == 1:
        return read_part(0, size)
    bounds = [size * p // parts for p in range(parts + 1)]
    with ThreadPoolExecutor(max_workers=parts, thread_name_prefix="moelora-read") as pool:
        return sum(pool.map(read_part, bounds[:-1], bounds[1:]))


def _read_safetensors_once(
    file: Path,
    header: _Header | None = None,
    keys: Iterable[str] | None = None,
    groups: Iterable[Sequence[str]] = (),
) -> _FileTensors:
    """Reads the whole file with one ``read`` into private memory and returns views of it: tensors ``keys``
    (default: all), batched along ``groups`` (see :func:`_file_views`).

    The tensors own their memory (not a map of the file, which could change or shrink under them after
    they were validated). ``header`` is the one :func:`_read_safetensors_header` checked; the bytes read
    must begin with exactly it, as the file may have changed in between. Without it the header is parsed
    and checked (:func:`_parse_header`) from the bytes read.
    """
    size = file.stat().st_size
    if header is not None and size != header.size:
        raise _bad_file(
            file, f"the file changed while it was read ({size} bytes, {header.size} when its header was read)"
        )
    if size < 8:
        raise _bad_file(file, f"{size} bytes: shorter than the 8-byte header length")
    raw, buf = _owned_buffer(size)
    view = memoryview(raw)
    with open(file, "rb", buffering=0) as fh:
        got = _read_into(fh.fileno(), view, size)
    if got != size:
        raise _bad_file(file, f"the file shrank while it was read ({got} of {size} bytes)")
    if header is None:
        hlen = _header_length(file, bytes(view[:8]), size)
        metas = _parse_header(file, bytes(view[8 : 8 + hlen]), size - 8 - hlen)
        base = 8 + hlen
    else:
        if view[: len(header.raw)] != header.raw:
            raise _bad_file(file, "the file changed while it was read (its header is not the one checked)")
        metas, base = header.tensors, len(header.raw)
    return _file_views(buf, base, metas, list(metas) if keys is None else list(keys), groups)


def _read_safetensors(
    file: Path, header: _Header, keys: Sequence[str], groups: Iterable[Sequence[str]] = ()
) -> _FileTensors:
    """Tensors ``keys`` of a safetensors file whose ``header`` was checked, in memory the tensors own;
    ``groups`` (subsets of ``keys``) are batched where they lie at a constant stride (:func:`_file_views`)."""
    try:
        from safetensors import safe_open
    except ImportError as e:  # pragma: no cover - safetensors is a dependency
        raise _fail(file, "the safetensors package is needed to read adapters") from e
    try:
        # safetensors validates the file too (whatever it refuses is refused here too) ...
        with safe_open(str(file), framework="pt", device="cpu") as f:
            if sorted(f.keys()) != sorted(header.tensors):
                raise _bad_file(
                    file, "the file changed while it was read (its tensors are not the ones checked)"
                )
            if sys.byteorder == "little":
                try:
                    # ... and the data is read once, into private memory (views, no per-tensor copy)
                    return _read_safetensors_once(file, header, keys, groups)
                except _UseSafetensorsReader:
                    pass
            # per tensor, through safetensors (its tensors map the file: copy them into owned memory)
            out: dict[str, torch.Tensor] = {}
            for k in keys:
                m, sl = header.tensors[k], f.get_slice(k)
                if sl.get_dtype() != m.dtype or tuple(sl.get_shape()) != m.shape:
                    raise _bad_file(file, "the file changed while it was read (another dtype or shape)", k)
                out[k] = f.get_tensor(k).clone()
            alone = [([k], t) for k, t in out.items()]
            return _FileTensors(
                out, [(k, t.unsqueeze(0)) for k, t in alone], [(k, t.reshape(-1)) for k, t in alone]
            )
    except AdapterLoadError:
        raise
    except Exception as e:  # SafetensorError, OSError, ...: truncated, unreadable, not a safetensors file
        raise _fail(
            file,
            f"cannot read the safetensors file (truncated, corrupt or unreadable): {type(e).__name__}: {e}",
        ) from e


# --------------------------------------------------------------------------------------------------
# Reading an adapter
# --------------------------------------------------------------------------------------------------


def read_peft_adapter(
    path: str | os.PathLike[str],
    *,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    layer_ids: Iterable[int],
    max_rank: int,
    dtype: torch.dtype = torch.float32,
    pool_dtype: torch.dtype | None = None,
    layout: ExpertParamLayout | None = None,
) -> tuple[dict[int, ReferenceLoRA], AdapterLoadReport]:
    """Reads and validates a PEFT LoRA adapter of an MoE model; returns per-layer expert LoRAs and a report.

    Args:
        path: the adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).
        num_experts: ``E``, routed experts per MoE layer of the base model.
        hidden_size: ``H``.
        intermediate_size: ``I``, the per-expert FFN width.
        layer_ids: the model's MoE layer indices; expert weights of any other layer are refused.
        max_rank: the largest (effective) rank a module may have.
        dtype: dtype of the returned tensors (arithmetic is done in float32 first).
        pool_dtype: the dtype the pool stores (default: ``dtype``), for ``pool_bytes`` and the overflow
            check. A pool that rescales B's per module (rank/alpha patterns) rounds once if it is given
            float32 tensors: read with ``dtype=torch.float32, pool_dtype=pool.dtype``.
        layout: how the model's fused expert parameters map onto gate, up and down
            (:class:`ExpertParamLayout`; default: ``[gate; up]`` rows of ``num_experts`` experts).

    Returns:
        ``({layer_id: ReferenceLoRA}, AdapterLoadReport)``: CPU tensors, ``a (r, in)``, ``b (out, r)``, the
        module's own scaling, ready for :meth:`MoELoRAMemoryPool.add_adapter_weights`. Exactly-zero modules
        are left out; every layer with expert weights in the file has an entry. The tensors own their
        memory (never a map of the file); per-expert (F1) factors already in ``dtype`` are views of the
        one buffer the file was read into, which lives as long as any of them.

    Raises:
        AdapterLoadError: for anything that cannot be served exactly; the message names the file, the key
            (where there is one) and the reason. See the module docstring for the formats.
        ValueError: for invalid arguments (not adapter problems).
        TypeError: ``path`` is not a ``str`` / ``os.PathLike`` (see :func:`check_adapter_path`).
    """
    return _read(
        path,
        num_experts=num_experts,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        layer_ids=layer_ids,
        max_rank=max_rank,
        dtype=dtype if pool_dtype is None else pool_dtype,
        out_dtype=dtype,
        layout=layout if layout is not None else ExpertParamLayout(),
    )


def _read(
    path: str | os.PathLike[str],
    *,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    layer_ids: Iterable[int],
    max_rank: int,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    layout: ExpertParamLayout,
) -> tuple[dict[int, ReferenceLoRA], AdapterLoadReport]:
    """:func:`read_peft_adapter`, checking overflow in ``dtype`` but returning ``out_dtype`` tensors.

    The file is read twice: its header first, and every name, dtype and shape is checked against the
    config and the model's sizes; its tensor data only then, for an adapter that passed all of that.
    """
    sizes = _check_read_args(num_experts, hidden_size, intermediate_size, layer_ids, max_rank, dtype,
                             out_dtype, layout)
    adir, cfg_file, w_file = _adapter_files(path)
    settings = _parse_config(cfg_file, layout)
    # Only the header is read here: every name, dtype and shape is checked before any tensor data is.
    header = _read_safetensors_header(w_file)
    if not header.tensors:
        raise _fail(w_file, "the file holds no tensors: no expert LoRA weights at all")
    # refuses mixed layouts, no expert weights, lone factors, bad factor dtypes
    classified = _classify_keys(header.tensors, settings, w_file, layout.expert_set)
    _check_layers_and_experts(classified, sizes, w_file)
    plan = _plan_from_header(classified, header.tensors, settings, w_file, sizes, layout)

    # tensor data: read only now, for a file whose header and shapes all passed
    f1_batched = [keys for a_and_b in plan.f1_groups.values() for keys in a_and_b]
    data = _read_safetensors(w_file, header, classified.factor_keys, f1_batched)
    over_keys = _check_tensor_values(w_file, data, classified.factor_keys, dtype)
    module_rows = _module_rows(classified, plan, data, sizes, layout)
    built = _build_layers(module_rows, over_keys, w_file, sizes.max_rank, dtype, out_dtype,
                          factors_own_memory=plan.format == FORMAT_F1)
    report = _load_report(adir, plan, built, classified.ignored, settings, sizes, dtype, out_dtype)
    return built.layers, report
