"""`opband coverage`: what a set of runs exercised, per model, with verdicts and an op list's share."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from accuracy.coverage import Exercise, compute_dtype, coverage, coverage_of_bundles, load_op_list, shape_class
from accuracy.errors import ConfigError
from hooks import capture
from hooks.opsweep import OpSpec, SweepConfig, run_sweep

OPBAND = str(Path(sys.executable).with_name("opband"))


def test_shape_classes() -> None:
    assert shape_class("64x256,256x128") == "2d:1e5,2d:1e5"  # 16384 and 32768 elements: the 1e5 decade
    assert shape_class("2x8x32,-,scalar") == "3d:1e3,0d"
    assert shape_class("0x4") == "2d:empty" and shape_class("1") == "1d:1e0" and shape_class("") == "no tensor inputs"
    assert compute_dtype(["int64", "bfloat16"], "float32") == "bfloat16"  # an upcast: computed from bf16 inputs
    assert compute_dtype(["float32"], "float32", "int8") == "int8" and compute_dtype([], "bool", "int8") == "bool"


def test_matrix_and_op_list_share_from_exercises(tmp_path: Path) -> None:
    ex = [
        Exercise("llama", "aten.mm", "bfloat16", "4x8,8x4", verdict="pass", band="budget"),
        Exercise("llama", "aten.mm", "float32", "64x64,64x64", verdict="fail", band="band"),
        Exercise("llama", "aten.add", "float32", "4x8,4x8", overload="aten.add.Tensor", verdict="inherited"),
        Exercise("sweep", "aten.mm", "float16", "4x8,8x4", regime="large", verdict="pass", band="budget"),
        Exercise("sweep", "aten.silu", "float16", "4x8", regime="subnormal"),
    ]
    (tmp_path / "ops.txt").write_text("# the target's op library\nmm\naten.add.Tensor\naten.add.Scalar\naten.silu\naten.gelu\n")
    report = coverage(ex, load_op_list(tmp_path / "ops.txt"))
    assert report.models == ["llama", "sweep"]
    mm = report.ops["aten.mm"]
    assert mm.total.calls == 3 and mm.total.dtypes == {"bfloat16", "float32", "float16"}
    assert mm.total.shape_classes == {"2d:1e2,2d:1e2", "2d:1e4,2d:1e4"} and mm.total.regimes == {"model", "large"}
    assert mm.by_model["llama"].state() == "FAIL 1/2" and mm.by_model["sweep"].state() == "pass 1"
    assert mm.total.bands == {"budget": 2, "band": 1}
    assert report.ops["aten.add"].by_model["llama"].state() == "inherited 1"
    assert report.ops["aten.silu"].by_model["sweep"].state() == "seen"
    assert report.covered == ["aten.mm", "aten.add.Tensor", "aten.silu"]
    assert report.uncovered == ["aten.add.Scalar", "aten.gelu"] and report.share == pytest.approx(3 / 5)
    text = report.to_text()
    assert "NOTE | op list | 3/5 ops covered (60.0%)" in text and "uncovered: aten.add.Scalar, aten.gelu" in text
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(ConfigError, match="names no ops"):
        load_op_list(tmp_path / "empty.txt")


def test_coverage_of_captures_and_a_sweep(tmp_path: Path) -> None:
    from hooks.demo_model import DecoderConfig, build

    model, (ids,) = build(DecoderConfig(layers=1, dim=32, heads=2, hidden=48, seq=8, vocab=64))
    for variant, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        m = model if dtype is None else model.to(dtype)
        with torch.no_grad(), capture(m, tmp_path / f"{variant}.bundle", run={"variant": variant, "label": "tiny"},
                                      progress=False):
            m(ids)
    sweep = run_sweep(SweepConfig(ops=[OpSpec("gelu"), OpSpec("rsqrt")], dtypes=["bf16"], regimes=["normal", "subnormal"]),
                      tmp_path / "sweep", progress=False)
    paths = [tmp_path / "fp32.bundle", tmp_path / "bf16.bundle", sweep.reference, sweep.targets["bf16"]]
    (tmp_path / "ops.txt").write_text("aten.mm\naten.gelu\naten.rsqrt\naten.conv2d\n")
    report = coverage_of_bundles(paths, load_op_list(tmp_path / "ops.txt"))
    assert report.models == ["tiny", "sweep"]
    gelu = report.ops["aten.gelu"].by_model["sweep"]
    assert gelu.regimes == {"normal", "subnormal"} and gelu.dtypes == {"float32", "bfloat16"}
    assert report.ops["aten.rsqrt"].by_model["sweep"].state() == "FAIL 1/2", "bf16 rsqrt of subnormals is inf on CPU"
    assert report.ops["aten.mm"].by_model["tiny"].dtypes == {"float32", "bfloat16"}
    assert report.ops["aten.mm"].by_model["tiny"].state().startswith("pass")
    assert report.covered == ["aten.mm", "aten.gelu", "aten.rsqrt"] and report.uncovered == ["aten.conv2d"]

    r = subprocess.run([OPBAND, "coverage", *map(str, paths), "--op-list", str(tmp_path / "ops.txt"),
                        "--json", str(tmp_path / "cov.json")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "NOTE | op list | 3/4 ops covered (75.0%)" in r.stdout
    data = json.loads((tmp_path / "cov.json").read_text())
    assert data["op_list"]["uncovered"] == ["aten.conv2d"] and data["models"] == ["tiny", "sweep"]
