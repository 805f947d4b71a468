"""The compiled observer on CUDA (hooks/native/stats_cuda.cu): rows against float64 formulas, the same records
as the dispatch mode on the zoo, no host sync inside the forward. GPU-only: these run in
benchmarks/gpu_session.sh on a lent GPU (after ``setup.py build_ext --inplace`` there) and skip without CUDA.
Where the observer was built without CUDA on a CUDA machine, the first test fails and says how to build it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import zoo
from hooks import capture, observer
from hooks.tensors import _sample_index, device_stats, torch_device_stats
from hooks.variants import apply_variant
from test_observer import _same_records

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _compiled() -> Any:
    module = observer._observer
    if module is None or not getattr(module, "CUDA", False):
        pytest.skip("hooks._observer was built without CUDA (test_the_observer_is_built_with_cuda says why)")
    return module


def test_the_observer_is_built_with_cuda() -> None:
    assert observer._observer is not None, observer._MISSING
    assert observer._observer.CUDA, ("hooks._observer has no CUDA path: build it where torch has CUDA and nvcc is "
                                     "found (`python setup.py build_ext --inplace`, or `pip install --no-build-isolation -e .`)")


def _values(n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    if dtype == torch.bool:
        return (torch.rand(n, generator=g) > 0.3).cuda()
    if not dtype.is_floating_point:
        return torch.randint(-100 if dtype != torch.uint8 else 0, 100, (n,), generator=g).to(dtype).cuda()
    x = torch.randn(n, generator=g, dtype=torch.float64) * 3 + 0.5
    x[:: max(n // 7, 1)] = 0.0
    if n > 10:
        x[3], x[n // 2], x[-2] = math.nan, math.inf, -math.inf
    return x.to(dtype).cuda()


def _reference(x: torch.Tensor) -> list[float]:
    """The row's fields in float64 from the float32 values the kernel reads (hooks.triton_stats's row)."""
    v = x.reshape(-1).cpu().to(torch.float32).to(torch.float64)
    fin = v[torch.isfinite(v)]
    lo, hi = (fin.min().item(), fin.max().item()) if fin.numel() else (math.inf, -math.inf)
    mean = fin.mean().item() if fin.numel() else 0.0
    std = (fin - mean).square().mean().sqrt().item() if fin.numel() else 0.0
    return [float(v.numel()), lo, hi, mean, std, fin.square().sum().sqrt().item(), max(-lo, hi),
            float(torch.isnan(v).sum()), float(torch.isinf(v).sum()), float((v == 0).sum())]


@pytest.mark.parametrize("n", [1, 1000, 2048 * 16, 2048 * 16 + 1, 3_000_001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.uint8, torch.bool])
def test_compiled_rows_match_float64_formulas(n: int, dtype: torch.dtype) -> None:
    module = _compiled()
    x = _values(n, dtype)
    idx = _sample_index(n, x.device)
    row = module.cuda_stats_row(x, idx, 16)
    again = module.cuda_stats_row(x, idx, 16)
    assert torch.equal(row, again), "the same tensor gave other bits"
    got, want = row.cpu().double().tolist(), _reference(x)
    for i in (0, 1, 2, 6, 7, 8, 9):  # exact: numel, min, max, absmax, the counts
        assert got[i] == want[i], (i, got, want)
    for i in (3, 4, 5):  # float32 within a tile, float64 across
        assert got[i] == pytest.approx(want[i], rel=2e-5, abs=1e-6), (i, got[i], want[i])
    sample = x.reshape(-1)[idx].cpu().to(torch.float32).double().tolist()
    assert all(a == b or (a != a and b != b) for a, b in zip(got[10:10 + len(sample)], sample, strict=True))
    assert got[10 + len(sample):] == [0.0] * (16 - len(sample))
    close = torch_device_stats(x).cpu().double()  # the torch ops' row agrees to float32 rounding
    torch.testing.assert_close(row.cpu().double()[:10].nan_to_num(), close[:10].nan_to_num(), rtol=1e-4, atol=1e-5)


def test_strided_and_offset_tensors_read_their_own_elements() -> None:
    module = _compiled()
    base = _values(300 * 257, torch.float32).reshape(300, 257)
    for view in (base.t(), base[1:, ::3], base[:, 5], base.expand(2, 300, 257)):
        idx = _sample_index(view.numel(), view.device)
        assert torch.equal(module.cuda_stats_row(view, idx, 16), module.cuda_stats_row(view.contiguous(), idx, 16))


def test_device_stats_take_the_compiled_kernel() -> None:
    module = _compiled()
    x = _values(5000, torch.bfloat16)
    assert torch.equal(device_stats(x), module.cuda_stats_row(x, _sample_index(x.numel(), x.device), 16))


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert", "t5", "resnet"])
def test_zoo_models_on_cuda_record_the_same(name: str, tmp_path: Path) -> None:
    _compiled()
    model, inputs = zoo.BY_NAME[name].build()
    model = model.cuda()
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with torch.no_grad():
        mode, seen = _same_records(tmp_path, name, model, lambda cap: model(**inputs))
    assert len(list(seen.records)) > 20


@pytest.mark.parametrize("variant", ["bf16", "fp16"])
def test_low_precision_on_cuda_records_the_same(variant: str, tmp_path: Path) -> None:
    _compiled()
    model, inputs = zoo.BY_NAME["llama"].build()
    model, inputs, _ = apply_variant(model, inputs, variant, "cuda")
    with torch.no_grad():
        _same_records(tmp_path, variant, model, lambda cap: model(**inputs))


def test_the_observer_never_syncs_inside_the_forward(tmp_path: Path) -> None:
    _compiled()
    model, inputs = zoo.BY_NAME["llama"].build()
    model = model.cuda()
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with torch.no_grad():
        model(**inputs)
        torch.cuda.synchronize()
        with capture(model, tmp_path / "s.bundle", mode="summary", progress=False) as cap:
            torch.cuda.set_sync_debug_mode("error")  # any synchronizing call inside raises
            try:
                model(**inputs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    assert cap.engine == "observer"
    assert all(r.stats is not None for r in cap.records if r.shape and math.prod(r.shape))
    assert not cap._recorder.diagnostics


def test_full_mode_on_cuda_takes_the_dispatch_mode(tmp_path: Path) -> None:
    _compiled()
    model = torch.nn.Linear(4, 4).cuda()
    with torch.no_grad(), capture(model, tmp_path / "f.bundle", mode="full", progress=False) as cap:
        model(torch.randn(2, 4, device="cuda"))
    assert cap.engine == "dispatch mode (full captures of CUDA models take the dispatch mode)"


class _SideStreams(torch.nn.Module):
    """Ops on the default stream and on a side stream (rows launched on each, the same sizes: a sample index
    per stream), and a complex output handed to Python inside the forward (a deferred drain)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.side = torch.cuda.Stream()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x).relu()
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            z = (self.lin(x) * 2).tanh()
            spectrum = torch.fft.rfft(z)  # complex64: the recorder's own path
        torch.cuda.current_stream().wait_stream(self.side)
        return y + z + spectrum.real.sum()


