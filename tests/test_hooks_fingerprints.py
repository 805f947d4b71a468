"""Parameter fingerprints walked on a background thread during an ``aten`` capture (issue 14): the same
prints as the synchronous walk, and the weights as they were when the capture began, whatever the
captured block writes into them."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch

from accuracy.bundle import Bundle
from accuracy.fingerprints import REORDER_SLACK_U, print_difference
from accuracy.manifest import TensorPrint
from accuracy.metrics import machine_eps
from hooks import capture
from hooks.fingerprints import (BACKGROUND_CHUNK_BYTES, DevicePrints, ParameterPrints, _device_prints, parameter_prints,
                               tensor_print)


class _Mixed(torch.nn.Module):
    """Weights of every kind the walk meets: big ones (several background chunks; fp32 and fp64, walked by
    the thread), small bf16/fp16 ones (walked at once), an integer buffer, an empty one, a transposed
    (non-contiguous) one, NaN/Inf values."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.big = torch.nn.Linear(1024, 3 * BACKGROUND_CHUNK_BYTES // 4096 + 7, bias=True)  # > 3 chunks of float32
        self.low = torch.nn.Parameter(torch.randn(300, 70, generator=g).to(torch.float16))
        self.brain = torch.nn.Parameter(torch.randn(5000, generator=g).to(torch.bfloat16))
        self.wide = torch.nn.Parameter(torch.randn(300_001, generator=g, dtype=torch.float64))  # 2.4 MB: to the thread
        self.register_buffer("steps", torch.arange(17))
        self.register_buffer("nothing", torch.zeros(0))
        self.register_buffer("flipped", torch.randn(64, 48, generator=g).t())
        odd = torch.randn(4096, generator=g)
        odd[[3, 700, 4095]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        self.register_buffer("odd", odd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.big(x).sum() * self.low.float().sum() + self.brain.float().sum()


def test_background_prints_equal_the_synchronous_walk() -> None:
    model = _Mixed()
    before = parameter_prints(model)
    job = ParameterPrints(model)
    assert job._thread is not None  # the big float weights went to the thread
    assert job.result() == before  # digests and numbers, name for name, in the same order
    assert list(job.result()) == list(before)
    assert not job.notes


def _weights_at_start(path: Path) -> dict:
    return Bundle.open(path).manifest.fingerprints.parameters  # type: ignore[union-attr]


def test_a_write_inside_the_capture_waits_for_the_walk(tmp_path: Path) -> None:
    """The first in-place write (here into the biggest weight, the first op of the block) runs only after
    the background walk has read every weight: the bundle describes the weights as they were loaded."""
    model = _Mixed()
    before = parameter_prints(model)
    with torch.no_grad(), capture(model, tmp_path / "w.bundle", level="aten", mode="summary", progress=False):
        model.big.weight.mul_(2.0)
        model(torch.ones(1, 1024))
    prints = _weights_at_start(tmp_path / "w.bundle")
    assert prints == before
    assert prints["big.weight"] != parameter_prints(model)["big.weight"]  # the write happened, after the walk
    assert not Bundle.open(tmp_path / "w.bundle").manifest.diagnostics


def test_paused_block_writes_wait_for_the_walk(tmp_path: Path) -> None:
    """``cap.paused()`` hides its ops from the dispatch mode, so it finishes the walk before its block."""
    model = _Mixed()
    before = parameter_prints(model)
    with capture(model, tmp_path / "p.bundle", level="aten", mode="summary", progress=False) as cap:
        with cap.paused(), torch.no_grad():
            model.big.weight.data.add_(1.0)  # .data: not even the version counter would tell
        with torch.no_grad():
            model(torch.ones(1, 1024))
    assert _weights_at_start(tmp_path / "p.bundle") == before


def test_a_write_no_mode_sees_is_told_and_fingerprinted_as_it_ended(tmp_path: Path) -> None:
    """A write from another thread bypasses the dispatch mode: the weight's version counter tells, its
    print describes it at the end of the capture, and the manifest says so."""
    model = _Mixed()
    before = parameter_prints(model)
    with torch.no_grad(), capture(model, tmp_path / "t.bundle", level="aten", mode="summary", progress=False):
        def write() -> None:
            with torch.no_grad():
                model.wide.add_(1.0)

        writer = threading.Thread(target=write)
        writer.start()
        writer.join()
        model(torch.ones(1, 1024))
    bundle = Bundle.open(tmp_path / "t.bundle")
    prints = bundle.manifest.fingerprints.parameters  # type: ignore[union-attr]
    assert prints["wide"] == parameter_prints(model)["wide"] != before["wide"]
    assert {k: v for k, v in prints.items() if k != "wide"} == {k: v for k, v in before.items() if k != "wide"}
    notes = [d.message for d in bundle.manifest.diagnostics]
    assert any("changed during the capture" in n and "wide" in n for n in notes), notes


@pytest.mark.parametrize("level", ["module", "api"])
def test_other_levels_fingerprint_before_the_block(tmp_path: Path, level: str) -> None:
    """Module and API levels do not see in-place writes: their prints are taken before the block runs."""
    model = _Mixed()
    before = parameter_prints(model)
    with torch.no_grad(), capture(model, tmp_path / "m.bundle", level=level, mode="summary", progress=False):
        model.big.weight.data.mul_(3.0)
        model(torch.ones(1, 1024))
    assert _weights_at_start(tmp_path / "m.bundle") == before


def _drift_in_u(a: TensorPrint, b: TensorPrint) -> tuple[float, float]:
    """(L2 drift / (u x L2), sum drift / (u x sqrt(n) x L2)) in float32's u."""
    u, n = machine_eps("float32"), max(math.prod(a.shape), 1)
    return abs(a.l2 - b.l2) / (u * a.l2), abs(a.sum - b.sum) / (u * math.sqrt(n) * a.l2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_accelerator_prints_agree_with_the_cpu_kernels_within_summation_order(dtype: torch.dtype) -> None:
    """An accelerator run's prints (torch float64 reductions, no digest: ``_device_prints``, run here on
    the same CPU values) against a CPU run's (the statistics kernel's float32 blocks): absmax exact, sum
    and L2 well inside REORDER_SLACK_U, so an fp32 GPU port of an fp32 model has no parameter finding
    (the H200 check found every weight flagged when same-dtype prints without a digest had to be equal)."""
    g = torch.Generator().manual_seed(1)
    worst = (0.0, 0.0)
    for n in (7, 4097, 1 << 20):
        x = torch.randn(n, generator=g, dtype=torch.float64)
        for values in (0.02 * x, 1 + 0.01 * x, 100 + x, 1e-3 * x):
            w = values.to(dtype)
            cpu, device = tensor_print(w), _device_prints([w])[0]
            assert cpu is not None and device is not None and cpu.digest and not device.digest
            assert (device.absmax, device.nonfinite) == (cpu.absmax, 0)
            assert print_difference(cpu, device) is None and print_difference(device, cpu) is None
            worst = tuple(max(p, q) for p, q in zip(worst, _drift_in_u(cpu, device)))  # type: ignore[assignment]
    assert worst[0] < REORDER_SLACK_U / 8 and worst[1] < REORDER_SLACK_U / 8, worst


def test_accelerator_prints_still_find_a_changed_weight() -> None:
    """Without a digest a weight that differs is still named: a bf16 round trip kept as float32 (a lossy
    load), a row of zeros (a shard not loaded), one element off by 5% of the largest, a NaN; the honest
    copy is not."""
    w = (torch.randn(256, 512, generator=torch.Generator().manual_seed(2)) * 0.05).to(torch.float32)
    ref = tensor_print(w)
    assert ref is not None
    assert print_difference(ref, _device_prints([w.clone()])[0]) is None  # type: ignore[arg-type]
    row, nudged, nan = w.clone(), w.clone(), w.clone()
    row[7] = 0
    nudged[3, 4] += 0.05 * float(w.abs().max())
    nan[0, 0] = float("nan")
    for bad in (w.to(torch.bfloat16).to(torch.float32), row, nudged, nan):
        assert print_difference(ref, _device_prints([bad])[0]) is not None  # type: ignore[arg-type]
    fp = _device_prints([nan])[0]
    assert fp is not None and fp.nonfinite == 1 and math.isfinite(fp.l2)


def test_accelerator_prints_batch_every_tensor_into_one_host_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """One ``.tolist()`` for all of a device's tensors (each read is a device sync on a GPU), and the
    same prints as one tensor at a time; NaN ones redone over their finite values, unreadable ones None."""
    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(40, 30, generator=g), torch.randn(64, generator=g).to(torch.bfloat16),
          torch.arange(10), torch.tensor([1.0, float("inf"), -2.0]), torch.empty(0),
          torch.randn(3, generator=g, dtype=torch.complex64), torch.randn(4).to_sparse()]
    one_by_one = [_device_prints([t])[0] for t in ts]
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.numel()) or real(self))
    batched = _device_prints(ts)
    assert batched == one_by_one and len(reads) == 1 and reads[0] == 3 * 5  # five dense non-empty tensors
    assert batched[3] is not None and (batched[3].nonfinite, batched[3].sum, batched[3].absmax) == (1, -1.0, 2.0)
    assert batched[4] is not None and (batched[4].sum, batched[4].l2) == (0.0, 0.0)
    assert batched[6] is None  # sparse: not fingerprinted


