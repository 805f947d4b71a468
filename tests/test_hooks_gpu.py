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