def test_side_streams_and_handed_over_outputs_record_the_same_without_a_sync(tmp_path: Path) -> None:
    _compiled()
    torch.manual_seed(0)
    model, x = _SideStreams().cuda(), torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        _same_records(tmp_path, "streams", model, lambda cap: model(x))
        torch.cuda.synchronize()
        with capture(model, tmp_path / "s.bundle", mode="summary", progress=False) as cap:
            torch.cuda.set_sync_debug_mode("error")  # the drain for the complex output waits for nothing
            try:
                model(x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    assert cap.engine == "observer" and not cap._recorder.diagnostics
    assert any(r.qparams and r.qparams.get("complex") for r in cap.records)


@pytest.mark.parametrize("stats", ["triton", "torch"])
def test_other_device_statistics_take_the_dispatch_mode(stats: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The observer has the compiled kernel only: asking for another keeps both engines' bits equal."""
    _compiled()
    monkeypatch.setenv("OPBAND_DEVICE_STATS", stats)
    model = torch.nn.Linear(4, 4).cuda()
    with torch.no_grad(), capture(model, tmp_path / "s.bundle", mode="summary", progress=False) as cap:
        model(torch.randn(2, 4, device="cuda"))
    assert cap.engine.startswith("dispatch mode") and f"OPBAND_DEVICE_STATS={stats}" in cap.engine