def test_masked_device_prints_are_taken_at_launch_and_read_later() -> None:
    """The model inputs' prints inside a captured forward (which must not sync an accelerator): queued at
    the first call, read at the end, and they describe the inputs as they were at the call, NaN/Inf
    counted, the same prints as the unmasked path."""
    x = torch.randn(4, 33, generator=torch.Generator().manual_seed(4))
    x[1, 2], x[3, 0] = float("nan"), float("-inf")
    want = _device_prints([x.clone()])
    pending = DevicePrints([x], masked=True)
    x.fill_(7.0)  # the forward goes on and overwrites its input
    got = pending.read()
    assert got == want and got[0] is not None and got[0].nonfinite == 2


def test_an_unreadable_accelerator_tensor_loses_only_its_own_print() -> None:
    """A tensor whose reductions can be queued but not read (a FakeTensor on "cuda"; subclasses such as
    DTensor can behave alike) is left out of the prints; the other weights keep theirs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    m = torch.nn.Module()
    m.register_buffer("real", torch.randn(4, generator=torch.Generator().manual_seed(6)))
    with FakeTensorMode():
        fake = torch.empty(4, device="cuda")
    m.register_buffer("fake", fake)
    assert sorted(parameter_prints(m)) == ["real"]
    assert sorted(ParameterPrints(m).result()) == ["real"]


def _walk_inputs() -> list:
    """Kernel inputs of every dtype and size class: one element, a partial chunk, several chunks and a
    short last one, NaN/Inf, a slice that starts inside its storage."""
    from hooks.fingerprints import CHUNK_BYTES, _KernelInput

    g = torch.Generator().manual_seed(11)
    out = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        per = CHUNK_BYTES // torch.empty(0, dtype=dtype).element_size()
        for n in (1, 4097, 3 * per + 999):
            x = (torch.randn(n + 5, generator=g, dtype=torch.float64) * 4).to(dtype)[5:]  # storage offset 5
            if n > 10:
                x[[2, n // 2, n - 1]] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
            out.append(_KernelInput.of(x))
    return out


def test_compiled_walk_hashes_and_summarises_as_the_python_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """xxhash's own C functions drive the walk here (a build without them would fall back silently:
    this fails instead); its digests are ``xxhash.xxh3_128_hexdigest`` of the bytes and its heads the
    Python walk's, also across several batches of states."""
    import xxhash

    from hooks import fingerprints as fps

    assert fps._xxh3() is not None
    srcs = _walk_inputs()
    python = [fps._walk(src, fps.CHUNK_BYTES) for src in srcs]
    monkeypatch.setattr(fps, "NATIVE_BATCH", 5)  # 12 inputs: three batches reuse the states
    compiled = fps._walk_all(srcs, fps.CHUNK_BYTES)
    for src, (digest, head), (want_digest, want_head) in zip(srcs, compiled, python):
        assert digest == want_digest == xxhash.xxh3_128_hexdigest(src.raw())
        assert head.tolist() == want_head.tolist()
    assert len(fps._STATES) >= 5  # handed back for the next walk


