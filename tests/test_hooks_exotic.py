"""Exotic values never crash the user's run: each becomes a record or a diagnostic with a reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from accuracy.bundle import Bundle
from hooks import capture
from hooks.tensors import device_stats, host_stats


class Fn(nn.Module):
    """A module whose forward is any function, so one test can return any kind of value."""

    def __init__(self, fn: object) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: object) -> object:
        return self.fn(*args)  # type: ignore[operator]


def _capture(tmp_path: Path, fn: object, *args: object, **opts: object) -> tuple[object, Bundle]:
    model = Fn(fn)
    opts.setdefault("progress", False)
    with capture(model, tmp_path / "b.bundle", **opts) as cap:
        out = model(*args)
    assert cap.bundle_path is not None
    return out, Bundle.open(cap.bundle_path)


def _by_id(bundle: Bundle) -> dict[str, object]:
    return {r.id: r for r in bundle.records}


def test_nested_outputs(tmp_path: Path) -> None:
    x = torch.randn(3)
    out, b = _capture(tmp_path, lambda x: {"a": (x * 2, [x + 1, {"b": x - 1}]), "n": 3, "s": "text"}, x, level="module")
    recs = [r for r in b.records if r.op == "forward"]
    assert [r.output for r in recs] == [0, 1, 2]
    np.testing.assert_array_equal(b.values(recs[0].tensor), (x * 2).numpy())
    np.testing.assert_array_equal(b.values(recs[2].tensor), (x - 1).numpy())


def test_inplace_and_out_ops(tmp_path: Path) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y.add_(1)
        buf = torch.empty(3)
        torch.mul(y, 2, out=buf)
        y.mul_(10)  # later in-place change must not alter what was recorded for add_
        return buf

    x = torch.arange(3.0)
    _, b = _capture(tmp_path, f, x, inputs=True)
    recs = _by_id(b)
    np.testing.assert_array_equal(b.values(recs["/aten.add_#0"].tensor), [1, 2, 3])
    np.testing.assert_array_equal(b.values(recs["/aten.mul#0"].tensor), [2, 4, 6])
    np.testing.assert_array_equal(b.values(recs["/aten.mul_#0"].tensor), [10, 20, 30])
    add_in = recs["/aten.add_#0"].input_tensors
    np.testing.assert_array_equal(b.values(add_in[0]), [0, 1, 2])  # input as it was before add_


def test_integer_bool_complex_outputs(tmp_path: Path) -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.long(), x > 1, torch.complex(x, -x), x.to(torch.int8)

    x = torch.arange(4.0)
    _, b = _capture(tmp_path, f, x, level="module")
    recs = [r for r in b.records if r.op == "forward"]
    assert [r.dtype for r in recs] == ["int64", "bool", "float32", "int8"]
    np.testing.assert_array_equal(b.values(recs[1].tensor), [False, False, True, True])
    cplx = recs[2]
    assert cplx.qparams == {"complex": "complex64", "layout": "view_as_real"}
    assert cplx.shape == [4, 2]
    np.testing.assert_array_equal(b.values(cplx.tensor), np.stack([x.numpy(), -x.numpy()], -1))
    assert recs[1].stats is not None and recs[1].stats.mean == 0.5


def test_conjugated_complex_view(tmp_path: Path) -> None:
    z = torch.complex(torch.ones(2), torch.ones(2)).conj()  # conj bit set, no copy
    _, b = _capture(tmp_path, lambda z: z, z, level="module")
    (rec,) = b.records
    np.testing.assert_array_equal(b.values(rec.tensor), [[1, -1], [1, -1]])


def test_zero_dim_empty_and_non_contiguous(tmp_path: Path) -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.sum(), x[:0], x.t(), x[:, ::2]

    x = torch.arange(12.0).reshape(3, 4)
    _, b = _capture(tmp_path, f, x, level="module")
    scalar, empty, transposed, strided = [r for r in b.records if r.op == "forward"]
    assert scalar.shape == [] and float(b.values(scalar.tensor)) == 66.0
    assert empty.shape == [0, 4] and empty.stats is None
    np.testing.assert_array_equal(b.values(transposed.tensor), x.t().numpy())
    np.testing.assert_array_equal(b.values(strided.tensor), x[:, ::2].numpy())
    assert strided.stats is not None and strided.stats.numel == 6


def test_quantized_tensor_dequantized_with_qparams(tmp_path: Path) -> None:
    q = torch.quantize_per_tensor(torch.tensor([0.0, 0.5, 1.0]), scale=0.1, zero_point=3, dtype=torch.qint8)
    qc = torch.quantize_per_channel(torch.ones(2, 2), torch.tensor([0.1, 0.2]), torch.tensor([0, 1]), 0, torch.quint8)
    _, b = _capture(tmp_path, lambda q, qc: (q, qc), q, qc, level="module")
    per_tensor, per_channel = b.records
    assert per_tensor.dtype == "qint8" and per_tensor.qparams["scale"] == pytest.approx(0.1)
    assert per_tensor.qparams["zero_point"] == 3
    np.testing.assert_allclose(b.values(per_tensor.tensor), q.dequantize().numpy())
    assert per_channel.qparams["axis"] == 0 and per_channel.qparams["scales"] == pytest.approx([0.1, 0.2])


@pytest.mark.parametrize("kind", ["sparse", "nested", "meta"])
def test_unsupported_layouts_are_skipped_with_reason(kind: str, tmp_path: Path) -> None:
    make = {
        "sparse": lambda: torch.eye(3).to_sparse(),
        "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        "meta": lambda: torch.empty(4, device="meta"),
    }[kind]
    value = make()
    out, b = _capture(tmp_path, lambda v: (v, torch.ones(1)), value, level="module")
    assert out[0] is value
    assert [r.output for r in b.records] == [1]  # the plain tensor next to it is still recorded
    (diag,) = b.manifest.diagnostics
    assert diag.key == "/forward#0" and diag.message.startswith("skipped:")


def test_sparse_ops_at_aten_level_do_not_crash(tmp_path: Path) -> None:
    s = torch.eye(3).to_sparse()
    dense = torch.ones(3, 2)
    out, b = _capture(tmp_path, lambda s: torch.sparse.mm(s, dense) + 1, s, inputs=True)
    np.testing.assert_array_equal(out.numpy(), (dense + 1).numpy())
    assert "/aten.add#0" in _by_id(b)  # dense ops recorded; sparse values are diagnostics, not crashes
    assert all(d.message.startswith(("skipped:", "not replayable")) for d in b.manifest.diagnostics)


def test_autocast_no_grad_inference_mode(tmp_path: Path) -> None:
    lin = nn.Linear(8, 4)
    x = torch.randn(2, 8)
    for ctx in (torch.no_grad(), torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16)):
        with ctx:
            expected = lin(x)
            with capture(lin, tmp_path / "a.bundle", progress=False) as cap:
                got = lin(x)
        assert torch.equal(expected, got)
        b = Bundle.open(cap.bundle_path)
        fwd = b.record("/forward#0")
        assert fwd.dtype == str(expected.dtype).removeprefix("torch.")
        assert any(r.kind == "aten" for r in b.records)


def test_failing_recorder_becomes_diagnostic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hooks.recorder as recorder

    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("disk on fire")

    monkeypatch.setenv("OPBAND_OBSERVER", "0")  # the dispatch mode's recorder (the observer's: below)
    monkeypatch.setattr(recorder, "plain_payload", boom)  # the plain-tensor fast path
    monkeypatch.setattr(recorder, "stored_payload", boom)
    x = torch.ones(3)
    out, b = _capture(tmp_path, lambda x: x * 2, x)
    assert torch.equal(out, x * 2)
    assert not b.records
    assert any("disk on fire" in d.message for d in b.manifest.diagnostics)


@pytest.mark.parametrize("how", ["raises", "refuses"])
def test_failing_tensor_store_under_the_observer_keeps_the_statistics(how: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Full mode under the compiled observer: a tensor the recorder fails to store (the hand-over raises,
    or the writer refuses that one tensor) is a diagnostic, and the records that would name it (the op's
    and the module output that is the same tensor) keep their statistics; the others are stored, and
    the bundle opens."""
    from hooks import observer
    from hooks.recorder import Recorder

    real = Recorder.write_stored
    monkeypatch.setattr(observer, "HAND_BYTES", 1)  # each op's tensor is handed over on its own

    def flaky(self: Recorder, taken: list[tuple[str, str, tuple[int, ...], object]]) -> list[tuple[str, str]]:
        if how == "raises" and any(name == "/aten.mul#0" for name, *_ in taken):
            raise RuntimeError("disk on fire")  # the whole hand-over fails: every tensor in it
        kept = [t for t in taken if t[0] != "/aten.mul#0"]
        return real(self, kept) + [(t[0], "disk on fire") for t in taken if t[0] == "/aten.mul#0"]

    monkeypatch.setattr(Recorder, "write_stored", flaky)
    x = torch.ones(3)
    model = Fn(lambda x: (x * 2).exp())
    with torch.no_grad(), capture(model, tmp_path / "b.bundle", progress=False) as cap:
        model(x)
    assert cap.engine == "observer" and cap.bundle_path is not None
    b = Bundle.open(cap.bundle_path)
    records = _by_id(b)
    assert records["/aten.mul#0"].tensor is None and records["/aten.mul#0"].stats is not None
    assert records["/aten.exp#0"].tensor == "/aten.exp#0" == records["/forward#0"].tensor
    assert torch.equal(torch.from_numpy(b.values("/aten.exp#0").copy()), (x * 2).exp())
    assert any("disk on fire" in d.message for d in b.manifest.diagnostics)


