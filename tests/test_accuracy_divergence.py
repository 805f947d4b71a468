"""First divergence with a dataflow graph (records naming their input tensors), and verdict words."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import accuracy
from accuracy.bands import BandCheck, fit_band
from accuracy.budgets import Budget
from accuracy.bundle import BundleWriter
from accuracy.manifest import Manifest, Record
from accuracy.metrics import Metrics
from accuracy.verdicts import judge_bands, judge_budget

# op -> inputs: a -> b -> c ; a -> d (d is independent of b)
GRAPH = {"a": [], "b": ["a"], "c": ["b"], "d": ["a"]}


def _bundle(path: Path, rel: dict[str, float]) -> Path:
    w = BundleWriter(path)
    recs = []
    for i, name in enumerate(GRAPH):
        base = np.random.default_rng(i).standard_normal(4096)
        noise = np.random.default_rng(100 + i).standard_normal(4096)
        w.add_array(name, (base * (1 + rel.get(name, 0.0) * noise)).astype(np.float32))
        recs.append(Record(key=f"m.{name}/aten.op{name}#0", module=f"m.{name}", op=f"aten.op{name}", index=i,
                           shape=[4096], dtype="float32", tensor=name, input_tensors=GRAPH[name] or None))
    return w.close(Manifest(run={"variant": "fp32"}, records=recs))


def test_dataflow_separates_local_from_inherited(tmp_path: Path) -> None:
    ref = _bundle(tmp_path / "ref.bundle", {})
    # b is broken; c carries b's error forward (same size); d has its own, independent fault
    tgt = _bundle(tmp_path / "tgt.bundle", {"b": 1e-2, "c": 1e-2, "d": 1e-3})
    rep = accuracy.compare(ref, tgt)
    by = {o.module: o for o in rep.ops}
    assert rep.first_divergence is by["m.b"]
    assert by["m.c"].inherited and not by["m.b"].inherited
    assert not by["m.d"].inherited  # its only input (a) is in band: a second local error, not inherited
    assert by["m.a"].verdict == "pass"


def test_an_op_that_amplifies_far_beyond_its_inputs_is_local(tmp_path: Path) -> None:
    ref = _bundle(tmp_path / "ref.bundle", {})
    tgt = _bundle(tmp_path / "tgt.bundle", {"b": 1e-4, "c": 0.5})
    by = {o.module: o for o in accuracy.compare(ref, tgt).ops}
    assert not by["m.c"].inherited and by["m.c"].error > 64 * by["m.b"].error


def test_without_dataflow_later_failures_are_inherited(tmp_path: Path) -> None:
    ref = _bundle(tmp_path / "ref.bundle", {})
    tgt = _bundle(tmp_path / "tgt.bundle", {"b": 1e-2, "d": 1e-3})
    rep = accuracy.compare(_strip(ref), _strip(tgt))  # no input names: execution order is all that is left
    by = {o.module: o for o in rep.ops}
    assert rep.first_divergence is by["m.b"] and by["m.d"].inherited


def _strip(path: Path) -> accuracy.Bundle:
    b = accuracy.Bundle.open(path)
    for r in b.records:
        r.input_tensors = None
    return b


def test_verdict_words() -> None:
    m = Metrics(numel=10, norm_l2=3.1e-2, cosine=0.9995)
    assert judge_budget(m, Budget(4e-3, 0.99, "default bfloat16/matmul K=128")) == (
        "fail", "norm L2 err 3.1e-02 > budget 4.0e-03 (default bfloat16/matmul K=128)")
    assert judge_budget(Metrics(numel=3, nan_where_ref_finite=2, nan_mismatch=2), Budget(1, -1, "x")) == (
        "fail", "2 NaN where the reference is finite")
    band = fit_band([4e-3 * f for f in (0.9, 1.0, 1.1, 0.95, 1.05, 1.0, 0.97, 1.02, 0.99, 1.01, 1.03, 0.98)],
                    "max_rel", "bfloat16")
    assert band is not None and band.n == 12
    check = BandCheck(band, 3.1e-2, band.p_value(3.1e-2))
    verdict, reason = judge_bands([check], significant=True, n_tested=1)
    assert verdict == "fail"
    assert reason.startswith(f"max rel err 3.1e-02 > band {band.upper:.1e} (99%/95% tolerance bound of 12 accepted runs), p=")
    assert judge_bands([check], significant=False, n_tested=250)[1].endswith("not significant after FDR control over 250 ops")
