"""Kernel launches with less host work per call than ``kernel[grid](**kwargs)``, for an owner that repeats
the same calls (a layer called once per step).

``launch(kernel, grid, **kwargs)`` is what every wrapper in ``triton_ops`` calls. Outside a
:class:`LaunchCache` (``with cache:``) it is ``kernel[grid](**kwargs)``. Inside one it binds the arguments
with the kernel's own binder, so the specialization (dtypes, pointer alignment, integers divisible by 16)
is exactly Triton's, looks the compiled binary up in the cache's table by that specialization and calls the
binary's launcher. Of ``JITFunction.run`` it skips what does not depend on the call: the string form of the
cache key, the knob lookups and the check that the kernel's module constants did not change (here they are
``tl.constexpr`` constants). A miss (a specialization's first call) goes through ``kernel[grid]``, which
compiles or finds the binary, and records it. The Triton interpreter's kernels (no ``device_caches``)
always take ``kernel[grid]``, one at a time in the process: the interpreter swaps ``triton.language``'s
functions for its own for the length of a call and back after it, so a call on another thread (a second
engine's step, a loader) would end inside the first one's and leave it with the compiled-only functions.
The internals used (``device_caches[device]`` ending in the binder, the binary's ``run`` and
``launch_metadata``) are those of Triton 3.6-3.9; the GPU tests run through them.

The cache also holds launch plans (``plans``): decisions that depend only on host-known sizes, computed
once per key by their owner (``fused_experts``' ``ChunkPlan``).

And it holds launch traces (``traces``, :class:`LaunchTrace`): every launch of one call, recorded with
``recording(inputs)`` and replayed with new input tensors of the same shapes. A replay skips all of the
call's Python except the launches themselves: each recorded binary is launched with its recorded
arguments, the pointers of the call's inputs and of fresh intermediate buffers put in. That is exact only
for a call whose device work is nothing but ``launch()`` calls and ``torch.empty`` buffers, whose launch
arguments depend on nothing but the shapes in the owner's key, and whose inputs keep the recorded pointer
alignment (Triton specializes pointers on 16-byte alignment): the owner checks those (the layer: only the
fused MoE, contiguous 16-byte-aligned inputs).
"""

from __future__ import annotations

import contextvars
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import triton

from triton_ops import native_launch

_ACTIVE: contextvars.ContextVar[LaunchCache | None] = contextvars.ContextVar("moelora_launch_cache",
                                                                             default=None)


