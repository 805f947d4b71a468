"""Replay and golden: each op of a reference re-run alone on its recorded inputs, same keys."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from accuracy.bundle import Bundle
from hooks import capture, demo_model
from hooks.opcall import NotReplayable, decode_call, encode_call, op_target, resolve_target
from hooks.replay import replay


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, (ids,) = demo_model.build()
    path = tmp_path_factory.mktemp("replay") / "ref.bundle"
    with torch.no_grad(), capture(model, path, inputs=True, progress=False):
        model(ids)
    return path


def _aten_ids(b: Bundle) -> set[str]:
    return {r.id for r in b.records if r.kind == "aten"}


def test_fp32_replay_reproduces_reference_bitwise(reference: Path, tmp_path: Path) -> None:
    ref = Bundle.open(reference)
    rep = Bundle.open(replay(reference, None, tmp_path / "rep.bundle"))
    assert _aten_ids(rep) == {k for k in _aten_ids(ref) if k.split(":")[0] in ref.manifest.run["calls"]}
    assert len(_aten_ids(rep)) > 150
    for r in rep.records:
        np.testing.assert_array_equal(rep.values(r.tensor), ref.values(ref.record(r.id).tensor), err_msg=r.id)
    assert rep.manifest.run["replay_of"] == str(reference) and not rep.manifest.diagnostics


def test_bf16_replay_casts_inputs(reference: Path, tmp_path: Path) -> None:
    ref = Bundle.open(reference)
    rep = Bundle.open(replay(reference, "hooks.demo_model:build", tmp_path / "bf16.bundle", variant="bf16"))
    mm = next(r for r in rep.records if r.op == "aten.mm")
    assert mm.dtype == "bfloat16" and mm.input_dtypes == ["bfloat16", "bfloat16"]
    got, want = rep.values(mm.tensor), ref.values(ref.record(mm.id).tensor)
    assert not np.array_equal(got, want)
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05 * np.abs(want).max())
    assert rep.manifest.run["variant"] == "bf16" and rep.manifest.run["spec"] == "hooks.demo_model:build"
    import accuracy
    from accuracy.report import headline

    report = accuracy.compare(ref, rep, mode="replay")  # each op's own bf16 error, all local
    assert not [u for u in report.unmatched if u.record.kind == "module"], "module records are not replayed"
    assert report.verdict == "pass" and report.unmatched == [] and len(report.ops) > 150
    assert headline(report).startswith("PASSED | pass |")  # every bf16 op within its own (replay) budget


def test_golden_is_float64_on_cpu(reference: Path, tmp_path: Path) -> None:
    ref = Bundle.open(reference)
    gold = Bundle.open(replay(reference, None, tmp_path / "gold.bundle", device="cuda", golden=True))
    assert gold.manifest.run["golden"] is True and gold.manifest.run["device"] == "cpu"
    assert _aten_ids(gold) == _aten_ids(Bundle.open(replay(reference, None, tmp_path / "r.bundle")))
    mm = next(r for r in gold.records if r.op == "aten.mm")
    assert mm.dtype == "float64"
    np.testing.assert_allclose(gold.values(mm.tensor), ref.values(ref.record(mm.id).tensor), rtol=1e-4, atol=1e-4)
    # fp64 golden is closer to an exact float64 product than the fp32 reference is
    a, w = (ref.values(n).astype(np.float64) for n in ref.record(mm.id).input_tensors)
    exact = a @ w
    assert np.abs(gold.values(mm.tensor) - exact).max() < np.abs(ref.values(ref.record(mm.id).tensor) - exact).max()


def test_replay_refuses_bundles_without_calls_and_quantized_variants(tmp_path: Path) -> None:
    model, (ids,) = demo_model.build()
    with torch.no_grad(), capture(model, tmp_path / "plain.bundle", progress=False):
        model(ids)
    with pytest.raises(ValueError, match="inputs=True"):
        replay(tmp_path / "plain.bundle", None, tmp_path / "x.bundle")
    with pytest.raises(ValueError, match="int8"):
        replay(tmp_path / "plain.bundle", None, tmp_path / "x.bundle", variant="int8")


def test_unreplayable_ops_become_diagnostics(tmp_path: Path) -> None:
    class Noisy(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.dropout(x * 2, p=0.5, training=True) + 1

    with torch.no_grad(), capture(Noisy(), tmp_path / "n.bundle", inputs=True, max_bytes=None, progress=False) as cap:
        Noisy()(torch.ones(8))
    ref = Bundle.open(cap.bundle_path)
    assert any("not replayable: the op draws random numbers" in d.message for d in ref.manifest.diagnostics)
    rep = Bundle.open(replay(cap.bundle_path, None, tmp_path / "nr.bundle"))
    assert any(d.message == "not replayed: the op draws random numbers" for d in rep.manifest.diagnostics)
    assert "/aten.mul#0" in {r.id for r in rep.records}


def test_budget_skipped_inputs_are_diagnosed(tmp_path: Path) -> None:
    model, (ids,) = demo_model.build()
    with torch.no_grad(), capture(model, tmp_path / "small.bundle", inputs=True, max_bytes=50_000, progress=False):
        model(ids)
    rep = Bundle.open(replay(tmp_path / "small.bundle", None, tmp_path / "sr.bundle"))
    assert any("input was not stored" in d.message for d in rep.manifest.diagnostics)


def test_call_encoding_round_trip() -> None:
    x = torch.randn(2, 3)
    args, kwargs = (x, [1, -1], 2.5, float("inf"), None, True), {"dtype": torch.bfloat16,
                                                                  "memory_format": torch.contiguous_format,
                                                                  "device": torch.device("cpu"), "layout": torch.strided}
    call, tensors = encode_call(args, kwargs)
    assert tensors == [x] and call["args"][3] == {"$f": "inf"}
    import json

    back_args, back_kwargs = decode_call(json.loads(json.dumps(call)), tensors)
    assert back_args[0] is x and back_args[1:4] == [[1, -1], 2.5, float("inf")] and back_args[5] is True
    assert back_kwargs == kwargs
    with pytest.raises(NotReplayable):
        encode_call((torch.Generator(),), {})
    assert op_target(torch.ops.aten.add.Tensor) == "aten.add.Tensor"
    assert resolve_target("aten.add.Tensor") is torch.ops.aten.add.Tensor


def test_run_capture_replay_entry_point(reference: Path, tmp_path: Path) -> None:
    from hooks import run_capture

    out = run_capture("hooks.demo_model:build", tmp_path / "rc.bundle", device="cpu", replay=reference)
    b = Bundle.open(out)
    assert b.manifest.run["replay_of"] == str(reference) and b.records


def test_replay_and_golden_feed_the_comparison(reference: Path, tmp_path: Path) -> None:
    import accuracy

    target = replay(reference, None, tmp_path / "t.bundle", variant="bf16")
    gold = replay(reference, None, tmp_path / "g.bundle", golden=True)
    rep = accuracy.compare(reference, target, mode="golden", golden=gold)
    assert rep.golden is not None and rep.golden["records"] > 150
    assert not [u for u in rep.unmatched if u.record.kind == "aten"]  # module records are not replayed
    assert {o.verdict for o in rep.ops if o.kind == "aten"} <= {"pass", "warn", "fail"}
    assert sum(o.kind == "aten" for o in rep.ops) > 150


class _Recurrent(torch.nn.Module):
    """A biased Linear (addmm on the transposed weight), an LSTM and a GRU (its gates are strided
    chunks written in place): ops whose kernels round by input layout and grad mode."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 48)
        self.rnn = torch.nn.LSTM(48, 32, 2, batch_first=True)
        self.gru = torch.nn.GRU(32, 16, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn(self.fc(x))
        y, _ = self.gru(y)
        return y


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_fp32_replay_is_bitwise_for_strided_inputs_and_either_grad_mode(tmp_path: Path, grad: bool) -> None:
    """Replay rebuilds each input's layout (w.t(), chunks) and the grad mode the op ran under: on
    contiguous copies addmm and sigmoid_ round differently, and with grad on mkldnn's LSTM layer
    returns an extra workspace output."""
    torch.manual_seed(0)
    model, x = _Recurrent().eval(), torch.randn(4, 7, 64)
    path = tmp_path / "ref.bundle"
    with torch.set_grad_enabled(grad), capture(model, path, inputs=True, progress=False):
        model(x)
    ref = Bundle.open(path)
    calls = ref.manifest.run["calls"]
    addmm = next(k for k in calls if k.startswith("fc/aten.addmm"))
    assert calls[addmm]["grad"] is grad and calls[addmm]["strides"][2] == [1, 64]  # w.t() of a [48, 64] weight
    rep = Bundle.open(replay(path, None, tmp_path / "rep.bundle"))
    assert {r.id for r in rep.records} == {r.id for r in ref.records if r.kind == "aten"}
    floats = [r for r in rep.records if r.dtype.startswith("float")]  # not mkldnn's uint8 scratch workspace
    assert len(floats) > 100
    for r in floats:
        np.testing.assert_array_equal(rep.values(r.tensor), ref.values(ref.record(r.id).tensor), err_msg=r.id)
    assert not rep.manifest.diagnostics


def test_layout_rules() -> None:
    from hooks.opcall import overlaps, strided_like

    assert not overlaps((48, 64), (1, 48)) and not overlaps((4, 16), (64, 1))  # transposed; a chunk with gaps
    assert overlaps((3, 4), (0, 1)) and overlaps((4, 4), (2, 1))  # expand; rows sharing elements
    t = torch.arange(12.0).reshape(3, 4)
    s = strided_like(t, (1, 3))
    assert s.stride() == (1, 3) and torch.equal(s, t)
    g = strided_like(t, (10, 2))
    assert g.stride() == (10, 2) and torch.equal(g, t)
