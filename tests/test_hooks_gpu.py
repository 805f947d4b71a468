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