class LaunchCache:
    """Compiled binaries by (kernel, specialization) and launch plans by key, for one owner (a layer).

    Use as a context manager around the calls it should serve (re-entrant; nested caches: the innermost
    serves). Not shared between threads that launch at once: one per layer, used from the thread that
    runs it."""

    def __init__(self, max_traces: int = 256) -> None:
        self.plans: dict[Hashable, Any] = {}
        self.traces: OrderedDict[Hashable, LaunchTrace] = OrderedDict()
        self.max_traces = max_traces
        self._binaries: dict[tuple, Any] = {}
        self._tokens: list[contextvars.Token] = []
        self._recorder: _Recorder | None = None

    def __enter__(self) -> LaunchCache:
        self._tokens.append(_ACTIVE.set(self))
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.reset(self._tokens.pop())

    def plan(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The plan stored under ``key``, made by ``make()`` the first time."""
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = make()
        return plan

    def clear(self) -> None:
        self.plans.clear()
        self.traces.clear()
        self._binaries.clear()

    @contextmanager
    def recording(self, inputs: Sequence[torch.Tensor]) -> Iterator[_Recorder]:
        """Records the launches made inside (through this cache) for a :class:`LaunchTrace`; ``inputs`` are
        the tensors a replay passes anew, in this order. After the block, ``recorder.trace(output)`` builds
        the trace (None where the call cannot be replayed)."""
        if self._recorder is not None:
            raise RuntimeError("a LaunchCache records one call at a time")
        recorder = self._recorder = _Recorder(inputs)
        try:
            yield recorder
        finally:
            self._recorder = None

    def keep_trace(self, key: Hashable, trace: LaunchTrace | None) -> None:
        """Stores ``trace`` under ``key`` (None: nothing), dropping the least recently stored past
        ``max_traces``."""
        if trace is None:
            return
        self.traces[key] = trace
        while len(self.traces) > self.max_traces:
            self.traces.popitem(last=False)

    def launch(self, kernel: Any, grid: tuple[int, ...], kwargs: dict[str, Any]) -> None:
        recorder = self._recorder
        if not hasattr(kernel, "device_caches"):  # the interpreter's kernels, or a Triton without them
            if recorder is not None:
                recorder.add(kernel, grid, list(kwargs.values()), names=list(kwargs))
            _interpreted(kernel, grid, kwargs)
            return
        driver = triton.runtime.driver.active
        device = driver.get_current_device()
        binder = kernel.device_caches[device][-1]
        bound, specialization, options = binder(**kwargs)
        key = (kernel, device, tuple(specialization), tuple(options.items()))
        binary = self._binaries.get(key)
        if binary is None:
            binary = self._binaries[key] = kernel[grid](**kwargs)
            if recorder is not None:
                recorder.add(binary, grid, list(bound.values()))
            return
        stream = driver.get_current_stream(device)
        args = bound.values()
        if recorder is not None:
            recorder.add(binary, grid, list(args))
        knobs = triton.knobs.runtime
        binary.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                   binary.function, binary.packed_metadata, binary.launch_metadata(grid, stream, *args),
                   knobs.launch_enter_hook, knobs.launch_exit_hook, *args)


def launch(kernel: Any, grid: tuple[int, ...], **kwargs: Any) -> None:
    """``kernel[grid](**kwargs)``, through the active :class:`LaunchCache` if there is one."""
    cache = _ACTIVE.get()
    if cache is None:
        if hasattr(kernel, "device_caches"):
            kernel[grid](**kwargs)
        else:
            _interpreted(kernel, grid, kwargs)
    else:
        cache.launch(kernel, grid, kwargs)


def not_replayable() -> None:
    """Marks the call being recorded (``LaunchCache.recording``), if any, as one a trace cannot replay: it
    does device work besides ``launch()`` calls and ``torch.empty`` buffers (a torch operation), which a
    replay would skip. Called by that work itself."""
    cache = _ACTIVE.get()
    if cache is not None and cache._recorder is not None:
        cache._recorder.replayable = False


def active_cache() -> LaunchCache | None:
    """The :class:`LaunchCache` serving this context, if any."""
    return _ACTIVE.get()


def planned(key: Hashable, make: Callable[[], Any]) -> Any:
    """``make()``, made once per ``key`` in the active :class:`LaunchCache` (else every call): for launch
    decisions that read only host-known values (device properties, environment switches)."""
    cache = _ACTIVE.get()
    return make() if cache is None else cache.plan(key, make)


# Serializes the interpreter's kernel calls (module docstring); re-entrant for a call made inside another.
_INTERPRETER_LOCK = threading.RLock()


def _interpreted(kernel: Any, grid: tuple[int, ...], kwargs: dict[str, Any]) -> None:
    """``kernel[grid](**kwargs)`` for an interpreter kernel, holding the process's interpreter lock."""
    with _INTERPRETER_LOCK:
        kernel[grid](**kwargs)


@dataclass(frozen=True)
class _TracedLaunch:
    """One launch of a trace: the binary (the JIT function in the interpreter), its grid, its arguments with
    each tensor's slot left empty, and where the tensors' pointers come from."""

    binary: Any
    grid: tuple[int, int, int]
    args: list[Any]
    # (argument position, source, byte offset from the source's pointer); sources: the inputs in order,
    # then the intermediate buffers, then the output. A position inside a tuple argument (an operand's
    # bundle) is the path of indices, e.g. (3, 0): the first item of argument 3.
    pointers: tuple[tuple[int, int, int], ...]
    # Interpreter only: keyword names, and per tensor argument its (size, stride, dtype).
    names: list[str] | None = None
    views: tuple[tuple[torch.Size, tuple[int, ...], torch.dtype], ...] = ()


# Intermediate buffers of a replay share one allocation; each starts at a multiple of this (the caching
# allocator's own alignment, so each keeps the alignment it had when recorded).
_BUFFER_ALIGN = 512


class LaunchTrace:
    """Every launch of one recorded call, replayable with new inputs of the recorded shapes (module
    docstring). ``replay(inputs)`` allocates the output (and one buffer for the intermediates), queues the
    launches on the current stream and returns the output."""

    def __init__(self, launches: list[_TracedLaunch], buffer_offsets: list[int], buffer_bytes: int,
                 output_shape: torch.Size, output_dtype: torch.dtype, num_inputs: int,
                 device: torch.device) -> None:
        self.launches = launches
        self.buffer_offsets = buffer_offsets
        self.buffer_bytes = buffer_bytes
        self.output_shape = output_shape
        self.output_dtype = output_dtype
        self.num_inputs = num_inputs
        self.device = device
        self.interpreted = bool(launches) and launches[0].names is not None
        # The native launcher's plan (``triton_ops.native_launch``), where it can launch every binary.
        self.native, self.native_plan = None, None
        if not self.interpreted and native_launch.enabled():
            self.native = native_launch.load()
            if self.native is not None:
                self.native_plan = native_launch.build_plan(
                    [(traced.binary, traced.grid, traced.args, self._native_sources(traced))
                     for traced in launches])

    def _native_sources(self, traced: _TracedLaunch) -> list[tuple[int, int, int]]:
        """``traced.pointers`` against the native replay's bases: the inputs, the intermediate buffer's
        start (each buffer's offset folded into the pointer's), the output."""
        num_inputs, num_buffers = self.num_inputs, len(self.buffer_offsets)
        resolved = []
        for position, source, offset in traced.pointers:
            if num_inputs <= source < num_inputs + num_buffers:
                source, offset = num_inputs, self.buffer_offsets[source - num_inputs] + offset
            elif source == num_inputs + num_buffers:
                source = num_inputs + 1
            resolved.append((position, source, offset))
        return resolved

    def replay(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(inputs) != self.num_inputs:
            raise ValueError(f"the trace was recorded with {self.num_inputs} inputs, got {len(inputs)}")
        output = torch.empty(self.output_shape, dtype=self.output_dtype, device=self.device)
        buffer = None
        if self.buffer_bytes:
            buffer = torch.empty((self.buffer_bytes,), dtype=torch.uint8, device=self.device)
        if self.interpreted:
            self._replay_interpreted(inputs, buffer, output)
            return output
        driver = triton.runtime.driver.active
        stream = driver.get_current_stream(driver.get_current_device())
        if self.native_plan is not None:
            self.native.replay(self.native_plan, (*[tensor.data_ptr() for tensor in inputs],
                                                  0 if buffer is None else buffer.data_ptr(),
                                                  output.data_ptr()), stream)
            return output
        bases = [tensor.data_ptr() for tensor in inputs]
        if buffer is not None:
            start = buffer.data_ptr()
            bases.extend(start + offset for offset in self.buffer_offsets)
        bases.append(output.data_ptr())
        for traced in self.launches:
            args = traced.args.copy()
            for position, source, offset in traced.pointers:
                set_argument(args, position, bases[source] + offset)
            binary = traced.binary
            binary.run(*traced.grid, stream, binary.function, binary.packed_metadata, None, None, None, *args)
        return output

    def _replay_interpreted(self, inputs: Sequence[torch.Tensor], buffer: torch.Tensor | None,
                            output: torch.Tensor) -> None:
        """The interpreter's kernels take tensors: each pointer becomes a view of its source again."""
        sources = [*inputs, *([buffer] * len(self.buffer_offsets)), output]
        source_offsets = [0] * len(inputs) + list(self.buffer_offsets) + [0]
        for traced in self.launches:
            args = traced.args.copy()
            for (position, source, offset), (size, stride, dtype) in zip(traced.pointers, traced.views,
                                                                         strict=True):
                base = sources[source]
                storage = torch.empty((0,), dtype=torch.uint8, device=base.device)
                storage.set_(base.untyped_storage())
                start = base.data_ptr() - storage.data_ptr() + source_offsets[source] + offset
                set_argument(args, position,
                             torch.as_strided(storage.view(dtype), size, stride, start // dtype.itemsize))
            _interpreted(traced.binary, traced.grid, dict(zip(traced.names, args, strict=True)))


class _Recorder:
    """Collects the launches of one call (``LaunchCache.recording``) and turns them into a trace."""

    def __init__(self, inputs: Sequence[torch.Tensor]) -> None:
        self.inputs = list(inputs)
        self.extents = [(t.data_ptr(), t.data_ptr() + _extent_bytes(t)) for t in self.inputs]
        # Intermediate buffers: storage pointer -> the most bytes seen at it (dicts keep first-seen order).
        self.storages: dict[int, int] = {}
        self.launches: list[tuple[Any, tuple[int, int, int], list[Any], list[tuple[int, Any, int]],
                                  list[str] | None, list[tuple]]] = []
        self.replayable = True

    def add(self, binary: Any, grid: tuple[int, ...], args: list[Any],
            names: list[str] | None = None) -> None:
        """One launch: ``args`` (a list it may change) in the kernel's order; ``names``: the keyword
        names, for the interpreter's kernels (None: ``args`` are a binary's bound arguments)."""
        pointers, views = [], []
        for position, value in _tensor_leaves(args):
            pointer = value.data_ptr()
            owners = [i for i, (lo, hi) in enumerate(self.extents) if lo <= pointer < hi]
            if len(owners) > 1:
                self.replayable = False  # inputs that overlap: a replay could not tell them apart
            if owners:
                source, offset = owners[0], pointer - self.inputs[owners[0]].data_ptr()
            else:
                storage = value.untyped_storage()
                source = ("buffer", storage.data_ptr())
                offset = pointer - storage.data_ptr()
                self.storages[storage.data_ptr()] = max(self.storages.get(storage.data_ptr(), 0),
                                                        storage.nbytes())
            pointers.append((position, source, offset))
            views.append((value.shape, value.stride(), value.dtype))
            set_argument(args, position, None if names is not None else 0)
        full_grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self.launches.append((binary, full_grid, args, pointers, names, views))

    def trace(self, output: torch.Tensor) -> LaunchTrace | None:
        """The recorded call as a trace returning ``output``'s like, or None: overlapping inputs, an output
        that is not a fresh contiguous tensor of its own, or no launch."""
        if not self.replayable or not self.launches:
            return None
        output_storage = output.untyped_storage().data_ptr()
        if (output_storage not in self.storages or not output.is_contiguous() or output.storage_offset() != 0
                or output.untyped_storage().nbytes() != output.numel() * output.element_size()):
            return None
        buffers = [ptr for ptr in self.storages if ptr != output_storage]
        index = {ptr: len(self.inputs) + i for i, ptr in enumerate(buffers)}
        index[output_storage] = len(self.inputs) + len(buffers)
        offsets, total = [], 0
        for ptr in buffers:
            offsets.append(total)
            total += -(-self.storages[ptr] // _BUFFER_ALIGN) * _BUFFER_ALIGN
        launches = []
        for binary, grid, args, pointers, names, views in self.launches:
            resolved = tuple((position, index[source[1]] if isinstance(source, tuple) else source, offset)
                             for position, source, offset in pointers)
            launches.append(_TracedLaunch(binary, grid, args, resolved, names,
                                          tuple(views) if names is not None else ()))
        return LaunchTrace(launches, offsets, total, output.shape, output.dtype, len(self.inputs),
                           output.device)


def launch_hooks_idle() -> bool:
    """Whether no Triton launch hook is set (a profiler's): a trace's replay passes them nothing. Triton
    3.9 keeps the hooks as chains, empty when unused; earlier versions keep None."""
    runtime = triton.knobs.runtime
    return all(hook is None or not getattr(hook, "calls", True)
               for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook))


def _extent_bytes(tensor: torch.Tensor) -> int:
    """Bytes from the tensor's first element to just past its last one."""
    if tensor.numel() == 0:
        return 0
    span = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return (span + 1) * tensor.element_size()


Position = int | tuple[int, ...]


def _tensor_leaves(args: Sequence[Any],
                   path: tuple[int, ...] = ()) -> Iterator[tuple[Position, torch.Tensor]]:
    """Every tensor of ``args``, inside tuple arguments too, with its position (an index at the top level,
    a path of indices inside tuples)."""
    for index, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            yield (index if not path else (*path, index)), value
        elif isinstance(value, tuple):
            yield from _tensor_leaves(value, (*path, index))


def set_argument(args: list[Any], position: Position, value: Any) -> None:
    """``args[position] = value``, where a path position rebuilds the tuples along it."""
    if isinstance(position, int):
        args[position] = value
        return
    head, *rest = position

    def rebuilt(item: tuple, path: list[int]) -> tuple:
        index, *deeper = path
        items = list(item)
        items[index] = rebuilt(items[index], deeper) if deeper else value
        return tuple(items)

    args[head] = rebuilt(args[head], rest)
