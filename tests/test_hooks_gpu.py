"""GPU-only checks (skip cleanly without CUDA): summary capture makes no host sync per op."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from accuracy.bundle import Bundle
from hooks import capture, demo_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_summary_capture_never_syncs_inside_the_forward(tmp_path: Path) -> None:
    model, (ids,) = demo_model.build()
    model, ids = model.cuda(), ids.cuda()
    with torch.no_grad():
        model(ids)
        torch.cuda.synchronize()
        with capture(model, tmp_path / "g.bundle", mode="summary", progress=False) as cap:
            torch.cuda.set_sync_debug_mode("error")  # any synchronizing call inside raises
            try:
                model(ids)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    b = Bundle.open(cap.bundle_path)
    assert b.records and all(r.stats is not None for r in b.records if r.shape)
    assert not b.manifest.diagnostics, b.manifest.diagnostics[:3]


def test_full_capture_on_gpu_matches_cpu_values(tmp_path: Path) -> None:
    model, (ids,) = demo_model.build()
    with torch.no_grad(), capture(model.cuda(), tmp_path / "f.bundle", level="module", progress=False,
                                  buffer_bytes=1 << 20) as cap:
        out = model(ids.cuda())
    b = Bundle.open(cap.bundle_path)
    torch.testing.assert_close(torch.from_numpy(b.values(b.record("/forward#0").tensor).copy()), out.cpu())


def test_device_stats_on_cuda_match_float64_formulas() -> None:
    """The Triton kernels compiled for the GPU (``hooks.triton_stats``; CI runs them interpreted) and the
    torch-ops path for the other dtypes: the float64 definitions on every case of the CPU tests."""
    from test_hooks_stats import CASES, _check, reference

    from hooks import tensors

    for name, x in CASES:
        got = tensors._row_dict(tensors.device_stats(x.cuda()).tolist())
        _check(got, reference(x), name, 2e-5 if x.dtype != torch.float64 else 1e-12,
               sums=name not in ("huge", "huge-nan", "finfo-min-mask"))  # float32 rows cannot hold their L2
    assert tensors._TRITON_BROKEN is None, tensors._TRITON_BROKEN


class _InPlace(torch.nn.Module):
    """An output written in place right after it is made: its side-stream copy must hold the values
    before the write (the in-place op's stream waits for the copy on the device)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        y.mul_(-1.0).relu_()
        return y * 2.0


def test_full_capture_on_cuda_copies_on_a_side_stream_without_a_sync(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = _InPlace().cuda(), torch.randn(64, 256, device="cuda")
    with torch.no_grad():
        want = model.lin(x)
        torch.cuda.synchronize()
        with capture(model, tmp_path / "f.bundle", mode="full", progress=False, buffer_bytes=1 << 16) as cap:
            torch.cuda.set_sync_debug_mode("error")  # neither the copies nor the hand-over to the writer syncs
            try:
                out = model(x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    assert cap.engine.startswith("dispatch mode")
    rec = cap._recorder
    assert rec.side_copies and not rec.diagnostics, rec.diagnostics[:3]
    b = Bundle.open(cap.bundle_path)
    assert b.manifest.run["side_copies"]["devices"] == ["cuda:0"]
    mm = next(r for r in b.records if r.op in ("aten.addmm", "aten.linear"))
    torch.testing.assert_close(torch.from_numpy(b.values(mm.tensor).copy()).reshape(want.shape), want.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(torch.from_numpy(b.values(b.record("/forward#0").tensor).copy()), out.cpu())
