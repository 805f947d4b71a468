"""A CUDA graph captured or replayed inside a capture is refused with a sentence, never recorded as nothing.

On a CPU build of torch ``torch.cuda.CUDAGraph`` is the real class over a placeholder base, so the
refusal is checked through the class's own methods there; the CUDA tests replay and capture real
graphs (``benchmarks/gpu_session.sh`` runs them on a lent GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from accuracy.bundle import Bundle
from hooks import capture, demo_model
from hooks.cudagraphs import CudaGraphRefused

ORIGINAL = {(cls, name): cls.__dict__[name] for cls, name in
            ((torch.cuda.CUDAGraph, "replay"), (torch.cuda.CUDAGraph, "capture_begin"), (torch.cuda.graph, "__enter__"))}


def _now() -> dict[tuple[type, str], object]:
    return {(cls, name): cls.__dict__[name] for cls, name in ORIGINAL}


def _graph() -> torch.cuda.CUDAGraph:
    """A CUDAGraph object without a device (its placeholder base refuses to construct on a CPU build)."""
    return torch.cuda.CUDAGraph() if torch.cuda.is_available() else object.__new__(torch.cuda.CUDAGraph)


def test_a_replay_inside_a_capture_raises_a_sentence_and_the_bundle_says_so(tmp_path: Path) -> None:
    model, (ids,) = demo_model.build()
    g = _graph()
    with pytest.raises(CudaGraphRefused) as e, torch.no_grad(), \
            capture(model, tmp_path / "g.bundle", progress=False) as cap:
        model(ids)
        g.replay()
    text = str(e.value)
    assert "replayed inside an opband capture" in text and "none of its ops would be recorded" in text
    assert "run the model eagerly" in text and "reduce-overhead" in text
    b = Bundle.open(cap.bundle_path)  # what ran before the replay is kept, and the refusal is in the manifest
    assert b.records
    assert any("CudaGraphRefused" in d.message for d in b.manifest.diagnostics)
    assert _now() == ORIGINAL


def test_capturing_a_graph_inside_a_capture_is_refused(tmp_path: Path) -> None:
    model, _ = demo_model.build()
    for begin in (lambda: _graph().capture_begin(), lambda: torch.cuda.graph.__enter__(object.__new__(torch.cuda.graph))):
        with pytest.raises(CudaGraphRefused, match="captured inside an opband capture: opband's own statistics"), \
                torch.no_grad(), capture(model, tmp_path / "c.bundle", progress=False):
            begin()
    assert _now() == ORIGINAL


def test_nested_captures_restore_the_graph_methods_once_the_last_one_ends(tmp_path: Path) -> None:
    model, (ids,) = demo_model.build()
    with torch.no_grad(), capture(model, tmp_path / "a.bundle", level="module", progress=False):
        with capture(model, tmp_path / "b.bundle", level="module", progress=False):
            model(ids)
        assert torch.cuda.CUDAGraph.__dict__["replay"] is not ORIGINAL[torch.cuda.CUDAGraph, "replay"]  # the outer one still refuses
        with pytest.raises(CudaGraphRefused):
            _graph().replay()
    assert _now() == ORIGINAL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_graph_of_the_model_is_refused_on_cuda_and_runs_again_after(tmp_path: Path) -> None:
    model, (ids,) = demo_model.build()
    model, ids = model.cuda(), ids.cuda()
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(ids)  # warm-up off the default stream, as torch.cuda.graph asks
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = model(ids)
        with pytest.raises(CudaGraphRefused, match="replayed"), capture(model, tmp_path / "r.bundle", progress=False):
            g.replay()
        stream = torch.cuda.current_stream()
        with pytest.raises(CudaGraphRefused, match="captured"), capture(model, tmp_path / "c.bundle", progress=False):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                model(ids)
        assert torch.cuda.current_stream() == stream  # refused before it switched streams
        g.replay()  # outside a capture the graph runs as before
        torch.cuda.synchronize()
        torch.testing.assert_close(out, model(ids))
