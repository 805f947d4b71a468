"""The compiled observer (hooks._observer) records what the dispatch mode records.

Every test captures the same run twice, at the aten level: once through the Python
``TorchDispatchMode`` (``OPBAND_OBSERVER=0``) and once through the compiled ``at::RecordFunction``
observer, and asks for identical records: keys, order, input shapes and dtypes, output shapes,
dtypes and statistics, bit for bit; in full mode also the same stored tensors (names, dtypes, shapes,
bytes) named by the same records. The zoo's architectures, low-precision and int8 variants, a
training step with a backward pass, channels-last convolutions, integer and boolean outputs,
in-place writes and selected steps are covered; the views counted as skipped may differ (see
docs/capture.md)."""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zoo
from accuracy.bundle import Bundle
from accuracy.manifest import Record
from hooks import capture, observer
from hooks.tensors import fast_leaves
from hooks.variants import apply_variant

Run = Callable[[capture], None]


def _capture(tmp_path: Path, name: str, model: nn.Module, run: Run, engine: str, grad: bool = False,
             **options: Any) -> capture:
    mp = pytest.MonkeyPatch()
    mp.setenv("OPBAND_OBSERVER", "1" if engine == "observer" else "0")
    options.setdefault("mode", "summary")
    try:
        with torch.set_grad_enabled(grad), capture(model, tmp_path / f"{name}-{engine}.bundle", level="aten",
                                                   progress=False, **options) as cap:
            run(cap)
    finally:
        mp.undo()
    return cap


def _same_records(tmp_path: Path, name: str, model: nn.Module, run: Run, grad: bool = False,
                  **options: Any) -> tuple[capture, capture]:
    """Capture ``run`` both ways; assert identical records and diagnostics; return both captures."""
    mode = _capture(tmp_path, name, model, run, "dispatch", grad, **options)
    seen = _capture(tmp_path, name, model, run, "observer", grad, **options)
    assert mode.engine.startswith("dispatch mode") and seen.engine == "observer", (mode.engine, seen.engine)
    a, b = [r.model_dump() for r in mode.records], [r.model_dump() for r in seen.records]
    assert [r["key"] for r in a] == [r["key"] for r in b]
    for x, y in zip(a, b, strict=True):
        assert _equal(x, y), (x["key"], {k: (x[k], y[k]) for k in x if not _equal(x[k], y[k])})
    assert [d.message for d in mode._recorder.diagnostics] == [d.message for d in seen._recorder.diagnostics]
    assert observer.active() is None
    lines = seen._recorder.log.lines()
    assert lines, "the observer wrote no record line"
    for line in lines:  # pydantic's own bytes: the bundle reader's one-call fast path takes them
        record = Record.model_validate_json(line)
        assert record.__pydantic_serializer__.to_json(record, exclude_none=True) == line
    assert _equal([r.model_dump() for r in Bundle.open(seen.bundle_path).records], b)  # type: ignore[arg-type]
    if options.get("mode") == "full":
        _same_tensors(Bundle.open(mode.bundle_path), Bundle.open(seen.bundle_path))
    return mode, seen


def _same_tensors(a: Bundle, b: Bundle) -> None:
    """The same tensors stored under the same names: dtype, shape and bytes."""
    assert sorted(a.tensors) == sorted(b.tensors)
    assert any(r.tensor is not None for r in b.records), "full mode stored no tensor"
    for name in a.tensors:
        x, y = a.tensors[name], b.tensors[name]
        assert (x.dtype, x.shape) == (y.dtype, y.shape), name
        assert a.raw(name).tobytes() == b.raw(name).tobytes(), name


