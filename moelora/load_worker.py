"""A process that reads, validates and stages adapters for a pool's asynchronous loads.

Staging an adapter is thousands of small host operations, most of them Python. Run in a thread of the
serving process they hold its interpreter lock for milliseconds at a time, and a serving loop waiting for
the lock misses its step (docs/performance.md, hot-load). In a process of its own the work holds no lock
of the serving process.

The worker is a ``python`` process running ``load_worker.main`` with two pipes: it takes (stager,
name, path) requests, writes each staged adapter's stacks into one file in shared memory (``/dev/shm``
where there is one) and answers with the adapter's metadata and the file's layout; the serving process
maps the file (the stacks become views of it), removes its name, and only copies the stacks into the
slot. Being a plain subprocess, the worker runs none of the serving program's own code
(multiprocessing's spawn would import its main module).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import threading
import uuid
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from moelora.adapter_weights import AdapterLoadError

if TYPE_CHECKING:
    from moelora.stager import AdapterStager, StagedAdapter

__all__ = ["LoadWorker"]

_WORKER_NICENESS = 10
_WORKER_TORCH_THREADS = 4


def _shared_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _stage_to_file(stager: AdapterStager, name: str, path: str) -> tuple:
    """In the worker: the staged adapter without its stacks, the shared file holding them and the layout
    (layer, key, dtype, shape, byte offset) to view them."""
    staged = stager._read_and_stage(name, Path(path))
    layout, size = [], 0
    for lid, stacks in staged.layers.items():
        for key, t in stacks.items():
            layout.append((lid, key, t.dtype, tuple(t.shape), size))
            size += t.nbytes
    file = os.path.join(_shared_dir(), f"moelora-{os.getpid()}-{uuid.uuid4().hex}")
    with open(file, "wb") as f:
        f.truncate(max(size, 1))
    packed = torch.from_file(file, shared=True, size=max(size, 1), dtype=torch.uint8)
    for lid, key, _, _, start in layout:
        t = staged.layers[lid][key]
        packed[start : start + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
    staged.layers = {}
    return staged, file, size, layout


def _serve(requests: Connection, answers: Connection) -> None:
    """The worker's loop: one answer ("ok", ...) or ("error", exception) per request, until EOF."""
    while True:
        try:
            stager, name, path = requests.recv()
        except EOFError:
            return
        try:
            answers.send(("ok", *_stage_to_file(stager, name, path)))
        except Exception as exc:  # noqa: BLE001  (every failure goes back to the waiting load)
            try:
                pickle.dumps(exc)
            except Exception:  # noqa: BLE001
                exc = AdapterLoadError(f"adapter {name!r} from {path}: {type(exc).__name__}: {exc}")
            answers.send(("error", exc))


class LoadWorker:
    """One worker process staging adapters (``stage``), started at the first call; ``close`` stops it."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._requests: Connection | None = None
        self._answers: Connection | None = None
        self._lock = threading.Lock()

    def _start(self) -> None:
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        self._process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from moelora.load_worker import main; main(sys.argv[1:])",
             str(to_worker_r), str(from_worker_w)],
            pass_fds=(to_worker_r, from_worker_w), stdin=subprocess.DEVNULL,
            # The modules this process found (moelora among them), wherever its path came from.
            env=os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
        os.close(to_worker_r)
        os.close(from_worker_w)
        self._requests = Connection(to_worker_w, readable=False)
        self._answers = Connection(from_worker_r, writable=False)

    def start(self) -> None:
        """Starts the worker now if it is not running (its imports then overlap whatever the caller does
        next, instead of delaying the first ``stage``)."""
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._start()

    def stage(self, stager: AdapterStager, name: str, path: Path) -> StagedAdapter:
        """``stager._read_and_stage(name, path)`` in the worker; its AdapterLoadError is raised here. A
        worker that died (killed, out of memory) raises AdapterLoadError naming the adapter, and is
        started again at the next call."""
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._start()
            try:
                self._requests.send((stager, name, str(path)))
                answer = self._answers.recv()
            except (EOFError, OSError) as exc:
                self._stop()
                raise AdapterLoadError(f"adapter {name!r} from {path}: the loading process died ({exc!r})"
                                       ) from exc
        if answer[0] == "error":
            raise answer[1]
        _, staged, file, size, layout = answer
        try:
            packed = torch.from_file(file, shared=True, size=max(size, 1), dtype=torch.uint8)
        finally:
            os.unlink(file)  # the mapping stays while the stacks (views of it) live
        for lid, key, dtype, shape, start in layout:
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            staged.layers.setdefault(lid, {})[key] = packed[start : start + nbytes].view(dtype).view(shape)
        return staged

    def _stop(self) -> None:
        for conn in (self._requests, self._answers):
            if conn is not None:
                conn.close()
        if self._process is not None:
            self._process.wait()
        self._process = self._requests = self._answers = None

    def close(self) -> None:
        """Ends the worker (it exits at the end of its pipe)."""
        with self._lock:
            self._stop()


def main(fds: list[str]) -> None:
    """The worker process's entry: ``fds`` are its request pipe's read end and its answer pipe's write
    end. The worker yields the CPU to the serving process: a lower scheduling priority, and few threads
    for torch's own operations."""
    try:
        os.nice(_WORKER_NICENESS)
    except OSError:  # pragma: no cover - not permitted here: same priority
        pass
    torch.set_num_threads(_WORKER_TORCH_THREADS)
    _serve(Connection(int(fds[0]), writable=False), Connection(int(fds[1]), readable=False))
