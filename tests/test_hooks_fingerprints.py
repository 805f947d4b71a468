"""Parameter fingerprints walked on a background thread during an ``aten`` capture (issue 14): the same
prints as the synchronous walk, and the weights as they were when the capture began, whatever the
captured block writes into them."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from accuracy.bundle import Bundle
from hooks import capture
from hooks.fingerprints import BACKGROUND_CHUNK_BYTES, ParameterPrints, parameter_prints


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
