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
always take ``kernel[grid]``. The internals used (``device_caches[device]`` ending in the binder, the
binary's ``run`` and ``launch_metadata``) are those of Triton 3.6-3.9; the GPU tests run through them.

The cache also holds launch plans (``plans``): decisions that depend only on host-known sizes, computed
once per key by their owner (``fused_experts``' ``ChunkPlan``).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Hashable
from typing import Any

import triton

_ACTIVE: contextvars.ContextVar[LaunchCache | None] = contextvars.ContextVar("moelora_launch_cache",
                                                                             default=None)


class LaunchCache:
    """Compiled binaries by (kernel, specialization) and launch plans by key, for one owner (a layer).

    Use as a context manager around the calls it should serve (re-entrant; nested caches: the innermost
    serves). Not shared between threads that launch at once: one per layer, used from the thread that
    runs it."""

    def __init__(self) -> None:
        self.plans: dict[Hashable, Any] = {}
        self._binaries: dict[tuple, Any] = {}
        self._tokens: list[contextvars.Token] = []

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
        self._binaries.clear()

    def launch(self, kernel: Any, grid: tuple[int, ...], kwargs: dict[str, Any]) -> None:
        if not hasattr(kernel, "device_caches"):  # the interpreter's kernels, or a Triton without them
            kernel[grid](**kwargs)
            return
        driver = triton.runtime.driver.active
        device = driver.get_current_device()
        binder = kernel.device_caches[device][-1]
        bound, specialization, options = binder(**kwargs)
        key = (kernel, device, tuple(specialization), tuple(options.items()))
        binary = self._binaries.get(key)
        if binary is None:
            self._binaries[key] = kernel[grid](**kwargs)
            return
        stream = driver.get_current_stream(device)
        args = bound.values()
        knobs = triton.knobs.runtime
        binary.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                   binary.function, binary.packed_metadata, binary.launch_metadata(grid, stream, *args),
                   knobs.launch_enter_hook, knobs.launch_exit_hook, *args)


def launch(kernel: Any, grid: tuple[int, ...], **kwargs: Any) -> None:
    """``kernel[grid](**kwargs)``, through the active :class:`LaunchCache` if there is one."""
    cache = _ACTIVE.get()
    if cache is None:
        kernel[grid](**kwargs)
    else:
        cache.launch(kernel, grid, kwargs)


def active_cache() -> LaunchCache | None:
    """The :class:`LaunchCache` serving this context, if any."""
    return _ACTIVE.get()


def planned(key: Hashable, make: Callable[[], Any]) -> Any:
    """``make()``, made once per ``key`` in the active :class:`LaunchCache` (else every call): for launch
    decisions that read only host-known values (device properties, environment switches)."""
    cache = _ACTIVE.get()
    return make() if cache is None else cache.plan(key, make)
