"""Golden mode: both sides against an fp64 recomputation; the target is judged relative to the reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import accuracy
from accuracy import report
from accuracy.bundle import BundleWriter
from accuracy.manifest import Manifest, Record

KEYS = ("m.a/aten.mul#0", "m.b/aten.exp#0")


def _bundle(path: Path, values: dict[str, np.ndarray], dtype: str, run: dict | None = None) -> Path:
    w = BundleWriter(path)
    recs = []
    for i, (key, arr) in enumerate(values.items()):
        w.add_array(key, arr)
        recs.append(Record(key=key, module=key.split("/")[0], op=key.split("/")[1].split("#")[0], index=i,
                           shape=list(arr.shape), dtype=dtype, tensor=key, input_shapes=[list(arr.shape)]))
    return w.close(Manifest(run=run or {"variant": "fp32", "device": "cpu"}, records=recs))


@pytest.fixture()
def golden(tmp_path: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(10_000) for k in KEYS}


def _side(tmp_path: Path, name: str, golden: dict[str, np.ndarray], rel: dict[str, float], seed: int) -> Path:
    rng = np.random.default_rng(seed)
    vals = {k: (g * (1 + rel.get(k, 0.0) * rng.standard_normal(g.size))).astype(np.float32) for k, g in golden.items()}
    return _bundle(tmp_path / f"{name}.bundle", vals, "float32")


def test_reference_rounding_is_not_blamed_on_the_target(tmp_path: Path, golden: dict[str, np.ndarray]) -> None:
    gold = _bundle(tmp_path / "golden.bundle", golden, "float64")
    # a TF32-like reference (1e-4 relative error) and a target of about the same quality
    ref = _side(tmp_path, "ref", golden, {k: 1e-4 for k in KEYS}, 1)
    tgt = _side(tmp_path, "tgt", golden, {k: 2e-4 for k in KEYS}, 2)
    assert accuracy.compare(ref, tgt, mode="replay").verdict == "fail"  # ref vs target alone: over the fp32 budget
    rep = accuracy.compare(ref, tgt, mode="golden", golden=gold)
    assert rep.verdict == "pass", report.to_text(rep)
    for o in rep.ops:
        assert o.golden_ratio == pytest.approx(2.0, rel=0.05)
        assert o.reference_metrics is not None and o.reference_metrics.norm_l2 == pytest.approx(1e-4, rel=0.05)
        assert o.metrics is not None and o.metrics.norm_l2 == pytest.approx(2e-4, rel=0.05)
        assert "vs fp64 golden" in o.reason
    assert rep.golden is not None and rep.golden["records"] == 2


def test_a_target_fault_still_fails_in_golden_mode(tmp_path: Path, golden: dict[str, np.ndarray]) -> None:
    gold = _bundle(tmp_path / "golden.bundle", golden, "float64")
    ref = _side(tmp_path, "ref", golden, {k: 1e-4 for k in KEYS}, 1)
    tgt = _side(tmp_path, "tgt", golden, {KEYS[0]: 1e-4, KEYS[1]: 1e-2}, 2)
    rep = accuracy.compare(ref, tgt, mode="golden", golden=gold)
    by_key = {o.key: o for o in rep.ops}
    assert by_key[KEYS[0]].verdict == "pass" and by_key[KEYS[1]].verdict == "fail"
    assert by_key[KEYS[1]].golden_ratio == pytest.approx(100, rel=0.05)
    d = report.to_dict(rep)
    assert d["golden"]["records"] == 2 and any(o["golden_ratio"] for o in d["ops"])


def test_exact_target_against_a_noisy_reference_passes(tmp_path: Path, golden: dict[str, np.ndarray]) -> None:
    gold = _bundle(tmp_path / "golden.bundle", golden, "float64")
    ref = _side(tmp_path, "ref", golden, {k: 1e-3 for k in KEYS}, 1)
    tgt = _side(tmp_path, "tgt", golden, {}, 2)  # float32 rounding of the golden only
    rep = accuracy.compare(ref, tgt, mode="golden", golden=gold)
    assert rep.verdict == "pass" and all(o.golden_ratio < 1e-3 for o in rep.ops)


def test_missing_golden_record_falls_back_to_the_reference(tmp_path: Path, golden: dict[str, np.ndarray]) -> None:
    gold = _bundle(tmp_path / "golden.bundle", {KEYS[0]: golden[KEYS[0]]}, "float64")
    ref = _side(tmp_path, "ref", golden, {}, 1)
    tgt = _side(tmp_path, "tgt", golden, {}, 2)
    rep = accuracy.compare(ref, tgt, mode="golden", golden=gold)
    assert "no golden record" in next(o for o in rep.ops if o.key == KEYS[1]).reason


def test_golden_mode_needs_a_golden(tmp_path: Path, golden: dict[str, np.ndarray]) -> None:
    ref = _side(tmp_path, "ref", golden, {}, 1)
    from accuracy.errors import OpbandError

    with pytest.raises(OpbandError, match="--replay REF --golden") as e:
        accuracy.compare(ref, ref, mode="golden")
    assert "not one" in str(e.value) and "golden=GOLD.bundle" in str(e.value)


def test_golden_bundle_as_the_reference(tmp_path: Path, golden: dict[str, np.ndarray]) -> None:
    """hooks' replay(golden=True) output passed as the reference: its run names the original (replay_of)."""
    ref = _side(tmp_path, "ref", golden, {k: 1e-4 for k in KEYS}, 1)
    gold = _bundle(tmp_path / "golden.bundle", golden, "float64",
                   run={"variant": "fp64-golden", "golden": True, "replay_of": str(ref), "device": "cpu"})
    tgt = _bundle(tmp_path / "tgt.bundle", {k: (g * (1 + 2e-4 * np.random.default_rng(2).standard_normal(g.size)))
                                            .astype(np.float32) for k, g in golden.items()},
                  "float32", run={"variant": "fp32", "device": "cpu", "replay_of": str(ref)})
    rep = accuracy.compare(gold, tgt, mode="golden")
    assert rep.verdict == "pass" and rep.reference["path"] == str(ref) and rep.golden["path"] == str(gold)
    assert all(o.golden_ratio == pytest.approx(2.0, rel=0.05) for o in rep.ops)
    ref.unlink()  # without the original reference: judged against the golden with the budget alone
    rep = accuracy.compare(gold, tgt, mode="golden")
    assert rep.verdict == "fail" and all("no reference outputs" in o.reason for o in rep.ops)