def _equal(x: Any, y: Any) -> bool:
    """Equal, with NaN equal to NaN (statistics of non-finite tensors)."""
    if isinstance(x, float) and isinstance(y, float):
        return x == y or (math.isnan(x) and math.isnan(y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_equal(a, b) for a, b in zip(x, y, strict=True))
    return x == y


def test_record_lines_write_floats_as_pydantic_does() -> None:
    """Record lines come from C++; a float must read back as pydantic writes it, byte for byte, or the
    bundle reader falls back to its slow strict path (and a number could change)."""
    import struct

    import numpy as np
    from pydantic import BaseModel, ConfigDict

    from hooks import _observer

    class One(BaseModel):
        model_config = ConfigDict(ser_json_inf_nan="strings")
        v: float

    rng = np.random.default_rng(0)
    values = [0.0, -0.0, 1.0, -1.0, 0.1, 1e15, 1e16, 1e-5, 1e-4, 1.5e-7, 1e21, 5e-324, 2.2250738585072014e-308,
              1.7976931348623157e308, math.nan, math.inf, -math.inf, 9007199254740993.0, 2 / 3, 100.0, 1234.5]
    values += [float(v) for v in rng.standard_normal(5000) * 10.0 ** rng.integers(-30, 30, 5000)]
    values += [struct.unpack("<d", rng.bytes(8))[0] for _ in range(5000)]
    values += [float(np.float32(v)) for v in rng.standard_normal(5000) * 10.0 ** rng.integers(-20, 20, 5000)]
    for v in values:
        assert _observer.json_float(v) == One(v=v).model_dump_json()[5:-1], v


def test_the_observer_is_built_for_this_torch() -> None:
    """make venv compiles it; CI must not fall back to the dispatch mode without saying so."""
    from hooks import _observer

    assert _observer.TORCH_VERSION == torch.__version__
    assert observer.why_not(capture(nn.Identity(), "unused.bundle", mode="summary").options, nn.Identity()) is None
    from torch.utils.cpp_extension import CUDA_HOME

    # setup.py builds the CUDA path exactly where it can: a CUDA torch and nvcc
    wanted = bool(torch.version.cuda and CUDA_HOME and not os.environ.get("OPBAND_NO_CUDA"))
    assert _observer.CUDA == wanted, "setup.py printed why it built without the CUDA path (nvcc's version?)"


def test_models_on_other_devices_take_the_dispatch_mode() -> None:
    options = capture(nn.Identity(), "unused.bundle", mode="summary").options
    reason = observer.why_not(options, nn.Linear(2, 2, device="meta"))
    assert reason == "the observer summarises CPU and single-GPU CUDA tensors; this model's take the dispatch mode"


@pytest.mark.parametrize("mode", ["summary", "full"])
@pytest.mark.parametrize("entry", zoo.MODELS, ids=lambda m: m.name)
def test_zoo_models_record_the_same(entry: zoo.Model, mode: str, tmp_path: Path) -> None:
    model, inputs = entry.build()
    mode, seen = _same_records(tmp_path, entry.name, model, lambda cap: model(**inputs), mode=mode)
    assert len(list(seen.records)) > 20
    assert seen._recorder.ops_seen == mode._recorder.ops_seen


@pytest.mark.parametrize("mode", ["summary", "full"])
@pytest.mark.parametrize("name", ["llama", "resnet", "t5"])
def test_the_observer_changes_no_bit_of_the_output(name: str, mode: str, tmp_path: Path) -> None:
    """It observes the dispatcher and never enters the call: the outputs are the uncaptured run's bits."""
    model, inputs = zoo.BY_NAME[name].build()
    with torch.no_grad():
        plain = model(**inputs)
        with capture(model, tmp_path / "o.bundle", mode=mode, progress=False) as cap:
            seen = model(**inputs)
    assert cap.engine == "observer"
    for a, b in zip(fast_leaves(plain), fast_leaves(seen), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("mode", ["summary", "full"])
@pytest.mark.parametrize("variant", ["bf16", "fp16", "int8"])
def test_low_precision_and_int8_variants_record_the_same(variant: str, mode: str, tmp_path: Path) -> None:
    """bf16/fp16 outputs are summarised by the observer; int8's quantized kernels' outputs take the
    recorder's Python path (quantized tensors) under the observer's keys."""
    entry = zoo.BY_NAME["llama"]
    model, inputs = entry.build()
    model, inputs, _ = apply_variant(model, inputs, variant, "cpu")
    _, seen = _same_records(tmp_path, variant, model, lambda cap: model(**inputs), mode=mode)
    assert {r.dtype for r in seen.records} & {"bfloat16", "float16", "float32"}


@pytest.mark.parametrize("mode", ["summary", "full"])
def test_training_step_with_backward_inside(mode: str, tmp_path: Path) -> None:
    """Grad on, a loss and its backward inside the block: the backward's ops are skipped both ways."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 2))
    x, target = torch.randn(4, 8), torch.tensor([0, 1, 1, 0])

    def step(cap: capture) -> None:
        loss = nn.functional.cross_entropy(model(x), target)
        loss.backward()
        model.zero_grad()

    dispatch, seen = _same_records(tmp_path, "train", model, step, grad=True, mode=mode)
    backward_a = {k: v for k, v in dispatch._recorder.skipped.items() if k.startswith("(backward)")}
    backward_b = {k: v for k, v in seen._recorder.skipped.items() if k.startswith("(backward)")}
    assert backward_a and backward_a == backward_b


class _Odd(nn.Module):
    """Outputs the observer does not summarise itself (integers, booleans, channels-last, empty,
    non-finite values) next to ones it does, and in-place writes between them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        self.lin = nn.Linear(6, 6)

    def forward(self, img: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.conv(img.to(memory_format=torch.channels_last))  # a non-contiguous (channels-last) output
        h = self.lin(x)
        top = h.argmax(-1)  # int64
        mask = h > 0  # bool
        h.mul_(2.0)  # in place: later rows of h's memory are fresh
        h = h.masked_fill(mask, float("-inf"))
        z = torch.log(h.clamp(min=-1.0))  # NaN and -inf
        empty = h[:, :0] * 2
        parts = torch.split(h, 2, dim=-1)
        spectrum = torch.fft.rfft(x)  # complex64: the recorder's own payload (view_as_real)
        strided = x.t()[::2] * 3  # neither contiguous nor dense: summarised from a contiguous copy
        return (y, top, mask, h, z, empty, torch.cat(parts[::-1], -1), h.sum(-1, keepdim=True).sqrt(), spectrum,
                strided)


@pytest.mark.parametrize("mode", ["summary", "full"])
def test_odd_outputs_and_in_place_writes_record_the_same(mode: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Odd()
    img, x = torch.randn(2, 3, 8, 8), torch.randn(5, 6)
    _, seen = _same_records(tmp_path, "odd", model, lambda cap: model(img, x), mode=mode)
    dtypes = {r.dtype for r in seen.records}
    assert {"int64", "bool", "float32"} <= dtypes
    assert any((r.qparams or {}).get("complex") == "complex64" for r in seen.records)  # went the recorder's way
    assert any(r.memory_format == "channels_last" for r in seen.records)


@pytest.mark.parametrize("mode", ["summary", "full"])
def test_selected_steps_and_a_raising_forward(mode: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(3, 4)

    def steps(cap: capture) -> None:
        for _ in range(3):
            model(x * 2)
            cap.step()

    _, seen = _same_records(tmp_path, "steps", model, steps, steps=[1], mode=mode)
    assert {r.step for r in seen.records} == {1}

    def raising(cap: capture) -> None:
        model(x)
        raise ValueError("boom")

    for engine in ("dispatch", "observer"):
        with pytest.raises(ValueError, match="boom"):
            _capture(tmp_path, "raise", model, raising, engine, mode=mode)
    assert observer.active() is None
    kept = [Bundle.open(tmp_path / f"raise-{engine}.bundle") for engine in ("dispatch", "observer")]
    assert [r.key for r in kept[0].records] == [r.key for r in kept[1].records]  # what ran before the raise
    if mode == "full":
        _same_tensors(*kept)
    with torch.no_grad(), capture(model, tmp_path / "after.bundle", mode=mode, progress=False) as cap:
        model(x)
    assert cap.engine == "observer"  # the observer was removed and comes back
    assert [r.key for r in cap.records] == ["0/aten.addmm#0", "0/forward#0", "1/aten.relu#0", "1/forward#0", "/forward#0"]


def test_other_threads_and_paused_blocks_are_not_recorded(tmp_path: Path) -> None:
    """The observer is thread-local, as the dispatch mode is; ``cap.paused()`` blocks are not recorded."""
    import threading

    model = nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def run(cap: capture) -> None:
        t = threading.Thread(target=lambda: torch.exp(x))
        t.start()
        t.join()
        with cap.paused():
            torch.sin(x)
        model(x)

    _, seen = _same_records(tmp_path, "threads", model, run)
    assert [r.op for r in seen.records] == ["aten.addmm", "forward"]


def test_a_profiler_still_sees_the_ops_inside_a_recorded_call(tmp_path: Path) -> None:
    """The observer turns its own callback off inside a recorded call (the kernel's calls are not the
    model's ops), not RecordFunction: a profiler running across the capture sees the inner ops, as it
    does without a capture, and the records are those of the dispatch mode."""
    from torch.profiler import ProfilerActivity, profile

    model = nn.Sequential(nn.Linear(8, 8), nn.Softmax(dim=-1))
    x = torch.randn(3, 8)

    def inner_ops(run: Callable[[], Any]) -> list[str]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
        return sorted(e.name for e in prof.events()
                      if e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))

    def both(cap: capture) -> None:
        model(x).transpose(0, 1).contiguous()

    plain = inner_ops(lambda: model(x).transpose(0, 1).contiguous())
    assert "aten::as_strided" in plain and "aten::empty_like" in plain, plain  # the kernels' own calls
    seen: list[list[str]] = []
    _same_records(tmp_path, "profiled", model, lambda cap: seen.append(inner_ops(lambda: both(cap))))
    missing = Counter(plain) - Counter(seen[-1])  # the capture adds ops of its own (sample indices), hides none
    assert not missing, missing
    without = _capture(tmp_path, "after", model, both, "observer")  # the callback is back on after each call
    assert [r.op for r in without.records] == [r.op for r in _capture(tmp_path, "after", model, both, "dispatch").records]


def test_a_nested_capture_and_other_options_take_the_dispatch_mode(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.no_grad(), capture(model, tmp_path / "outer.bundle", mode="summary", progress=False) as outer:
        with capture(model, tmp_path / "inner.bundle", mode="summary", progress=False) as inner:
            model(x)
    assert outer.engine == "observer"
    assert inner.engine == "dispatch mode (another observer capture is active in this process)"
    assert [r.key for r in inner.records] == [r.key for r in outer.records] == ["/aten.addmm#0", "/forward#0"]
    for options, reason in [({"mode": "full", "max_bytes": 1 << 20}, "byte budget"), ({"level": "module", "mode": "summary"}, ""),
                            ({"mode": "summary", "ops": ["aten.mm"]}, "filters")]:
        with torch.no_grad(), capture(model, tmp_path / "o.bundle", progress=False, **options) as cap:
            model(x)
        assert cap.engine == "" if options.get("level") == "module" else cap.engine.startswith("dispatch mode")
        assert reason in cap.engine


def test_compiled_code_inside_an_observer_capture(tmp_path: Path) -> None:
    """torch.compile runs as it runs without capture; the tracer's fake-tensor calls are counted as
    "(traced)", not recorded; the eager backend's ops are recorded."""

    @torch.compile(backend="eager")
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() + 1).cos()

    x = torch.linspace(-1, 1, 5)
    with capture(nn.Identity(), tmp_path / "c.bundle", mode="summary", progress=False) as cap:
        y = f(x)
    assert torch.equal(y, (x.sin() + 1).cos())
    assert cap.engine == "observer"
    assert [r.key for r in cap.records] == ["/aten.sin#0", "/aten.add#0", "/aten.cos#0"]
    assert cap._recorder.skipped["(traced) aten.sin"] >= 1
    assert not cap._recorder.diagnostics


def test_weights_written_in_place_are_fingerprinted_as_the_block_began(tmp_path: Path) -> None:
    """Weights of 2 MB or more are walked on a background thread; the observer runs that walk to its
    end before the first call that writes in place, as the dispatch mode does."""
    torch.manual_seed(0)
    model = nn.Linear(1024, 1024)  # 4 MB: walked in the background
    before = model.weight.detach().clone()
    x = torch.randn(2, 1024)

    def run(cap: capture) -> None:
        model(x)
        model.weight.add_(1.0)

    with torch.no_grad():
        seen = _capture(tmp_path, "walk", model, run, "observer")
    assert seen._prints.parameters["weight"].sum == pytest.approx(float(before.double().sum()), rel=1e-6, abs=1e-3)
    assert seen.engine == "observer"


@pytest.mark.parametrize("mode", ["summary", "full"])
def test_compiled_blocks_record_only_their_outputs_both_ways(mode: str, tmp_path: Path) -> None:
    """hooks.compiled's blocks run unobserved (the observer pauses as the dispatch mode is disabled):
    each block's output is its module record, and the ops around the blocks are recorded."""
    from hooks.compiled import compile_blocks

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)]), nn.Linear(8, 2))
    blocks = nn.ModuleList(model[1])

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.blocks, self.out = model[0], blocks, model[2]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.relu(self.inp(x))
            for b in self.blocks:
                x = b(x) * 2
            return self.out(x)

    net, _ = compile_blocks(Net(), backend="eager")
    x = torch.randn(3, 8)
    _, seen = _same_records(tmp_path, "compiled", net, lambda cap: net(x), mode=mode)
    keys = [r.key for r in seen.records]
    assert "blocks.0/forward#0" in keys and not any(k.startswith("blocks.0/aten.") for k in keys)
    assert "/aten.relu#0" in keys and "/aten.mul#1" in keys


