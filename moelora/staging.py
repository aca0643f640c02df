"""A pinned host buffer, allocated once, through which host tensors are copied into GPU buffers.

Allocating pinned memory (``cudaHostAlloc``) takes a lock in the CUDA driver that other threads' kernel
launches wait on: a pool that pinned each adapter it loads stalled serving while it did so. The pool owns
one :class:`PinnedStaging` instead, made when the pool is: a slot write copies each host stack through it
in chunks, the host copy into one chunk running while the chunk before it crosses the bus.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["DEFAULT_STAGING_BYTES", "PinnedStaging"]

DEFAULT_STAGING_BYTES = 64 << 20
_CHUNKS = 4


class PinnedStaging:
    """``nbytes`` of pinned host memory in four chunks, used by one copy at a time.

    :meth:`copy` sends a host tensor to a device tensor: it splits the source along its first dimension
    into pieces of at most one chunk, copies each into the next chunk on the host (after waiting for the
    chunk's previous transfer to end), and queues that chunk's transfer on ``stream``. The copies are
    ordered on ``stream`` like any other work queued there; :meth:`copy` returns once every piece is
    queued, and the sources may be freed then.
    """

    def __init__(self, nbytes: int, *, widest_row: int, what: str) -> None:
        """``widest_row``: bytes of one index of the first dimension of the largest source ``what``
        names; ValueError, before any allocation, where it would not fit a chunk."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < _CHUNKS:
            raise ValueError(f"staging_bytes must be an int of at least {_CHUNKS}, got {nbytes!r}")
        self.chunk_bytes = nbytes // _CHUNKS
        self.check_fits(widest_row, what)
        self.buffer = torch.empty(self.chunk_bytes * _CHUNKS, dtype=torch.uint8, pin_memory=True)
        self._done: list[torch.cuda.Event | None] = [None] * _CHUNKS
        self._next = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes of pinned host memory held."""
        return self.buffer.numel()

    def check_fits(self, row_bytes: int, what: str) -> None:
        """ValueError unless a piece of ``row_bytes`` (one index of a source's first dimension) fits a
        chunk; ``what`` names the tensor in the message."""
        if row_bytes > self.chunk_bytes:
            raise ValueError(
                f"staging_bytes gives {_CHUNKS} chunks of {self.chunk_bytes} bytes, but one expert of {what} "
                f"takes {row_bytes}: give staging_bytes of at least {row_bytes * _CHUNKS}")

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """``dst.copy_(src)`` for a host ``src`` and a device ``dst`` of its shape and dtype (``dst`` may
        be a strided view), queued on ``stream`` through the pinned chunks."""
        if tuple(dst.shape) != tuple(src.shape) or dst.dtype != src.dtype:
            raise ValueError(f"copy of {src.dtype} {tuple(src.shape)} into {dst.dtype} {tuple(dst.shape)}")
        if src.numel() == 0:
            return
        src = src.contiguous()
        row_bytes = src[0].numel() * src.element_size()
        self.check_fits(row_bytes, f"a {tuple(src.shape)} tensor")
        rows_per_chunk = self.chunk_bytes // row_bytes
        with self._lock, torch.cuda.stream(stream):
            for start in range(0, src.shape[0], rows_per_chunk):
                piece = src[start : start + rows_per_chunk]
                chunk = self._next
                self._next = (chunk + 1) % _CHUNKS
                if self._done[chunk] is not None:
                    self._done[chunk].synchronize()  # its last transfer has left the chunk
                offset = chunk * self.chunk_bytes
                pinned = self.buffer[offset : offset + piece.numel() * piece.element_size()]
                pinned = pinned.view(piece.dtype).view(piece.shape)
                pinned.copy_(piece)
                dst[start : start + piece.shape[0]].copy_(pinned, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
                self._done[chunk] = done
