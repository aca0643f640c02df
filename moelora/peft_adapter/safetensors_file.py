"""The safetensors file of an adapter: its header, checked as safetensors checks it, before any tensor
data is read; and zero-copy views of the file's bytes once they are read (the reading itself is
:func:`moelora.peft_loader._read_safetensors`)."""

from __future__ import annotations

import json
import math
import operator
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from moelora.adapter_weights import AdapterLoadError
from moelora.peft_adapter.messages import _brief, _fail, _json_type

# safetensors dtype names -> torch dtypes the one-read path builds views of (a tensor whose dtype is missing
# here, e.g. on an older torch, is read through safetensors' own reader)
_ST_DTYPES: dict[str, torch.dtype] = {
    name: dt
    for name, dt in (
        ("F64", torch.float64),
        ("F32", torch.float32),
        ("F16", torch.float16),
        ("BF16", torch.bfloat16),
        ("F8_E4M3", getattr(torch, "float8_e4m3fn", None)),
        ("F8_E5M2", getattr(torch, "float8_e5m2", None)),
        ("I64", torch.int64),
        ("I32", torch.int32),
        ("I16", torch.int16),
        ("I8", torch.int8),
        ("U8", torch.uint8),
        ("U16", getattr(torch, "uint16", None)),
        ("U32", getattr(torch, "uint32", None)),
        ("U64", getattr(torch, "uint64", None)),
        ("BOOL", torch.bool),
    )
    if dt is not None
}
# Every dtype the safetensors format defines (safetensors 0.8) -> bits per element. The header of every
# tensor, used or ignored, is checked with it (byte sizes, offsets) before any tensor data is read.
_ST_BITS: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
# The dtypes a LoRA factor may have: real floating-point types that become float32 by a plain cast. Packed
# microscaling formats (F4, F6_*) and the scale-only F8_E8M0 are no LoRA weights torch can cast.
_LORA_DTYPES: tuple[str, ...] = tuple(
    d for d in ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2") if d in _ST_DTYPES
)
_ST_MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header
_ST_MAX_DIM = 2**63 - 1  # torch sizes are int64


class _TensorMeta(NamedTuple):
    """One tensor as the safetensors header describes it (none of its data read).

    A named tuple: a header holds one per tensor (tens of thousands in a per-expert adapter), and a tuple
    of strings and ints is quick to build and soon left alone by the garbage collector.
    """

    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # data_offsets, relative to the end of the header
    end: int

    def dim(self) -> int:
        return len(self.shape)

    def describe_dtype(self) -> str:
        dt = _ST_DTYPES.get(self.dtype)
        return self.dtype if dt is None else f"{str(dt).removeprefix('torch.')} ({self.dtype})"


@dataclass(frozen=True)
class _Header:
    """The checked header of a safetensors file and what it was checked against."""

    size: int  # the file size the data_offsets were checked against
    raw: bytes  # the first 8 + header-length bytes, exactly as read
    tensors: dict[str, _TensorMeta]


def _bad_file(file: Path, reason: str, key: str | None = None) -> AdapterLoadError:
    return _fail(file, f"cannot read the safetensors file (truncated, corrupt or unreadable): {reason}", key)


def _header_length(file: Path, first8: bytes, size: int) -> int:
    """The header length the first 8 bytes give (little-endian u64), refused unless the file holds it."""
    if len(first8) < 8:
        raise _bad_file(file, f"{size} bytes: shorter than the 8-byte header length")
    hlen = int.from_bytes(first8[:8], "little")
    if hlen > _ST_MAX_HEADER:
        raise _bad_file(file, f"header length {hlen} exceeds safetensors' limit of {_ST_MAX_HEADER} bytes")
    if 8 + hlen > size:
        raise _bad_file(file, f"header length {hlen} does not fit the file of {size} bytes")
    return hlen