def test_block_that_raises_still_writes_bundle(tmp_path: Path) -> None:
    model = Fn(lambda x: x * 2)
    with pytest.raises(ValueError), capture(model, tmp_path / "r.bundle", progress=False) as cap:
        model(torch.ones(2))
        raise ValueError("user bug")
    b = Bundle.open(cap.bundle_path)
    assert b.records and "user bug" in b.manifest.diagnostics[-1].message


def test_stats_fast_path_matches_reference_path() -> None:
    torch.manual_seed(0)
    cases = [torch.randn(1000), torch.randn(50, 7).t(), torch.rand(300) + 1e4, torch.zeros(5),
             torch.tensor([0.0, -0.0, 3.0]), torch.arange(10), torch.tensor([True, False, True]),
             torch.randn(64).half(), torch.randn(64).bfloat16(), torch.randn(100).double(),
             torch.tensor([1.0, float("inf"), float("nan"), -2.0])]
    for x in cases:
        fast, ref = host_stats(x), device_stats(x).tolist()
        np.testing.assert_allclose(fast, ref, rtol=2e-5, atol=1e-6, err_msg=f"{x.dtype} {list(x.shape)}")


def test_device_stats_make_no_host_sync() -> None:
    """The accelerator path must not read a value back per op (``item``/``tolist``/bool tests)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Watch():
        device_stats(torch.tensor([1.0, float("nan"), 3.0, float("inf")]))
    assert seen and not {"aten._local_scalar_dense", "aten.is_nonzero", "aten.item"} & set(seen)


def test_statistics_reuse_sees_writes_through_another_alias(tmp_path: Path) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        z = torch.ops.aten._unsafe_view(y, [2, 2])  # same memory, its own version counter
        z.add_(1)
        return y

    for level in ("aten", "module"):
        _, b = _capture(tmp_path, f, torch.ones(4), mode="summary", level=level)
        assert b.record("/forward#0").stats.mean == 3.0, level
    assert b.record("/forward#0").stats.numel == 4


def test_module_output_aliasing_last_op_reuses_its_statistics(tmp_path: Path) -> None:
    lin = nn.Linear(8, 4)
    with torch.no_grad(), capture(lin, tmp_path / "l.bundle", mode="summary", progress=False) as cap:
        lin(torch.randn(3, 5, 8))  # addmm/mm on a 2-D view, then _unsafe_view back to 3-D
    assert len(cap._recorder.stats._rows) < len(list(cap.records))
    b = Bundle.open(cap.bundle_path)
    op = next(r for r in b.records if r.kind == "aten" and r.shape == [15, 4])
    assert b.record("/forward#0").stats == op.stats


def test_failure_before_the_op_still_runs_the_op(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hooks.recorder as recorder

    def boom(self: object, module: str, op: str) -> tuple[str, int]:
        raise KeyError("no keys today")

    monkeypatch.setenv("OPBAND_OBSERVER", "0")  # the dispatch mode keys each op in Python
    monkeypatch.setattr(recorder.Recorder, "next_key", boom)
    x = torch.arange(4.0)
    out, b = _capture(tmp_path, lambda x: (x * 3).sum(), x)
    assert float(out) == 18.0
    assert any("no keys today" in d.message for d in b.manifest.diagnostics)
