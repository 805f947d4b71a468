"""Tensor bytes written by a background thread (``accuracy.writebehind``; issue 14): the same file as
written in place, bounded memory, errors that surface, and a full ``aten`` capture whose outputs are
written in place by the model right after they are recorded."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from accuracy import writebehind
from accuracy.bundle import RESERVED_PREFIX, Bundle, BundleWriter
from accuracy.errors import BundleError
from accuracy.manifest import Manifest, Record
from hooks import capture

pytestmark = pytest.mark.skipif(not writebehind.AVAILABLE, reason="os.pwritev is not available on this platform")


def _writer_threads() -> int:
    return sum(t.name == "opband-bundle-writer" for t in threading.enumerate())


def test_pieces_land_at_their_offsets_in_any_batching(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    sizes = [1, 7, 4096, 3 << 20, 5, 9 << 20, 12345, 1 << 20]  # small, large, past the wake-up and the limit
    pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    path = tmp_path / "f"
    with open(path, "w+b") as f:
        w = writebehind.WriteBehind(f.fileno(), limit=4 << 20)  # a piece over the limit must not deadlock
        offset = 100
        for p in pieces:
            w.put(offset, memoryview(p))
            offset += p.nbytes
        w.put(0, memoryview(b"H" * 100))  # out of order: an earlier offset, written in its own call
        w.close()
    data = path.read_bytes()
    assert data[:100] == b"H" * 100
    assert data[100:] == b"".join(p.tobytes() for p in pieces)
    assert _writer_threads() == 0


def test_short_writes_are_continued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwritev

    def at_most_1000(fd: int, views: list[memoryview], offset: int) -> int:
        first = bytes(views[0][:1000])
        return real(fd, [first], offset)

    monkeypatch.setattr(os, "pwritev", at_most_1000)
    pieces = [bytes([i]) * (2500 + i) for i in range(5)]
    path = tmp_path / "f"
    with open(path, "w+b") as f:
        w = writebehind.WriteBehind(f.fileno(), limit=1 << 20)
        offset = 0
        for p in pieces:
            w.put(offset, memoryview(p))
            offset += len(p)
        w.close()
    assert path.read_bytes() == b"".join(pieces)


def test_a_failed_write_is_raised_by_drain_and_close(tmp_path: Path) -> None:
    path = tmp_path / "ro"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)  # writes fail with EBADF
    try:
        w = writebehind.WriteBehind(fd, limit=1 << 20)
        w.put(0, memoryview(b"x" * 10))
        with pytest.raises(BundleError, match="writing the bundle failed"):
            w.drain()
        with pytest.raises(BundleError, match="writing the bundle failed"):
            w.close()
    finally:
        os.close(fd)
    assert _writer_threads() == 0


def _fill(w: BundleWriter, rng: np.random.Generator) -> list[np.ndarray]:
    arrays = []
    for i in range(40):
        a = rng.standard_normal(rng.integers(1, 400_000)).astype(np.float32)
        arrays.append(a)
        w.add_array(f"t{i}", a)
        r = Record(key=f"m/aten.mul#{i}", module="m", op="aten.mul", ordinal=i, index=i, shape=[a.size],
                   dtype="float32", tensor=f"t{i}")
        w.add_record(r)
    return arrays


@pytest.mark.parametrize("spill", [0, 1 << 20, 64 << 20])
def test_bundle_is_byte_identical_to_one_written_in_place(tmp_path: Path, spill: int) -> None:
    """Streamed from the first tensor, from the 1 MB mark, or never (a small bundle needs no thread)."""
    files = []
    for background in (0, 2 << 20):
        path = tmp_path / f"b{background}.bundle"
        w = BundleWriter(path, spill_bytes=spill, background_bytes=background)
        arrays = _fill(w, np.random.default_rng(1))
        w.close(Manifest(run={"variant": "fp32"}))
        files.append(path.read_bytes())
        b = Bundle.open(path)
        assert all(np.array_equal(b.values(f"t{i}"), a) for i, a in enumerate(arrays))
    assert files[0] == files[1]
    assert _writer_threads() == 0


@pytest.mark.parametrize("spill", [0, 1 << 20, 64 << 20])
@pytest.mark.parametrize("background", [0, 2 << 20])
def test_add_views_in_batches_writes_what_add_writes_and_refuses_one_by_one(tmp_path: Path, spill: int,
                                                                          background: int) -> None:
    """``add_views`` (the compiled observer's hand-over, several tensors a call, any buffer) writes the
    same file as ``add`` one tensor at a time, wherever the spill falls inside a batch; a bad tensor is
    refused with its reason and the others of its batch are written."""
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal(int(rng.integers(0, 300_000))).astype(np.float32) for _ in range(24)]
    one = BundleWriter(tmp_path / "one.bundle", spill_bytes=spill, background_bytes=background)
    for i, a in enumerate(arrays):
        one.add_array(f"t{i}", a)
    many = BundleWriter(tmp_path / "many.bundle", spill_bytes=spill, background_bytes=background)
    refused: list[tuple[str, str]] = []
    items = [(f"t{i}", "F32", a.shape, memoryview(a).cast("B")) for i, a in enumerate(arrays)]
    bad = [(RESERVED_PREFIX + "mine", "F32", (1,), b"\0" * 4), ("t3", "F32", (1,), b"\0" * 4),
           ("odd", "F99", (1,), b"\0" * 4), ("short", "F32", (3,), b"\0" * 4)]
    for start in range(0, len(items), 5):  # batches of 5, a bad tensor inside some of them
        batch = items[start : start + 5]
        if 0 < start // 5 < len(bad):
            batch = [*batch[:2], bad[start // 5 - 1], *batch[2:]]
        refused += many.add_views(batch)
    refused += many.add_views([bad[-1]])
    assert [name for name, _ in refused] == [RESERVED_PREFIX + "mine", "t3", "odd", "short"]
    assert "opband's own" in refused[0][1] and "duplicate" in refused[1][1]
    assert "dtype" in refused[2][1] and "4 bytes given, shape needs 12" in refused[3][1]
    for w in (one, many):
        w.close(Manifest(run={"variant": "fp32"}))
    assert (tmp_path / "one.bundle").read_bytes() == (tmp_path / "many.bundle").read_bytes()
    b = Bundle.open(tmp_path / "many.bundle")
    assert all(np.array_equal(b.values(f"t{i}"), a) for i, a in enumerate(arrays))
    single = BundleWriter(tmp_path / "x.bundle")
    single.add("t0", "F32", (1,), b"\0" * 4)
    with pytest.raises(BundleError, match="duplicate tensor name 't0'"):  # add raises what add_views reports
        single.add("t0", "F32", (1,), b"\0" * 4)
    single.abort()
    assert _writer_threads() == 0


@pytest.mark.parametrize("mb", [0.5, 3, 20])
def test_streamed_early_small_bundles_end_up_as_compact_as_in_memory_ones(tmp_path: Path, mb: float,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With a writer thread the data streams after BACKGROUND_SPILL_BYTES (less copied on the caller's
    thread); a bundle that ends under SPILL_BYTES is rewritten without the header reservation when it
    closes: byte for byte the file a writer without the thread makes, and no bigger."""
    from accuracy import bundle as B

    streamed: list[int] = []
    real = B.BundleWriter._start_streaming

    def noted(self: BundleWriter, *args: object) -> None:
        streamed.append(self._offset)
        real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(B.BundleWriter, "_start_streaming", noted)
    rng = np.random.default_rng(4)
    arrays = [rng.standard_normal(int(mb * (1 << 20)) // 4 // 8).astype(np.float32) for _ in range(8)]
    files = []
    for background in (0, 2 << 20):
        path = tmp_path / f"b{background}.bundle"
        w = BundleWriter(path, background_bytes=background)
        for i, a in enumerate(arrays):
            w.add_array(f"t{i}", a)
        w.close(Manifest(run={"variant": "fp32"}))
        files.append(path.read_bytes())
    assert files[0] == files[1]
    data = sum(a.nbytes for a in arrays)
    if data < B.SPILL_BYTES:
        assert len(files[1]) < data + 4096  # no reservation left in it
    # the thread's writer streamed from about BACKGROUND_SPILL_BYTES on, the other one from SPILL_BYTES on
    assert [n >= B.BACKGROUND_SPILL_BYTES for n in streamed] == [True] * len(streamed)
    assert len(streamed) == (data >= B.BACKGROUND_SPILL_BYTES) + (data >= B.SPILL_BYTES)
    assert all(np.array_equal(Bundle.open(tmp_path / "b0.bundle").values(f"t{i}"), a) for i, a in enumerate(arrays))


def test_a_written_piece_is_let_go_before_drain_returns(tmp_path: Path) -> None:
    """The caller's memory is free once written: the thread must not hold the last batch until the next."""
    import gc
    import weakref

    path = tmp_path / "f"
    with open(path, "w+b") as f:
        w = writebehind.WriteBehind(f.fileno(), limit=1 << 20)
        for i in range(3):
            owner = np.full(4096, i, dtype=np.uint8)
            alive = weakref.ref(owner)
            w.put(i * 4096, memoryview(owner))
            del owner
            w.drain()
            gc.collect()
            assert alive() is None, f"piece {i} is still held by the writer thread after drain()"
        w.close()
    assert path.read_bytes() == b"".join(bytes([i]) * 4096 for i in range(3))


def test_pieces_still_arriving_are_written_after_their_ready_call(tmp_path: Path) -> None:
    """A device-to-host copy's bytes: the caller queues them at once, the thread waits for them."""
    arrived = threading.Event()
    buffers = [np.zeros(3 << 20, dtype=np.uint8), np.zeros(10, dtype=np.uint8)]  # past the wake-up size
    calls: list[str] = []

    def ready() -> None:
        calls.append(threading.current_thread().name)
        assert arrived.wait(10)
        for i, b in enumerate(buffers):
            b[:] = i + 1  # the copy lands

    path = tmp_path / "f"
    with open(path, "w+b") as f:
        w = writebehind.WriteBehind(f.fileno(), limit=8 << 20)
        w.put_many([(0, memoryview(buffers[0])), (buffers[0].nbytes, memoryview(buffers[1]))], ready)
        arrived.set()  # put_many returned without waiting for the copy
        w.close()
    data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    assert data.size == buffers[0].nbytes + 10 and (data[:buffers[0].nbytes] == 1).all() and (data[-10:] == 2).all()
    assert calls == ["opband-bundle-writer"]  # once per call, on the writer thread


@pytest.mark.parametrize("spill", [0, 1 << 30])  # streamed to the writer thread; kept in memory (read at once)
def test_add_views_reads_pieces_still_arriving_only_after_ready(tmp_path: Path, spill: int) -> None:
    buffer = np.zeros(64, dtype=np.float32)

    def ready() -> None:
        buffer[:] = 7.0

    w = BundleWriter(tmp_path / "b.bundle", spill_bytes=spill, background_bytes=1 << 20)
    assert w.add_views([("x", "F32", (64,), buffer.data)], ready=ready) == []
    w.close(Manifest(run={"variant": "fp32"}))
    assert (Bundle.open(tmp_path / "b.bundle").values("x") == 7.0).all()


def test_a_ready_call_that_raises_adds_no_entry(tmp_path: Path) -> None:
    """A failed copy (its event raised) leaves the header as it was: later tensors keep their offsets."""
    def failed() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    w = BundleWriter(tmp_path / "b.bundle", spill_bytes=1 << 30)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        w.add_views([("lost", "F32", (4,), np.ones(4, np.float32).data)], ready=failed)
    w.add_array("kept", np.arange(8, dtype=np.float32))
    w.close(Manifest(run={"variant": "fp32"}))
    b = Bundle.open(tmp_path / "b.bundle")
    assert sorted(b.tensors) == ["kept"] and b.values("kept").tolist() == list(range(8))


def test_put_many_waits_for_room_and_keeps_the_order(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in (10, 3 << 20, 0, 5, 2 << 20, 1 << 20, 7)]
    offsets = np.cumsum([0] + [p.nbytes for p in pieces])[:-1]
    path = tmp_path / "f"
    with open(path, "w+b") as f:
        w = writebehind.WriteBehind(f.fileno(), limit=2 << 20)  # pieces over the limit, several batches
        w.put_many([(int(o), memoryview(p)) for o, p in zip(offsets, pieces, strict=True)])
        w.close()
    assert path.read_bytes() == b"".join(p.tobytes() for p in pieces)
    assert _writer_threads() == 0


def test_abort_stops_the_thread_and_leaves_nothing(tmp_path: Path) -> None:
    w = BundleWriter(tmp_path / "a.bundle", spill_bytes=0, background_bytes=1 << 20)
    _fill(w, np.random.default_rng(2))
    w.abort()
    assert not list(tmp_path.iterdir())
    assert _writer_threads() == 0


class _WritesItsOutputs(torch.nn.Module):
    """Each step's matmul output is recorded, then the model writes into it in place (and through a view)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(512, 512, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for _ in range(12):  # 12 x 1 MB outputs: past the 8 MB spill, under the 4 MB wake-up between writes
            y = x @ self.w
            y.mul_(-3.0)
            y[:, :7].zero_()
            outs.append(y)
        return torch.stack(outs).sum(0)


def _assert_matmul_results(b: Bundle, count: int, expected: torch.Tensor) -> None:
    """The bundle holds ``count`` ``aten.mm`` records, each stored as exactly ``expected``."""
    mms = [r for r in b.records if r.op == "aten.mm"]
    assert len(mms) == count
    for r in mms:
        assert r.tensor is not None
        assert np.array_equal(b.values(r.tensor).reshape(expected.shape), expected.numpy()), r.key


def test_full_capture_stores_outputs_as_the_op_made_them(tmp_path: Path) -> None:
    """Outputs queued for the writer thread are on disk before the next in-place op runs: the bundle
    holds each matmul's result, not what the model later wrote into the same memory."""
    model = _WritesItsOutputs()
    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(1))
    expected = (x @ model.w).detach()
    with torch.no_grad(), capture(model, tmp_path / "c.bundle", level="aten", mode="full", progress=False):
        model(x)
    b = Bundle.open(tmp_path / "c.bundle")
    _assert_matmul_results(b, 12, expected)
    assert not b.manifest.diagnostics
    assert _writer_threads() == 0


def test_ops_the_mode_does_not_see_wait_for_the_writes(tmp_path: Path) -> None:
    """A compiled block runs with the dispatch mode stepped aside (``hooks.compiled.capture_paused``):
    what it writes in place into an output still queued for the writer thread waits for that write."""
    from hooks.compiled import capture_paused

    model = _WritesItsOutputs()
    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(2))
    expected = (x @ model.w).detach()
    with torch.no_grad(), capture(model, tmp_path / "u.bundle", level="aten", mode="full", progress=False):
        ys = [x @ model.w for _ in range(10)]  # 10 MB: streaming, still under the thread's wake-up
        with capture_paused():
            for y in ys:
                y.add_(1.0)
    b = Bundle.open(tmp_path / "u.bundle")
    _assert_matmul_results(b, 10, expected)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_inside_the_capture_leaves_the_parent_bundle_alone(tmp_path: Path) -> None:
    """A DataLoader worker forked inside the block inherits the dispatch mode and a copy of the recorder:
    the copy records nothing, waits for no writer thread (there is none in the child: a put past the
    queue limit would hang it) and, leaving the block, writes no bundle; the parent's is intact."""
    import time

    model = _WritesItsOutputs()
    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(3))
    expected = (x @ model.w).detach()
    path = tmp_path / "f.bundle"
    pid = -1
    try:
        with torch.no_grad(), capture(model, path, level="aten", mode="full", progress=False):
            model(x)  # streaming, the writer thread holding queued outputs
            pid = os.fork()
            if pid == 0:
                torch.set_num_threads(1)  # as a DataLoader worker does (a forked OpenMP pool hangs)
                for _ in range(40):  # 40 MB a live copy of the recorder would queue
                    y = x @ model.w
                    y.add_(1.0)
            else:
                deadline = time.monotonic() + 60
                while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
                if done[0] == 0:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    pytest.fail("the forked child hung")
                assert os.waitstatus_to_exitcode(done[1]) == 0
    except BaseException:
        if pid == 0:
            os._exit(1)
        raise
    if pid == 0:
        os._exit(0)
    b = Bundle.open(path)
    _assert_matmul_results(b, 12, expected)
    assert not b.manifest.diagnostics


