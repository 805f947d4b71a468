"""Pause Python's cyclic garbage collector while a bulk step builds many small objects.

Opening a bundle makes a pydantic Record per line and judging makes a Metrics and an OpResult per
pair: tens of thousands of container objects that live until the step ends. The cyclic collector
runs every 700 allocations and, as they pile up, re-walks them all in its older generations; on a
10^4-record comparison that was ~45% of the CPU time (measured: 1.4-1.7 s with it, 0.88 s without).
These steps make no reference cycles (a comparison of 10^4 records leaves 0 unreachable objects
for ``gc.collect()``), so reference counting frees everything they drop, and memory stays as flat
as before.

The pause is process-wide (``gc.disable``) and nests: it ends when the outermost paused step in
any thread ends, and only re-enables a collector that was enabled when the first one began.
"""

from __future__ import annotations

import gc
import threading
from contextlib import ContextDecorator
from typing import Any

_lock = threading.Lock()
_depth = 0
_restore = False


class paused_gc(ContextDecorator):  # noqa: N801 - reads as a function: ``with paused_gc():`` / ``@paused_gc()``
    """Context manager (and decorator) that keeps the cyclic collector off while the block runs."""

    def __enter__(self) -> paused_gc:
        global _depth, _restore
        with _lock:
            if _depth == 0:
                _restore = gc.isenabled()
                gc.disable()
            _depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        global _depth
        with _lock:
            _depth -= 1
            if _depth == 0 and _restore:
                gc.enable()