@pytest.mark.parametrize("mode", ["summary", "full"])
def test_inference_mode_records_the_same(mode: str, tmp_path: Path) -> None:
    """Under torch.inference_mode tensors carry no autograd keys: the calls reach the Python key by
    another route, and the observer still picks the same ones."""
    model, inputs = zoo.BY_NAME["gpt2"].build()

    def run(cap: capture) -> None:
        with torch.inference_mode():
            model(**inputs)

    _, seen = _same_records(tmp_path, "inference", model, run, mode=mode)
    assert len(list(seen.records)) > 20


class _WritesBack(nn.Module):
    """Outputs written in place after they were made, by later ops and by the caller."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        z = y * 2  # queued by the observer, then written in place below
        z.add_(1.0)
        w = torch.relu(z)
        w.mul_(-1.0)  # the relu's output (and the module's) changes after it was recorded
        return w


@pytest.mark.parametrize("hand_bytes", [observer.HAND_BYTES, 1])
def test_full_mode_stores_each_output_as_it_was_made(hand_bytes: int, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The observer queues outputs and the writer thread reads them later: before an op writes in place
    both are settled, so a record's tensor holds its values when its op returned (and handing the queue
    over after every op, ``hand_bytes=1``, stores the same)."""
    monkeypatch.setattr(observer, "HAND_BYTES", hand_bytes)
    torch.manual_seed(0)
    model = _WritesBack()
    x = torch.randn(4, 6)
    with torch.no_grad():
        y = model.lin(x)
    _, seen = _same_records(tmp_path, "back", model, lambda cap: model(x), mode="full")
    b = Bundle.open(seen.bundle_path)
    by_op = {r.key: r for r in b.records}
    assert torch.equal(torch.from_numpy(b.values(by_op["/aten.mul#0"].tensor).copy()), y * 2)
    assert torch.equal(torch.from_numpy(b.values(by_op["/aten.add_#0"].tensor).copy()), y * 2 + 1)
    assert torch.equal(torch.from_numpy(b.values(by_op["/aten.relu#0"].tensor).copy()), torch.relu(y * 2 + 1))
    assert torch.equal(torch.from_numpy(b.values(by_op["/forward#0"].tensor).copy()), -torch.relu(y * 2 + 1))