def test_failed_compiled_walk_hands_its_states_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from accuracy import fused
    from hooks import fingerprints as fps

    srcs = _walk_inputs()[:3]
    fps._walk_all(srcs, fps.CHUNK_BYTES)
    pool = len(fps._STATES)

    def broken(*args: object) -> None:
        raise RuntimeError("walk failed")

    monkeypatch.setattr(fused, "hashed_heads", broken)
    with pytest.raises(RuntimeError, match="walk failed"):
        fps._walk_all(srcs, fps.CHUNK_BYTES)
    assert len(fps._STATES) == pool


def test_prints_without_the_compiled_walk_are_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where xxhash's extension does not export its C functions, every walk runs in Python, background
    thread included, and the prints are the same."""
    from hooks import fingerprints as fps

    model = _Mixed()
    compiled = ParameterPrints(model).result()
    monkeypatch.setattr(fps, "_xxh3", lambda: None)
    calls: list[int] = []
    walk = fps._walk
    monkeypatch.setattr(fps, "_walk", lambda src, chunk: calls.append(chunk) or walk(src, chunk))
    assert ParameterPrints(model).result() == compiled == parameter_prints(model)
    assert BACKGROUND_CHUNK_BYTES in calls  # the thread's Python walk, in its larger pieces


def test_a_transposed_weight_is_named_as_the_same_values_in_another_layout() -> None:
    from hooks.fingerprints import tensor_print

    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(5))
    a, b = tensor_print(w), tensor_print(w.t().contiguous())
    how = print_difference(a, b)
    assert how is not None and "another order or layout" in how and "transposed" in how
    assert " vs " not in how  # no "sum 0.4998 vs 0.4998": equal-looking numbers never read as the difference
    changed = w.clone()
    changed[3, 7] += 0.5
    how = print_difference(a, tensor_print(changed))
    assert how is not None and "another order" not in how and "sum" in how
