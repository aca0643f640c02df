"""Timers of ``moelora bench`` and the benchmarks: CUDA-graph replays with L2 flushed between calls, timed
interleaved in rounds (so clock or thermal drift falls on every call alike), eager host timing, and a
progress line for long runs."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


def warm_up_on_side_stream(fn: Callable[[], Any]) -> None:
    """Two calls on a side stream (Triton compiles, lazy allocations) before a CUDA graph capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


L2_FLUSHES = ("read", "write")
_FLUSH_BYTES = 256 * 1024**2  # 5x the L2 of an H100/H200 (50 MB), as triton.testing.do_bench


def cold_l2_time_ms(fn: Callable[[], Any], warmup_ms: float, rep_ms: float, flush: str = "read") -> float:
    """Median time of ``fn`` (ms), every call after an L2 flush, on CUDA events: ``do_bench``'s loop
    (``cold_l2_times_ms`` of one function)."""
    return cold_l2_times_ms([fn], warmup_ms, rep_ms, flush)[0]


def cold_l2_times_ms(fns: Sequence[Callable[[], Any]], warmup_ms: float, rep_ms: float,
                     flush: str = "read") -> list[float]:
    """Median time of each of ``fns`` (ms), every call after an L2 flush, on CUDA events, the functions
    interleaved: round i calls each once (in reverse order on odd rounds), so all of them run under the
    same clocks. Each gets about as many samples as ``rep_ms`` of its own calls would give.

    Why interleaved: a compute-bound call (Mixtral-8x7B, M=4096) keeps the GPU at its power limit, and
    its clocks keep sinking as it heats. Timed one after the other, base then LoRA, the later call paid
    for the earlier one's heat, and the overhead read well above what a kernel trace of the same two
    graphs gave (docs/performance.md, 'Method').

    ``flush="read"`` (default) empties L2 by reading a 256 MB buffer, so the timed call finds its weights
    cold and L2 holding clean lines. ``"write"`` zeroes the buffer as ``triton.testing.do_bench`` does:
    that leaves ~50 MB of dirty lines, whose write-back to HBM then lands inside the timed call: time the
    flush left behind, not the kernels', about the same on a decode layer of any size (docs/performance.md,
    'Method'). A MoE layer in a model follows kernels that write activations, not 50 MB, so the read flush
    is the one the tables use; ``--l2-flush write`` brings the other back."""
    if flush not in L2_FLUSHES:
        raise ValueError(f"flush must be one of {L2_FLUSHES}, got {flush!r}")
    if not fns:
        raise ValueError("nothing to time: fns is empty")
    buffer = torch.empty(_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    sink = torch.empty((), dtype=torch.int32, device="cuda")

    def clear_l2() -> None:
        if flush == "read":
            torch.amax(buffer, dim=0, out=sink)
        else:
            buffer.zero_()

    if flush == "read":
        buffer.zero_()  # defined contents, then a sync: none of these writes is left for the timed calls
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        for fn in fns:
            clear_l2()
            fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = max(start.elapsed_time(end) / (5 * len(fns)), 1e-3)  # mean call, flush included
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        for fn in fns:
            fn()
    repeats = max(1, int(rep_ms / estimate_ms))
    starts = [[torch.cuda.Event(enable_timing=True) for _ in fns] for _ in range(repeats)]
    ends = [[torch.cuda.Event(enable_timing=True) for _ in fns] for _ in range(repeats)]
    for i in range(repeats):
        order = range(len(fns)) if i % 2 == 0 else reversed(range(len(fns)))
        for j in order:
            clear_l2()
            starts[i][j].record()
            fns[j]()
            ends[i][j].record()
    torch.cuda.synchronize()
    return [statistics.median(starts[i][j].elapsed_time(ends[i][j]) for i in range(repeats))
            for j in range(len(fns))]


def _capture(fn: Callable[[], Any]) -> torch.cuda.CUDAGraph | None:
    """``fn`` warmed up on a side stream and captured in a CUDA graph; None when the capture fails."""
    warm_up_on_side_stream(fn)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as err:  # a host sync in the call, say
        print(f"\n[warn] CUDA graph capture failed ({type(err).__name__}: {err}); timing eagerly",
              file=sys.stderr)
        torch.cuda.synchronize()
        return None
    return graph


def graph_time_us(fn: Callable[[], Any], warmup_ms: float, rep_ms: float,
                  flush: str = "read") -> tuple[float, bool]:
    """Warm up on a side stream, capture one call in a CUDA graph, median of its replays after an L2
    flush each (``cold_l2_time_ms``).

    Falls back to timing eager calls when the capture fails; returns (µs, whether a graph was used)."""
    return graph_times_us([fn], warmup_ms, rep_ms, flush)[0]


def graph_times_us(fns: Sequence[Callable[[], Any]], warmup_ms: float, rep_ms: float,
                   flush: str = "read") -> list[tuple[float, bool]]:
    """``graph_time_us`` of several calls timed interleaved (``cold_l2_times_ms``): (µs, graph used) each."""
    rounds, used = graph_rounds_us(fns, warmup_ms, rep_ms, flush, rounds=1)
    return [(us[0], ok) for us, ok in zip(rounds, used, strict=True)]


def graph_rounds_us(fns: Sequence[Callable[[], Any]], warmup_ms: float, rep_ms: float, flush: str = "read",
                    rounds: int = 1) -> tuple[list[list[float]], list[bool]]:
    """Each call captured once, then timed interleaved (``cold_l2_times_ms``) in ``rounds`` rounds, one
    after the other: (per call, its µs in each round), (per call, whether a graph was used)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    graphs = [_capture(fn) for fn in fns]
    replays = [fn if graph is None else graph.replay for fn, graph in zip(fns, graphs, strict=True)]
    per_round = [cold_l2_times_ms(replays, warmup_ms, rep_ms, flush) for _ in range(rounds)]
    used = [graph is not None for graph in graphs]
    del graphs, replays
    return [[times[j] * 1e3 for times in per_round] for j in range(len(fns))], used


def median_round(base_us: Sequence[float], lora_us: Sequence[float]) -> tuple[float, float, list[float]]:
    """The round whose overhead ``lora / base - 1`` is the median (the lower one of an even count), as
    (base µs, LoRA µs) of that round, and every round's overhead in order. A round's two times ran
    interleaved, so they are kept together: the row's base is the one its LoRA time ran beside."""
    if not base_us or len(base_us) != len(lora_us):
        raise ValueError(f"need one base and one LoRA time per round, got {len(base_us)} and {len(lora_us)}")
    overheads = [lora / base - 1 for base, lora in zip(base_us, lora_us, strict=True)]
    middle = sorted(range(len(overheads)), key=overheads.__getitem__)[(len(overheads) - 1) // 2]
    return base_us[middle], lora_us[middle], overheads


def eager_time_us(fn: Callable[[], Any], on_gpu: bool, warmup_ms: float, rep_ms: float,
                  cpu_reps: int, flush: str = "read") -> float:
    if on_gpu:
        return cold_l2_time_ms(fn, warmup_ms, rep_ms, flush) * 1e3
    times = []  # Triton interpreter: nothing to compile or warm up, and the numbers mean nothing anyway
    for _ in range(cpu_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


class Progress:
    """A one-line progress bar on stderr (a line per step when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool = True, stream: Any = None) -> None:
        self.total, self.done, self.enabled = max(total, 1), 0, enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        frac = self.done / self.total
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / frac - elapsed
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        line = (f"[{bar}] {self.done:>{len(str(self.total))}}/{self.total} "
                f"{elapsed:6.1f}s elapsed, ~{eta:5.0f}s left  {label}")
        if self.tty:
            self.stream.write("\r" + line[:160].ljust(160))
            if self.done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