def test_full_mode_stores_a_module_output_once(tmp_path: Path) -> None:
    """A module's output that is its last op's output (or a reshaped alias of it) names that op's tensor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.ReLU())
    x = torch.randn(2, 3, 8)  # a bias-free Linear on 3-d input: mm, then an _unsafe_view as the module output
    _, seen = _same_records(tmp_path, "once", model, lambda cap: model(x), mode="full")
    records = {r.key: r for r in seen.records}
    assert records["0/forward#0"].tensor == records["0/aten.mm#0"].tensor
    assert records["1/forward#0"].tensor == records["1/aten.relu#0"].tensor == records["/forward#0"].tensor
    assert len(Bundle.open(seen.bundle_path).tensors) == len({r.tensor for r in seen.records})


class _ManyOutputs(nn.Module):
    """More summarised outputs than the observer keeps rows for between in-place writes (4,097), each
    module output the view of its last op's output, so row reuse is asked for past the table's clear."""

    def __init__(self) -> None:
        super().__init__()
        self.cells = nn.ModuleList(nn.Identity() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for i in range(4500):
            y = (x + i).view(-1)
            out = self.cells[i % 3](y) if i % 7 == 0 else out
        return out


@pytest.mark.parametrize("mode", ["summary", "full"])
def test_more_rows_than_the_observer_table_holds_record_the_same(mode: str, tmp_path: Path) -> None:
    model = _ManyOutputs()
    x = torch.arange(6.0).reshape(2, 3)
    _, seen = _same_records(tmp_path, "many", model, lambda cap: model(x), mode=mode)
    assert sum(r.op == "aten.add" for r in seen.records) == 4500


class _Huge(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def test_the_sample_of_a_huge_output_ends_at_its_last_element(tmp_path: Path) -> None:
    """n = 2**24 + 4: float32 ``linspace`` puts the last sample point at ``n``, one past the end."""
    model, x = _Huge(), torch.arange((1 << 24) + 4, dtype=torch.int32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the observer summarises it in C++, not the Python path's parallel row
    try:
        _, seen = _same_records(tmp_path, "huge", model, lambda cap: model(x))
    finally:
        torch.set_num_threads(threads)
    rec = next(r for r in seen.records if r.op == "aten.add")
    assert rec.stats is not None and rec.stats.sample[-1] == x.numel()  # x[-1] + 1


@pytest.mark.parametrize("mode", ["summary", "full"])
@pytest.mark.parametrize("name", ["odd", "mixed"])  # complex outputs; module outputs the wrappers hand over
def test_drains_deferred_inside_the_forward_record_the_same(name: str, mode: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA rows defer every drain inside the forward (an op or module output handed to Python) to the
    capture's end; DEFER_ALL takes that path with CPU rows: the same records, in the same order."""
    from hooks.record_log import RecordLog

    monkeypatch.setattr(observer, "DEFER_ALL", True)
    reserved: list[int] = []
    real = RecordLog.reserve
    monkeypatch.setattr(RecordLog, "reserve", lambda log, count: reserved.append(count) or real(log, count))
    torch.manual_seed(0)
    if name == "odd":
        model, img, x = _Odd(), torch.randn(2, 3, 8, 8), torch.randn(5, 6)
        _same_records(tmp_path, name, model, lambda cap: model(img, x), mode=mode)
    else:
        from test_observer_modules import _Mixed

        mixed, v = _Mixed(), torch.randn(2, 4)
        _same_records(tmp_path, name, mixed, lambda cap: mixed(v), mode=mode)
    assert reserved and all(reserved), "no drain inside the forward was deferred"


def test_records_held_by_the_observer_are_read_after_the_capture(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(observer, "DEFER_ALL", True)
    monkeypatch.setenv("OPBAND_OBSERVER", "1")
    model, img, x = _Odd(), torch.randn(2, 3, 8, 8), torch.randn(5, 6)
    with capture(model, tmp_path / "b.bundle", level="aten", mode="summary", progress=False) as cap:
        model(img, x)
        with pytest.raises(RuntimeError, match="read them after the capture"):
            list(cap.records)
    assert cap.engine == "observer" and len(list(cap.records)) > 10
