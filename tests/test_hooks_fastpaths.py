"""Capture's fast paths give what the general paths give: records built without validation, tensor
leaves without a pytree walk, and a dispatch handler that TorchDynamo skips without a wrapper."""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_leaves

import hooks.modes
from accuracy.bundle import Bundle
from accuracy.manifest import Manifest, Record
from hooks import capture, demo_model
from hooks.tensors import fast_leaves

Pair = namedtuple("Pair", "a b")


def test_records_built_without_validation_are_what_validation_makes(tmp_path: Path) -> None:
    model, inputs = demo_model.build()
    for level in ("aten", "module", "api"):
        for mode in ("summary", "full"):
            with torch.no_grad(), capture(model, tmp_path / f"{level}-{mode}.bundle", level=level, mode=mode,
                                          progress=False) as cap:
                model(*inputs)
            records = list(cap.records)
            assert len(records) > 3 and all(type(r) is Record for r in records)
            for r in records:
                again = Record.model_validate(r.model_dump())
                assert again == r and again.model_dump_json() == r.model_dump_json()
            manifest = Bundle.open(cap.bundle_path).manifest
            assert not manifest.diagnostics
            dumped = manifest.model_dump_json(exclude_none=True)
            assert Manifest.model_validate_json(dumped).model_dump_json(exclude_none=True) == dumped
            stats = [r.stats for r in records if r.stats is not None]
            assert stats and all(s.numel > 0 and isinstance(s.numel, int) and isinstance(s.mean, float) for s in stats)


def test_a_record_of_the_user_is_validated(tmp_path: Path) -> None:
    model, inputs = demo_model.build()
    with torch.no_grad(), capture(model, tmp_path / "u.bundle", level="module", mode="summary",
                                  progress=False) as cap:
        model(*inputs)
        cap.record_tensor("optimizer", "update", torch.ones(3), kind="not-a-kind")
    rec = cap._recorder
    assert rec is not None and not rec.trusted
    assert any("manifest validation" in d.message and "kind" in d.message for d in rec.diagnostics)


def test_a_key_too_long_is_said_and_the_capture_ends(tmp_path: Path) -> None:
    """Keys over 4096 characters fail validation as before: a diagnostic, and no error at exit."""
    model = torch.nn.Sequential()
    model.add_module("m" * 5000, torch.nn.Linear(4, 4))
    model.add_module("short", torch.nn.ReLU())
    with torch.no_grad(), capture(model, tmp_path / "l.bundle", level="aten", mode="summary",
                                  progress=False) as cap:
        model(torch.ones(2, 4))
    rec = cap._recorder
    assert rec is not None and cap.bundle_path is not None
    assert any("manifest validation" in d.message and "4096" in d.message for d in rec.diagnostics)
    assert len(list(cap.records)) > 3


def test_fast_leaves_are_tree_leaves() -> None:
    t, u = torch.ones(2), torch.zeros(3)
    p = torch.nn.Parameter(torch.ones(1))
    trees = [t, (t, u), [t, 1, None, "x", 2.5, torch.float32], (t, [u, t]), (t, {"k": u}), Pair(t, u), (p, t),
             {"a": t, "b": (u,)}, (), [None], (t, Pair(u, 3))]
    for tree in trees:
        expected = [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]
        got = fast_leaves(tree)
        assert len(got) == len(expected) and all(a is b for a, b in zip(got, expected, strict=True)), tree


def test_torch_compile_inside_an_aten_capture_leaves_the_handler_alone(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatch mode's handler is marked for TorchDynamo to skip (no ``_disable_dynamo`` wrapper
    on each call): a compiled function called inside the capture runs eagerly, op by op, and compiles
    nothing. (The compiled observer has no handler: see test_observer.py for compile under it.)"""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("OPBAND_OBSERVER", "0")
    assert hooks.modes.AtenMode.__torch_dispatch__.__code__.co_filename == hooks.modes.__file__

    @torch.compile(backend="eager")
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() + 1).cos()

    counters.clear()
    x = torch.linspace(-1, 1, 5)
    with capture(torch.nn.Identity(), tmp_path / "c.bundle", level="aten", mode="summary", progress=False) as cap:
        y = f(x)
    assert torch.equal(y, (x.sin() + 1).cos())
    assert [r.key for r in cap.records] == ["/aten.sin#0", "/aten.add#0", "/aten.cos#0"]
    assert not counters["frames"] and not counters["stats"].get("unique_graphs")
