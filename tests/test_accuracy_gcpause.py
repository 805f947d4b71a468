"""The cyclic-GC pause of bulk steps: nests, restores what it found, and the steps it covers make no cycles."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from accuracy.compare import compare
from accuracy.gcpause import paused_gc


@pytest.fixture
def collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_pause_nests_and_restores(collector_on: None) -> None:
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner end does not end the outer pause
    assert gc.isenabled()

    @paused_gc()
    def step() -> bool:
        return gc.isenabled()

    assert step() is False and gc.isenabled()


def test_pause_leaves_a_disabled_collector_disabled(collector_on: None) -> None:
    gc.disable()
    with paused_gc():
        pass
    assert not gc.isenabled()
    gc.enable()


def test_pause_ends_with_the_last_thread_and_after_an_error(collector_on: None) -> None:
    inside, release = threading.Event(), threading.Event()

    def worker() -> None:
        with paused_gc():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=worker)
    t.start()
    inside.wait(10)
    with pytest.raises(RuntimeError):
        with paused_gc():
            raise RuntimeError("boom")
    assert not gc.isenabled()  # the other thread's pause still holds
    release.set()
    t.join(10)
    assert gc.isenabled()


def test_a_comparison_makes_no_reference_cycles(demo_bundles: dict[str, Path], collector_on: None) -> None:
    """What the pause relies on: a comparison's garbage is freed by reference counting alone."""
    compare(demo_bundles["ref"], demo_bundles["bf16"])  # first use: imports, compiled kernels, caches
    gc.collect()
    gc.disable()
    try:
        report = compare(demo_bundles["ref"], demo_bundles["bf16"])
        assert report.ops
        del report
        assert gc.collect() == 0
    finally:
        gc.enable()
