"""Positioned file writes on a background thread, so that a capture's tensor bytes reach the disk while
the model keeps running on the caller's thread.

The caller hands over byte views with the file offset each belongs at (:meth:`WriteBehind.put`);
the thread takes whatever has queued up and writes it with one ``os.pwritev`` per batch (the GIL is
released for the whole batch, so a Python-bound caller is interrupted once per batch, not once per
tensor). Queued bytes are bounded: ``put`` waits while the new piece would take the unwritten bytes
past ``limit`` (a piece larger than ``limit`` waits for an empty queue; the time callers spent
waiting is :attr:`WriteBehind.waited_s`). The views must stay unchanged until written: the caller
keeps them alive (a view holds its owner) and calls :meth:`drain` before anything may write into
them. Pieces whose bytes are still arriving (a device-to-host copy) come with a ``ready`` callable
that the thread calls before it writes them (a CUDA event's ``synchronize``): the caller never waits
for the copy. A write error (or one raised by ``ready``) stops the thread; the next ``put``, ``drain``
or ``close`` raises it.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable

from accuracy.errors import BundleError

class WriteFailed(BundleError):
    """The writer thread could not write (disk full, I/O error): every later put, drain and close says so."""


#: what the thread writes in one call at most (Linux's IOV_MAX is 1024)
MAX_BATCH = 512

#: the thread wakes when this many bytes have queued up (or on drain): each wake-up costs the caller
#: a GIL hand-over, which one per small tensor made cost as much as the writes it took away
WAKE_BYTES = 4 << 20

#: whether this platform has positioned vector writes (Linux and most Unixes; not Windows)
AVAILABLE = hasattr(os, "pwritev")


class WriteBehind:
    """Write ``(offset, bytes)`` pieces to ``fd`` on a background thread, in batches."""

    def __init__(self, fd: int, limit: int) -> None:
        if not AVAILABLE:
            raise BundleError("background writes need os.pwritev, which this platform lacks")
        self._fd = fd
        self._limit = max(limit, 1)
        self._queue: deque[tuple[int, memoryview, Callable[[], object] | None]] = deque()
        self.waited_s = 0.0  # time put_many spent waiting for room
        self._queued = 0  # bytes put and not yet written (queued or in the batch being written)
        self._busy = False  # a batch is being written
        self._flushing = 0  # drain() calls waiting: write whatever is queued, however little
        self._wake = min(WAKE_BYTES, self._limit)
        self._closing = False
        self._error: BaseException | None = None
        self._cond = threading.Condition(threading.Lock())
        self._thread = threading.Thread(target=self._run, name="opband-bundle-writer", daemon=True)
        self._thread.start()

    def put(self, offset: int, data: memoryview) -> None:
        """Queue ``data`` (a flat byte view its owner keeps alive) to be written at ``offset``."""
        if data.format != "B" or data.ndim != 1:
            data = data.cast("B")  # flat bytes: short writes are continued by byte offsets
        self.put_many([(offset, data)])

    def put_many(self, pieces: list[tuple[int, memoryview]], ready: Callable[[], object] | None = None) -> None:
        """Queue flat byte views (``format "B"``, one dimension) at their offsets, in order, under one
        lock: a piece that would take the unwritten bytes past the limit waits for the thread. ``ready``,
        when given, returns once the pieces' bytes are final; the thread calls it before writing them."""
        with self._cond:
            for offset, data in pieces:
                n = data.nbytes
                if not n:
                    continue
                if self._queued and self._queued + n > self._limit:
                    began = time.perf_counter()
                    self._wait_written(lambda n=n: bool(self._queued) and self._queued + n > self._limit)
                    self.waited_s += time.perf_counter() - began
                self._raise_error()
                self._queue.append((offset, data, ready))
                self._queued += n
                if self._queued >= self._wake and not self._busy:
                    self._cond.notify_all()

    @property
    def unwritten(self) -> int:
        """Bytes put and not yet written."""
        return self._queued

    def drain(self) -> None:
        """Return once every piece put so far is written (raises the thread's write error, if any)."""
        with self._cond:
            self._wait_written(lambda: bool(self._queue) or self._busy)
            self._raise_error()

    def _wait_written(self, pending: Callable[[], bool]) -> None:
        """With the lock held: have the thread write what is queued, however little, until ``pending()``
        is false or a write failed."""
        self._flushing += 1
        self._cond.notify_all()
        try:
            while pending() and self._error is None:
                self._cond.wait()
        finally:
            self._flushing -= 1

    def close(self) -> None:
        """Drain, then stop the thread (raises a write error, after stopping)."""
        try:
            self.drain()
        finally:
            self.stop()

    def stop(self) -> None:
        """Stop the thread, dropping what is still queued (for an aborted bundle)."""
        with self._cond:
            self._closing = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join()

    def _raise_error(self) -> None:
        if self._error is not None:
            e = self._error
            raise WriteFailed(f"writing the bundle failed: {e}") from e

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closing and not (self._queue and (self._queued >= self._wake or self._flushing)):
                    self._cond.wait()
                if self._closing:
                    return
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), MAX_BATCH))]
                self._busy = True
            written = 0
            try:
                _await_ready(batch)
                written = _write_batch(self._fd, [(offset, data) for offset, data, _ in batch])
                del batch  # the views' owners are free once written, not when the next batch comes
            except BaseException as e:  # noqa: BLE001 - handed to the caller by put/drain/close
                del batch
                with self._cond:
                    self._error = e.with_traceback(None)  # its frames would hold the batch's buffers
                    self._busy = False
                    self._queue.clear()
                    self._queued = 0  # nothing more will be written: no one waits on these bytes
                    self._cond.notify_all()
                return
            with self._cond:
                self._queued -= written
                self._busy = False
                self._cond.notify_all()


def _await_ready(batch: list[tuple[int, memoryview, Callable[[], object] | None]]) -> None:
    """Call each distinct ``ready`` of the batch once, in order: the bytes behind them have arrived."""
    called: set[int] = set()
    for piece in batch:
        ready = piece[2]
        if ready is not None and id(ready) not in called:
            called.add(id(ready))
            ready()


def _write_batch(fd: int, batch: list[tuple[int, memoryview]]) -> int:
    """Write the pieces, merging runs of adjacent ones into one ``pwritev`` each; bytes written."""
    total = 0
    i = 0
    while i < len(batch):
        start = batch[i][0]
        views = [batch[i][1]]
        end = start + batch[i][1].nbytes
        i += 1
        while i < len(batch) and batch[i][0] == end:
            views.append(batch[i][1])
            end += batch[i][1].nbytes
            i += 1
        total += _pwritev_all(fd, views, start)
    return total


def _pwritev_all(fd: int, views: list[memoryview], offset: int) -> int:
    """``os.pwritev`` until every byte of ``views`` is written at ``offset`` (it may write fewer)."""
    size = sum(v.nbytes for v in views)
    done = 0
    while done < size:
        n = os.pwritev(fd, views, offset + done)
        if n <= 0:
            raise OSError(f"pwritev wrote {n} bytes")
        done += n
        if done < size:  # drop what was written from the front of the views
            rest: list[memoryview] = []
            skip = n
            for v in views:
                if skip >= v.nbytes:
                    skip -= v.nbytes
                    continue
                rest.append(v[skip:])
                skip = 0
            views = rest
    return size