def _parse_header(file: Path, text: bytes, data_len: int) -> dict[str, _TensorMeta]:
    """The tensors of a safetensors JSON header, checked as safetensors checks them: a dtype of the format,
    a shape, data_offsets within the ``data_len`` data bytes holding exactly shape x dtype bytes, and the
    tensors tiling the data (no gap, no overlap)."""
    try:
        header = json.loads(text.decode("utf-8"))
    except RecursionError as e:  # json's parser recurses once per nesting level
        raise _bad_file(file, "the JSON header is nested too deeply to parse") from e
    except ValueError as e:  # not UTF-8, JSONDecodeError, integers beyond int_max_str_digits
        raise _bad_file(file, f"the header is not valid UTF-8 JSON: {e}") from e
    if not isinstance(header, dict):
        raise _bad_file(file, f"the header is not a JSON object (got a JSON {_json_type(header)})")
    out: dict[str, _TensorMeta] = {}
    for key, info in header.items():
        if key == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise _bad_file(file, f"__metadata__ must be an object of strings, got {_brief(info)}")
            continue
        out[key] = _tensor_meta(file, key, info, data_len)
    _check_tiling(file, out, data_len)
    return out


def _tensor_meta(file: Path, key: str, info: Any, data_len: int) -> _TensorMeta:
    """One tensor's header entry, checked: a dtype of the format, a shape, and data_offsets within the
    ``data_len`` data bytes holding exactly shape x dtype bytes."""
    if not isinstance(info, dict):
        raise _bad_file(file, f"header entry {_brief(info)} is not an object", key)
    dt, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    dt_bits = _ST_BITS.get(dt) if isinstance(dt, str) else None
    if dt_bits is None:
        raise _fail(
            file,
            f"unknown dtype {_brief(dt)} in the safetensors header: LoRA weights must have one of the "
            f"dtypes {', '.join(_LORA_DTYPES)} (the safetensors format defines {', '.join(_ST_BITS)})",
            key,
        )
    if not _is_shape(shape):
        raise _bad_file(file, f"invalid shape {_brief(shape)}: expected a list of non-negative ints", key)
    if type(offs) is not list or len(offs) != 2 or type(offs[0]) is not int or type(offs[1]) is not int:
        raise _bad_file(
            file, f"invalid data_offsets {_brief(offs)}: expected [begin, end] byte offsets", key
        )
    bits = math.prod(shape) * dt_bits
    if bits % 8:
        raise _bad_file(file, f"a {dt} tensor of shape {shape} is not a whole number of bytes", key)
    begin, end = offs
    if not 0 <= begin <= end <= data_len or end - begin != bits // 8:
        raise _bad_file(
            file,
            f"data_offsets {_brief(offs)} do not hold the {bits // 8} bytes of a {dt} tensor of shape "
            f"{_brief(shape)} within the {data_len} data bytes of the file",
            key,
        )
    return _TensorMeta(dt, tuple(shape), begin, end)


def _is_shape(shape: Any) -> bool:
    """Whether a header value is a shape: a list of ints in torch's size range (bools are no ints)."""
    if type(shape) is not list:
        return False
    for d in shape:
        if type(d) is not int or not 0 <= d <= _ST_MAX_DIM:
            return False
    return True


_BEGIN = operator.attrgetter("begin")
_END = operator.attrgetter("end")


def _check_tiling(file: Path, metas: Mapping[str, _TensorMeta], data_len: int) -> None:
    """Refuses tensors that do not tile the ``data_len`` data bytes exactly (a gap, an overlap, bytes left
    over), naming the first offending tensor in (begin, end, key) order."""
    by_begin = sorted(metas.values(), key=_BEGIN)
    begins = [m.begin for m in by_begin]
    ends = [m.end for m in by_begin]
    # Ordered by begin alone, tensors that tile the data follow each other without a gap; a failure here
    # may still be a valid file (empty tensors sharing a begin), which the exact order below decides.
    if by_begin:
        tiled = begins[0] == 0 and begins[1:] == ends[:-1] and ends[-1] == data_len
    else:
        tiled = data_len == 0
    if tiled:
        return
    pos = 0
    for begin, end, key in sorted((m.begin, m.end, k) for k, m in metas.items()):
        if begin != pos:
            raise _bad_file(file, f"data_offsets overlap or leave a gap at byte {pos}", key)
        pos = end
    if pos != data_len:
        raise _bad_file(file, f"the tensors cover {pos} of the {data_len} data bytes")


