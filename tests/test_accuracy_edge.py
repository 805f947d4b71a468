"""Edge cases of whole comparisons: nothing to compare, dataflow across sequence-aligned ops."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import accuracy
from accuracy.bundle import BundleWriter
from accuracy.manifest import Manifest, Record


def test_empty_bundles_are_an_error_not_a_pass(tmp_path: Path, demo_bundles: dict[str, Path]) -> None:
    empty = tmp_path / "empty.bundle"
    BundleWriter(empty).close(Manifest(run={"variant": "fp32"}))
    with pytest.raises(accuracy.OpbandError, match="nothing to compare: the reference holds 0 records"):
        accuracy.compare(empty, empty)
    with pytest.raises(accuracy.OpbandError, match="target 0"):
        accuracy.compare(demo_bundles["ref"], empty)
    r = subprocess.run([sys.executable, "-m", "opband.cli", "compare", str(demo_bundles["ref"]), str(empty)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "nothing to compare" in r.stderr


def _bundle(path: Path, recs: list[tuple[str, str, np.ndarray, list[str] | None]]) -> Path:
    """A bundle of one module ``m`` whose records name their input tensors (a dataflow graph)."""
    w = BundleWriter(path)
    records = []
    for i, (key, op, arr, inputs) in enumerate(recs):
        w.add_array(f"t{i}", arr)
        records.append(Record(key=key, module="m", op=op, index=i, shape=list(arr.shape), dtype=str(arr.dtype),
                              tensor=f"t{i}", input_tensors=inputs))
    w.close(Manifest(records=records))
    return path


def test_ops_fed_by_a_sequence_aligned_op_are_inherited(tmp_path: Path) -> None:
    """INT8 replaces aten.addmm by quantized.linear_dynamic: ops downstream of it are not local failures."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1000).astype(np.float32)
    y = x + 0.05 * rng.standard_normal(1000).astype(np.float32)
    ref = _bundle(tmp_path / "r.bundle", [("m/aten.addmm#0", "aten.addmm", x, None),
                                          ("m/aten.relu#0", "aten.relu", np.maximum(x, 0), ["t0"]),
                                          ("m/aten.mul#0", "aten.mul", np.maximum(x, 0) * 2, ["t1"])])
    tgt = _bundle(tmp_path / "t.bundle", [("m/quantized.linear_dynamic#0", "quantized.linear_dynamic", y, None),
                                          ("m/aten.relu#0", "aten.relu", np.maximum(y, 0), ["t0"]),
                                          ("m/aten.mul#0", "aten.mul", np.maximum(y, 0) * 2, ["t1"])])
    report = accuracy.compare(ref, tgt)
    by_id = {o.id: o for o in report.ops}
    assert by_id["m/aten.addmm#0"].aligned_by == "sequence" and by_id["m/aten.addmm#0"].verdict == "fail"
    assert report.first_divergence is not None and report.first_divergence.id == "m/aten.addmm#0"
    assert by_id["m/aten.relu#0"].inherited and by_id["m/aten.mul#0"].inherited