def test_replay_inputs_of_an_in_place_op_are_stored_before_it_writes(tmp_path: Path) -> None:
    """``inputs=True`` stores an op's inputs as it is called: for an in-place op they must reach the disk
    before the op writes into the same memory (the reviewer's case: a zero accumulator stored as ones)."""
    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(4))
    w = torch.randn(512, 512, generator=torch.Generator().manual_seed(5))
    acc = torch.zeros(1000)
    model = torch.nn.Linear(2, 2)
    with torch.no_grad(), capture(model, tmp_path / "i.bundle", level="aten", mode="full", inputs=True,
                                  progress=False):
        for _ in range(6):
            x @ w  # 1 MB outputs and 2 MB of inputs each: streaming, below the thread's wake-up
        acc.add_(1.0)
    b = Bundle.open(tmp_path / "i.bundle")
    (add,) = [r for r in b.records if r.op == "aten.add_"]
    assert add.input_tensors and add.input_tensors[0] is not None
    assert np.array_equal(b.values(add.input_tensors[0]), np.zeros(1000, np.float32))  # as the op found it
    assert np.array_equal(b.values(add.tensor), np.ones(1000, np.float32))  # type: ignore[arg-type]


def test_record_tensor_is_stored_before_the_callers_unseen_writes(tmp_path: Path) -> None:
    """``cap.record_tensor`` inside ``paused()``, then a write the mode does not see (a gradient clip)."""
    model = _WritesItsOutputs()
    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(6))
    grad = torch.full((1000,), 2.0)
    with torch.no_grad(), capture(model, tmp_path / "g.bundle", level="aten", mode="full", progress=False) as cap:
        model(x)  # streaming
        with cap.paused():
            cap.record_tensor("layer", "grad.weight", grad)
            grad.mul_(0.5)
    b = Bundle.open(tmp_path / "g.bundle")
    (g,) = [r for r in b.records if r.op == "grad.weight"]
    assert np.array_equal(b.values(g.tensor), np.full(1000, 2.0, np.float32))  # type: ignore[arg-type]


def test_a_failed_write_fails_the_capture_once_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Disk full under the writer thread: the capture's exit raises the error (no bundle could be written),
    no partial file or thread is left, and the model's run was not interrupted."""
    def full(fd: int, views: list[memoryview], offset: int) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    model = _WritesItsOutputs()
    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(7))
    ran = False
    with pytest.raises(BundleError, match="writing the bundle failed: .*No space left on device"):
        with torch.no_grad(), capture(model, tmp_path / "e.bundle", level="aten", mode="full", progress=False) as cap:
            model(x)
            model(x)
            ran = True
            rec = cap._recorder
            assert rec is not None and rec.write_error is not None
            assert sum("writing tensors failed" in d.message for d in rec.diagnostics) == 1
    assert ran
    assert not list(tmp_path.iterdir())
    assert _writer_threads() == 0