def _read_safetensors_header(file: Path) -> _Header:
    """Reads and checks the header of a safetensors file: its first 8 + header-length bytes, no tensor data,
    so that names, dtypes and shapes are validated before a (possibly large) file is read."""
    try:
        with open(file, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                raise _fail(file, "the file is empty (0 bytes)")
            first = fh.read(8)
            hlen = _header_length(file, first, size)
            text = fh.read(hlen)
    except OSError as e:
        raise _fail(file, f"cannot read the safetensors file: {type(e).__name__}: {e}") from e
    if len(text) != hlen:
        raise _bad_file(file, f"the file shrank while its header was read ({len(text)} of {hlen} bytes)")
    return _Header(size, first + text, _parse_header(file, text, size - 8 - hlen))


class _UseSafetensorsReader(Exception):
    """The file is valid for safetensors but uses something the one-read path does not map."""


@dataclass
class _FileTensors:
    """Tensors of a safetensors file, and how they lie in memory.

    ``batches`` and ``regions`` each hold every tensor exactly once, as zero-copy views: a batch is
    ``(keys, view)`` with ``view[j]`` the tensor ``keys[j]`` (tensors of one group, dtype and shape lying
    at a constant stride share one ``(n, *shape)`` view, so an op over thousands of them runs as a few
    large ops); a region is ``(keys, 1-D view of all their elements)`` for tensors of one dtype lying back
    to back. A tensor read on its own is a batch and a region by itself.
    """

    tensors: dict[str, torch.Tensor]
    batches: list[tuple[list[str], torch.Tensor]]
    regions: list[tuple[list[str], torch.Tensor]]


def _file_views(
    buf: torch.Tensor,
    base: int,
    metas: Mapping[str, _TensorMeta],
    keys: Sequence[str],
    groups: Iterable[Sequence[str]],
) -> _FileTensors:
    """The tensors ``keys`` as views of ``buf`` (the file's bytes, tensor data from byte ``base`` on).

    Each of ``groups`` (disjoint subsets of ``keys``, e.g. one layer's experts' gate lora_A) is cut into
    runs of one dtype and 2-D shape at a constant stride, and each run's tensors come from one strided
    view: a tensor per run element in one call, not a few calls per tensor. A tensor not aligned for its
    dtype is an aligned copy; a dtype without a torch view here raises :class:`_UseSafetensorsReader`.
    """
    typed: dict[torch.dtype, torch.Tensor] = {}

    def as_dtype(dtype: torch.dtype) -> torch.Tensor:
        """The whole buffer as ``dtype`` elements (so storage offsets count in them)."""
        if dtype not in typed:
            typed[dtype] = buf[: buf.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
        return typed[dtype]

    out: dict[str, torch.Tensor] = {}
    batches: list[tuple[list[str], torch.Tensor]] = []
    # with the buffer aligned for every dtype, a tensor is aligned exactly when its offset in it is
    for group in groups if buf.data_ptr() % 8 == 0 else ():
        group_metas = [metas[key] for key in group]
        layouts: dict[tuple[str, tuple[int, ...]], list[tuple[int, str]]] = {}
        if len({(m.dtype, m.shape) for m in group_metas}) == 1:  # the usual case
            first = group_metas[0]
            layouts[(first.dtype, first.shape)] = list(zip(map(_BEGIN, group_metas), group, strict=True))
        else:
            for key, m in zip(group, group_metas, strict=True):
                layouts.setdefault((m.dtype, m.shape), []).append((m.begin, key))
        for (dt_name, shape), spans in layouts.items():
            dtype = _ST_DTYPES.get(dt_name)
            if dtype is None or len(shape) != 2 or 0 in shape:
                continue  # tensor by tensor, below
            (rows, cols), item = shape, dtype.itemsize
            spans.sort()
            for run, start, step in _constant_stride_runs(spans, rows * cols * item):
                if (base + start) % item or step % item:
                    continue  # not all aligned: tensor by tensor, below
                view = as_dtype(dtype).as_strided(
                    (len(run), rows, cols), (step // item, cols, 1), (base + start) // item
                )
                out.update(zip(run, view.unbind(0), strict=True))
                batches.append((run, view))
    copied: set[str] = set()
    for key in keys if len(out) < len(keys) else ():
        if key in out:
            continue
        m = metas[key]
        dtype = _ST_DTYPES.get(m.dtype)
        if dtype is None:
            raise _UseSafetensorsReader(m.dtype)
        chunk = buf[base + m.begin : base + m.end]
        if chunk.data_ptr() % dtype.itemsize:
            chunk = chunk.clone()  # not aligned for its dtype: an aligned copy
            copied.add(key)
        t = out[key] = chunk.view(dtype).view(m.shape)
        batches.append(([key], t.unsqueeze(0)))
    return _FileTensors(out, batches, _file_regions(out, metas, keys, copied))


def _constant_stride_runs(
    spans: Sequence[tuple[int, str]], nbytes: int
) -> list[tuple[list[str], int, int]]:
    """``spans`` (begin, key) of ``nbytes`` tensors, sorted, cut into runs at a constant stride: ``(keys,
    first begin, stride)``, the stride of a lone tensor being ``nbytes``."""
    begins = [b for b, _ in spans]
    step = begins[1] - begins[0] if len(begins) > 1 else nbytes
    if step >= nbytes and begins == list(range(begins[0], begins[0] + step * len(begins), step)):
        return [([k for _, k in spans], begins[0], step)]  # the usual case: all of them
    runs: list[tuple[list[str], int, int]] = []
    j = 0
    while j < len(spans):
        k, step = j + 1, 0
        while k < len(spans):
            d = begins[k] - begins[k - 1]
            if (step and d != step) or (not step and d < nbytes):
                break
            step, k = d, k + 1
        runs.append(([key for _, key in spans[j:k]], begins[j], step or nbytes))
        j = k
    return runs


def _file_regions(
    tensors: Mapping[str, torch.Tensor],
    metas: Mapping[str, _TensorMeta],
    keys: Sequence[str],
    copied: set[str],
) -> list[tuple[list[str], torch.Tensor]]:
    """The regions (:class:`_FileTensors`) of ``tensors``, views of one buffer at their ``metas`` offsets
    but for those ``copied``."""
    key_metas = [metas[k] for k in keys]
    order = sorted(range(len(keys)), key=list(map(_BEGIN, key_metas)).__getitem__)
    ordered = [keys[i] for i in order]
    spans = [key_metas[i] for i in order]
    begins = list(map(_BEGIN, spans))
    ends = list(map(_END, spans))
    if (
        spans
        and not copied
        and len({m.dtype for m in spans}) == 1
        and begins[1:] == ends[:-1]
        and all(e > b for b, e in zip(begins, ends, strict=True))
    ):  # the usual case: one dtype, back to back
        return [_region(tensors, metas, ordered)]
    regions: list[tuple[list[str], torch.Tensor]] = []
    run: list[str] = []
    for key, m in zip(ordered, spans, strict=True):
        if key in copied or m.end == m.begin:
            regions.append(([key], tensors[key].reshape(-1)))
            continue
        if run and m.begin == metas[run[-1]].end and m.dtype == metas[run[-1]].dtype:
            run.append(key)
            continue
        if run:
            regions.append(_region(tensors, metas, run))
        run = [key]
    if run:
        regions.append(_region(tensors, metas, run))
    return regions


def _region(
    tensors: Mapping[str, torch.Tensor], metas: Mapping[str, _TensorMeta], run: list[str]
) -> tuple[list[str], torch.Tensor]:
    """``run`` (keys of tensors lying back to back, in order) with a 1-D view of all their elements."""
    first = tensors[run[0]]
    n = (metas[run[-1]].end - metas[run[0]].begin) // first.element_size()
    return run, first.as_strided((n,), (1,), first.storage_offset())

