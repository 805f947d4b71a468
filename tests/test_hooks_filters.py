"""Filters and modes: module/op globs, byte budget, step selection, op inputs, gradients, progress."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from accuracy.bundle import Bundle
from hooks import capture, demo_model


@pytest.fixture()
def demo() -> tuple[torch.nn.Module, torch.Tensor]:
    model, (ids,) = demo_model.build()
    return model, ids


def _run(tmp_path: Path, demo: tuple[torch.nn.Module, torch.Tensor], name: str = "b", **opts: object) -> Bundle:
    model, ids = demo
    opts.setdefault("progress", False)
    with torch.no_grad(), capture(model, tmp_path / f"{name}.bundle", **opts) as cap:
        model(ids)
    return Bundle.open(cap.bundle_path)


def test_module_and_op_globs(tmp_path: Path, demo: tuple) -> None:
    full = _run(tmp_path, demo, "all")
    mlp = _run(tmp_path, demo, "mlp", modules=["model.layers.*.mlp*"], ops=["aten.mm", "forward"])
    assert mlp.records
    assert all(r.module.startswith("model.layers.") and ".mlp" in r.module for r in mlp.records)
    assert {r.op for r in mlp.records} == {"aten.mm", "forward"}
    # keys of a filtered capture are the keys of the full one (ordinals count filtered calls too)
    assert {r.id for r in mlp.records} <= {r.id for r in full.records}
    for r in mlp.records:
        np.testing.assert_array_equal(mlp.values(r.tensor), full.values(full.record(r.id).tensor))


def test_byte_budget_keeps_summaries(tmp_path: Path, demo: tuple) -> None:
    b = _run(tmp_path, demo, max_bytes=200_000)
    stored = sum(info.nbytes for info in b.tensors.values())
    assert 0 < stored <= 200_000
    assert all(r.stats is not None for r in b.records if r.shape and np.prod(r.shape) > 0)
    assert any(r.tensor is None for r in b.records)
    assert b.manifest.skipped_ops["(over byte budget)"] > 0


def test_summary_mode_stores_no_tensors(tmp_path: Path, demo: tuple) -> None:
    b = _run(tmp_path, demo, mode="summary")
    assert not b.tensors and all(r.tensor is None and r.stats is not None for r in b.records)
    assert all(len(r.stats.sample) == min(16, r.stats.numel) for r in b.records)


def test_step_selection(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    outs = []
    with capture(model, tmp_path / "s.bundle", level="module", steps=[0, 2], progress=False) as cap:
        for _ in range(3):
            out = model(x)
            outs.append(out.detach().clone())
            out.sum().backward()
            opt.step()
            opt.zero_grad()
            cap.step()
    b = Bundle.open(cap.bundle_path)
    root = [r for r in b.records if r.module == ""]
    assert [r.step for r in root] == [0, 2]
    assert [r.id for r in root] == ["/forward#0", "/forward#1"]
    np.testing.assert_array_equal(b.values(root[1].tensor), outs[2].numpy())
    assert b.manifest.run["steps"] == {"selected": [0, 2], "seen": 4}


def test_inputs_are_stored_and_referenced(tmp_path: Path, demo: tuple) -> None:
    b = _run(tmp_path, demo, inputs=True)
    calls = b.manifest.run["calls"]
    mm = next(r for r in b.records if r.op == "aten.mm")
    assert calls[mm.key]["target"] == "aten.mm.default"
    assert len(mm.input_tensors) == 2 and all(n in b.tensors for n in mm.input_tensors)
    a, w = (b.values(n) for n in mm.input_tensors)
    np.testing.assert_allclose(a @ w, b.values(mm.tensor), rtol=1e-5, atol=1e-5)
    add = next(r for r in b.records if r.op == "aten.add" and r.key in calls)
    assert calls[add.key]["args"][0] == {"$t": 0}


def test_inputs_need_aten_level() -> None:
    with pytest.raises(ValueError, match="needs level='aten'"):
        capture(torch.nn.Linear(2, 2), "x.bundle", level="module", inputs=True)


def test_backward_gradients(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    x = torch.randn(5, 4)
    with capture(model, tmp_path / "g.bundle", level="aten", backward=True, progress=False) as cap:
        model(x).sum().backward()
    b = Bundle.open(cap.bundle_path)
    grads = {r.id: r for r in b.records if r.kind == "grad"}
    assert {"2/backward#0", "1/backward#0", "0/backward#0", "0/grad.weight#0", "2/grad.bias#0"} <= set(grads)
    np.testing.assert_array_equal(b.values(grads["0/grad.weight#0"].tensor), model[0].weight.grad.numpy())
    np.testing.assert_array_equal(b.values(grads["2/backward#0"].tensor), np.ones((5, 1), np.float32))
    assert any(k.startswith("(backward) ") for k in b.manifest.skipped_ops)  # backward ATen ops not as forward ops
    assert not [r for r in b.records if r.kind == "aten" and r.module == "" and r.op == "aten.mm"]


def test_progress_on_stderr_when_asked(tmp_path: Path, demo: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    _run(tmp_path, demo, "p", progress=True)
    assert "opband capture:" in err.getvalue() and "ops seen" in err.getvalue() and "MB written" in err.getvalue()
    quiet = io.StringIO()
    monkeypatch.setattr(sys, "stderr", quiet)
    _run(tmp_path, demo, "q", progress=None)  # not a TTY: quiet
    assert quiet.getvalue() == ""


def test_bad_options_are_refused() -> None:
    model = torch.nn.Linear(2, 2)
    for opts, msg in (({"level": "x"}, "level must be"), ({"mode": "x"}, "mode must be"),
                      ({"steps": [-1]}, "steps must be"), ({"buffer_bytes": 0}, "buffer_bytes")):
        with pytest.raises(ValueError, match=msg):
            capture(model, "x.bundle", **opts)


def test_api_level_records_functional_calls(tmp_path: Path, demo: tuple) -> None:
    b = _run(tmp_path, demo, level="api")
    ops = {r.op for r in b.records if r.kind == "api"}
    assert "torch.nn.functional.linear" in ops and "torch.softmax" in ops
    assert "model.layers.0.mlp.down_proj/torch.nn.functional.linear#0" in {r.id for r in b.records}
    assert not any(op.endswith((".view", ".transpose", "__getitem__")) for op in ops)
