"""The default budget table is derived from machine epsilon; overrides are data, half-specified ones refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import accuracy
from accuracy.budgets import (
    PROPAGATED_U, BudgetPolicy, default_budget, effective_dtype, op_class, reduction_length,
)
from accuracy.bundle import BundleWriter
from accuracy.errors import ConfigError
from accuracy.manifest import Manifest, Record
from accuracy.metrics import machine_eps


def test_machine_eps_per_dtype() -> None:
    assert machine_eps("float32") == 2.0**-24 and machine_eps("bfloat16") == 2.0**-8
    assert machine_eps("float16") == machine_eps("tfloat32") == 2.0**-11
    assert machine_eps("float8_e4m3fn") == 2.0**-4 and machine_eps("float8_e5m2") == 2.0**-3
    assert machine_eps("int8") == 1 / 254


def test_replay_budgets_by_hand() -> None:
    assert default_budget("aten.add", "aten", "float32", "replay").norm_l2 == 1e-6  # 8u = 4.8e-7 < floor
    mm = default_budget("aten.mm", "aten", "float16", "replay", reduction=1024)
    assert mm.norm_l2 == pytest.approx(4 * 2.0**-11 + 4 * 32 * 2.0**-24) and "K=1024" in mm.source
    assert default_budget("aten.mm", "aten", "float32", "replay", 4096).norm_l2 == pytest.approx(4 * 2.0**-24 + 4 * 64 * 2.0**-24)
    assert default_budget("aten.exp", "aten", "bfloat16", "replay").norm_l2 == pytest.approx(8 * 2.0**-8)
    e5 = default_budget("aten.add", "aten", "float8_e5m2", "replay")
    assert e5.norm_l2 == 1.0 and e5.cosine_min == -1.0  # capped: an fp8 e5m2 elementwise op may lose everything


@pytest.mark.parametrize("dtype", list(PROPAGATED_U))
def test_propagated_budget_is_a_multiple_of_u(dtype: str) -> None:
    b = default_budget("aten.mm", "aten", dtype, "propagated")
    assert b.norm_l2 == pytest.approx(min(PROPAGATED_U[dtype] * machine_eps(dtype), 1.0))
    assert b.cosine_min == pytest.approx(1 - 2 * b.norm_l2**2)


def test_op_classes_and_reduction_lengths() -> None:
    assert op_class("aten.mm") == "matmul" and op_class("aten._softmax") == "attention"
    assert op_class("aten.silu") == "elementwise" and op_class("forward", "module") == "module"
    assert op_class("quantized.linear_dynamic") == "matmul" and op_class("aten.embedding") == "exact"
    assert reduction_length("aten.mm", [[64, 344], [344, 128]], [64, 128]) == 344
    assert reduction_length("aten.addmm", [[128], [64, 344], [344, 128]], [64, 128]) == 344
    assert reduction_length("aten.sum", [[8, 100]], [8]) == 100
    assert reduction_length("aten._softmax", [[2, 4, 32, 32]], [2, 4, 32, 32]) == 32
    assert reduction_length("aten.convolution", [[1, 3, 8, 8], [16, 3, 3, 3]], [1, 16, 6, 6]) == 27
    assert reduction_length("aten.add", [[4], [4]], [4]) == 1


def test_effective_dtype() -> None:
    assert effective_dtype("float32", "bf16", "propagated") == "bfloat16"  # an upcast op in a bf16 run
    assert effective_dtype("float32", "bf16", "replay") == "float32"
    assert effective_dtype("float32", "int8", "replay") == "int8"
    assert effective_dtype("float32", "fp32", "propagated") == "float32"


def test_half_specified_override_is_refused_with_a_reason() -> None:
    with pytest.raises(ConfigError, match="half-specified budget would silently mix"):
        BudgetPolicy.from_config({"ops": {"*.mlp.act/*": {"norm_l2": 1e-3}}})
    with pytest.raises(ConfigError, match="unknown field"):
        BudgetPolicy.from_config({"ops": {"x": {"norm_l2": 1e-3, "cosine_min": 0.9, "rtool": 1}}})
    with pytest.raises(ConfigError, match="unknown budget config section"):
        BudgetPolicy.from_config({"op": {}})
    with pytest.raises(ConfigError, match="cosine_min must lie"):
        BudgetPolicy.from_config({"ops": {"x": {"norm_l2": 1e-3, "cosine_min": 2}}})
    with pytest.raises(ConfigError, match="must be numbers"):
        BudgetPolicy.from_config({"ops": {"x": {"norm_l2": "big", "cosine_min": 0.5}}})


CONFIGS = {
    "toml": '[ops."m.b/*"]\nnorm_l2 = 0.5\ncosine_min = 0.0\n',
    "yaml": 'ops:\n  "m.b/*":\n    norm_l2: 0.5\n    cosine_min: 0.0\n',
    "json": json.dumps({"ops": {"m.b/*": {"norm_l2": 0.5, "cosine_min": 0.0}}}),
}


def _pair(tmp_path: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    paths = []
    for name, rel in (("ref", 0.0), ("tgt", 1e-2)):
        w = BundleWriter(tmp_path / f"{name}.bundle")
        recs = []
        for i, key in enumerate(("m.a/aten.mul#0", "m.b/aten.gelu#0")):
            base = np.random.default_rng(i).standard_normal(1000)
            arr = (base * (1 + rel * rng.standard_normal(1000))).astype(np.float32)
            w.add_array(key, arr)
            recs.append(Record(key=key, module=key.split("/")[0], op=key.split("/")[1].split("#")[0], index=i,
                               shape=[1000], dtype="float32", tensor=key))
        paths.append(w.close(Manifest(run={"variant": "fp32"}, records=recs)))
    return paths[0], paths[1]


@pytest.mark.parametrize("suffix", sorted(CONFIGS))
def test_budgets_accepts_a_config_file(tmp_path: Path, suffix: str) -> None:
    ref, tgt = _pair(tmp_path)
    assert {o.key: o.verdict for o in accuracy.compare(ref, tgt).ops} == {"m.a/aten.mul#0": "fail", "m.b/aten.gelu#0": "fail"}
    cfg = tmp_path / f"budgets.{suffix}"
    cfg.write_text(CONFIGS[suffix])
    rep = accuracy.compare(ref, tgt, budgets=cfg)
    by_key = {o.key: o for o in rep.ops}
    assert by_key["m.b/aten.gelu#0"].verdict == "pass" and "override m.b/*" in by_key["m.b/aten.gelu#0"].reason
    assert by_key["m.a/aten.mul#0"].verdict == "fail"


def test_bad_config_files(tmp_path: Path) -> None:
    bad = tmp_path / "b.toml"
    bad.write_text("[ops\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        BudgetPolicy.from_config(bad)
    ini = tmp_path / "b.ini"
    ini.write_text("[ops]\n")
    with pytest.raises(ConfigError, match="unknown suffix"):
        BudgetPolicy.from_config(ini)
    with pytest.raises(ConfigError, match="cannot read"):
        BudgetPolicy.from_config(tmp_path / "missing.toml")


def test_override_matches_op_name_glob() -> None:
    policy = BudgetPolicy.from_config({"ops": {"aten.gelu": {"norm_l2": 0.1, "cosine_min": 0.9}}})
    assert policy.budget("any/aten.gelu#3", "aten.gelu", "aten", "float32", "propagated").norm_l2 == 0.1
    assert policy.budget("any/aten.silu#0", "aten.silu", "aten", "float32", "propagated").source.startswith("default")


def test_bf16_and_int8_demo_runs_pass_their_defaults(demo_bundles: dict[str, Path]) -> None:
    """Real precision changes stay within the default table (ops new to the bf16 graph are 'new', not failures)."""
    for variant in ("bf16", "int8"):
        rep = accuracy.compare(demo_bundles["ref"], demo_bundles[variant])
        assert rep.counts["fail"] == 0 and rep.counts["warn"] == 0, variant
    assert accuracy.compare(demo_bundles["ref"], demo_bundles["ref2"]).verdict == "pass"


# -- budgets on any metric (issue 32): hand-computed on r = [1, 2, 3, 4], t = [1, 2, 3, 4.4] ---------------------
def _hand_pair(tmp_path: Path, stored: bool = True) -> tuple[Path, Path]:
    paths = []
    for name, values in (("ref", [1.0, 2.0, 3.0, 4.0]), ("tgt", [1.0, 2.0, 3.0, 4.4])):
        w = BundleWriter(tmp_path / f"{name}.bundle")
        arr = np.array(values, dtype=np.float64)
        key = "m/aten.mul#0"
        w.add_array(key, arr)
        stats = {"numel": 4, "min": float(arr.min()), "max": float(arr.max()), "mean": float(arr.mean()),
                 "std": float(arr.std()), "l2": float(np.linalg.norm(arr)), "absmax": float(np.abs(arr).max()),
                 "nan": 0, "inf": 0, "zeros": 0, "sample": values}
        rec = Record(key=key, module="m", op="aten.mul", index=0, shape=[4], dtype="float64",
                     tensor=key if stored else None, stats=stats)
        paths.append(w.close(Manifest(run={"variant": "fp32"}, records=[rec])))
    return paths[0], paths[1]


# max abs 0.4, max rel 0.1, mean rel 0.025, RMSE sqrt(0.16 / 4) = 0.2, one element in four with rel err > 1e-3
HAND = {"max_abs": 0.4, "max_rel": 0.1, "mean_rel": 0.025, "rmse": 0.2}


@pytest.mark.parametrize("metric", sorted(HAND))
def test_a_budget_on_any_metric_judges_that_metric(tmp_path: Path, metric: str) -> None:
    ref, tgt = _hand_pair(tmp_path)
    value = HAND[metric]
    above = accuracy.compare(ref, tgt, budgets={"ops": {"m/*": {metric: value * 1.01}}}).ops[0]
    assert above.verdict == "pass" and f"{value:.3g} <= {value * 1.01:.3g}" in above.reason
    below = accuracy.compare(ref, tgt, budgets={"ops": {"m/*": {metric: value * 0.99}}}).ops[0]
    assert below.verdict == "fail" and f"{value:.3g} > budget" in below.reason and "override m/*" in below.reason
    assert below.severity == pytest.approx(1 / 0.99, rel=1e-6)


def test_budgets_on_ulp_share_rel_over_cosine_and_norm_together(tmp_path: Path) -> None:
    ref, tgt = _hand_pair(tmp_path)
    m = accuracy.compare(ref, tgt).ops[0].metrics
    assert m.share_rel_over["1e-03"] == 0.25 and m.ulp_max > 0
    norm = float(np.linalg.norm([0, 0, 0, 0.4]) / np.linalg.norm([1, 2, 3, 4]))
    assert m.norm_l2 == pytest.approx(norm, rel=1e-12)
    ok = {"norm_l2": norm * 1.01, "cosine_min": 0.99, "ulp_max": m.ulp_max, "share_rel_over": {"1e-03": 0.25}}
    assert accuracy.compare(ref, tgt, budgets={"ops": {"m/*": ok}}).ops[0].verdict == "pass"
    for change in ({"share_rel_over": {"0.001": 0.2}}, {"ulp_max": m.ulp_max * 0.5}, {"norm_l2": norm * 0.5},
                   {"cosine_min": 0.99999}):
        op = accuracy.compare(ref, tgt, budgets={"ops": {"m/*": {**ok, **change}}}).ops[0]
        assert op.verdict == "fail", (change, op.reason)


def test_atol_rtol_counts_the_elements_outside_as_torch_testing_does(tmp_path: Path) -> None:
    import torch
    ref, tgt = _hand_pair(tmp_path)
    r, t = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64), torch.tensor([1.0, 2.0, 3.0, 4.4], dtype=torch.float64)
    for atol, rtol, share, verdict in ((0.01, 0.05, 0.0, "fail"), (0.01, 0.05, 0.25, "pass"), (0.3, 0.05, 0.0, "pass"),
                                       (0.0, 0.101, 0.0, "pass"), (0.0, 0.099, 0.0, "fail")):
        outside = 1 - torch.isclose(t, r, rtol=rtol, atol=atol).double().mean().item()  # |t - r| <= atol + rtol |r|
        op = accuracy.compare(ref, tgt, budgets={"ops": {"m/*": {"atol": atol, "rtol": rtol, "close_share": share}}}).ops[0]
        assert op.verdict == verdict, (atol, rtol, op.reason)
        assert f"{outside:.3%} of elements outside" in op.reason
    (tmp_path / "summary").mkdir()
    summary_ref, summary_tgt = _hand_pair(tmp_path / "summary", stored=False)
    op = accuracy.compare(summary_ref, summary_tgt, budgets={"ops": {"m/*": {"atol": 0.3, "rtol": 0.0}}}).ops[0]
    assert op.verdict == "warn" and "statistics only" in op.reason


def test_budget_fields_are_checked_with_what_to_write() -> None:
    with pytest.raises(ConfigError, match="bounds nothing"):
        BudgetPolicy.from_config({"ops": {"x": {"atol": 1e-3}}})
    with pytest.raises(ConfigError, match="threshold '0.5' is not one opband measures"):
        BudgetPolicy.from_config({"ops": {"x": {"share_rel_over": {"0.5": 0.1}}}})
    with pytest.raises(ConfigError, match="close_share bounds the elements outside"):
        BudgetPolicy.from_config({"ops": {"x": {"close_share": 0.1, "max_abs": 1}}})
    with pytest.raises(ConfigError, match="max_rel must lie in"):
        BudgetPolicy.from_config({"ops": {"x": {"max_rel": -1}}})
    with pytest.raises(ConfigError, match="unknown field.*allowed"):
        BudgetPolicy.from_config({"ops": {"x": {"max_abss": 1}}})


def test_a_budget_with_limits_round_trips_through_the_json_report(tmp_path: Path) -> None:
    from accuracy.report import op_from_dict, op_to_dict
    ref, tgt = _hand_pair(tmp_path)
    op = accuracy.compare(ref, tgt, budgets={"ops": {"m/*": {"max_abs": 0.5, "atol": 0.1, "rtol": 0.01}}}).ops[0]
    d = json.loads(json.dumps(op_to_dict(op), allow_nan=False))  # strict JSON: no Infinity for the unset norm
    assert d["budget"]["limits"] == {"max_abs": 0.5} and d["budget"]["rtol"] == 0.01
    assert op_from_dict(d).budget == op.budget
