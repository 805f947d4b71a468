"""Bands from history: the tolerance factor, false alarms and detection by simulation, edge cases."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import accuracy
from accuracy.bands import BandConfig, History, bands_for, benjamini_hochberg, fit_band, k_factor
from accuracy.bundle import BundleWriter
from accuracy.errors import ConfigError
from accuracy.manifest import Manifest, Record
from accuracy.verdicts import judge_bands
from accuracy.bands import BandCheck

N_HISTORY = 20


@pytest.mark.parametrize("n,k", [(10, 3.981), (20, 3.295), (50, 2.863)])
def test_k_factor_matches_published_tables(n: int, k: float) -> None:
    """One-sided normal tolerance factors for 99 % coverage, 95 % confidence (NIST/SEMATECH tables)."""
    assert k_factor(n, 0.99, 0.95) == pytest.approx(k, abs=2e-3)


def test_benjamini_hochberg_by_hand() -> None:
    # m = 5, q = 0.05: thresholds 0.01 0.02 0.03 0.04 0.05; the largest p(i) <= q i/m is p(3) = 0.025
    assert benjamini_hochberg([0.001, 0.2, 0.025, 0.012, 0.9], 0.05) == [True, False, True, True, False]
    assert benjamini_hochberg([0.5, 0.6], 0.05) == [False, False]
    assert benjamini_hochberg([], 0.05) == []


def _verdicts(values_hist: np.ndarray, new: np.ndarray, cfg: BandConfig, ops_per_comparison: int = 1) -> list[str]:
    """The verdict of each simulated op: band fit, p-value, BH across groups of ``ops_per_comparison``."""
    checks = []
    for hist, x in zip(values_hist, new, strict=True):
        band = fit_band(hist, "norm_l2", "bfloat16", config=cfg)
        assert band is not None
        checks.append(BandCheck(band, float(x), band.p_value(float(x))))
    out = []
    for start in range(0, len(checks), ops_per_comparison):
        group = checks[start : start + ops_per_comparison]
        p = [c.p_value if c.out else 1.0 for c in group]
        for c, sig in zip(group, benjamini_hochberg(p, cfg.fdr), strict=True):
            out.append(judge_bands([c], sig, len(group))[0])
    return out


def _histories(rng: np.random.Generator, count: int, sigma: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
    """Log-normal benign histories: each op its own level (1e-5 .. 1e-2) and run-to-run noise sigma."""
    level = rng.uniform(np.log(1e-5), np.log(1e-2), size=(count, 1))
    sig = np.broadcast_to(np.asarray(sigma, float).reshape(-1, 1) if np.ndim(sigma) else sigma, (count, 1))
    hist = np.exp(level + sig * rng.standard_normal((count, N_HISTORY)))
    new = np.exp(level[:, 0] + sig[:, 0] * rng.standard_normal(count))
    return hist, new


def test_false_alarm_rate_at_defaults_is_below_one_percent() -> None:
    """2000 benign histories (20 accepted runs each, noise 2 % .. 50 %): a benign new run fails <= 1 %."""
    rng = np.random.default_rng(2024)
    sigma = rng.uniform(0.02, 0.5, size=2000)
    hist, new = _histories(rng, 2000, sigma)
    verdicts = _verdicts(hist, new, BandConfig())
    fail = verdicts.count("fail") / len(verdicts)
    out_of_band = (verdicts.count("fail") + verdicts.count("warn")) / len(verdicts)
    assert fail <= 0.01 and out_of_band <= 0.01, (fail, out_of_band)
    # in comparisons of 100 ops, FDR control keeps whole-comparison false failures rare too
    grouped = _verdicts(hist, new, BandConfig(), ops_per_comparison=100)
    assert grouped.count("fail") / len(grouped) <= 0.002


def test_detection_of_a_threefold_error_increase() -> None:
    """The error triples (a 3x regression) at 20 % run-to-run noise: detected >= 95 %, alone or among 99 benign ops."""
    rng = np.random.default_rng(7)
    hist, new = _histories(rng, 1000, 0.2)
    assert _verdicts(hist, new * 3, BandConfig()).count("fail") / 1000 >= 0.95
    # one shifted op among 99 benign ones in each comparison: FDR control costs some power (it
    # fails ~90 %), but the op is out of its band (warn or fail) >= 95 % of the time
    hist, new = _histories(rng, 100 * 200, 0.2)
    shifted = new.copy()
    shifted[::100] *= 3
    verdicts = _verdicts(hist, shifted, BandConfig(), ops_per_comparison=100)
    assert sum(v == "fail" for v in verdicts[::100]) / 200 >= 0.85
    assert sum(v in ("fail", "warn") for v in verdicts[::100]) / 200 >= 0.95
    benign = [v for i, v in enumerate(verdicts) if i % 100]
    assert benign.count("fail") / len(benign) <= 0.01


@pytest.mark.sweep
@pytest.mark.parametrize("sigma", [0.05, 0.1, 0.2, 0.3])
def test_detection_sweep_over_noise(sigma: float) -> None:
    rng = np.random.default_rng(11)
    hist, new = _histories(rng, 2000, sigma)
    rate = _verdicts(hist, new * math.exp(5 * sigma), BandConfig()).count("fail") / 2000
    assert rate >= 0.9  # a 5-sigma shift of the log error


def test_bitwise_stable_history_still_flags_a_change() -> None:
    band = fit_band([0.0] * 12, "norm_l2", "float32")
    assert band is not None and 0 < band.upper < 1e-9
    assert not BandCheck(band, 0.0, band.p_value(0.0)).out
    check = BandCheck(band, 1e-7, band.p_value(1e-7))
    assert check.out and check.p_value < 1e-6


def test_minimum_history() -> None:
    assert fit_band([1e-3] * 4, "norm_l2", "float32") is None
    assert fit_band([1e-3, math.nan, math.inf, 1e-3, 1e-3, 1e-3], "norm_l2", "float32") is None
    assert fit_band([1e-3] * 5, "norm_l2", "float32") is not None
    with pytest.raises(ConfigError, match="min_history"):
        BandConfig(min_history=2)


# ------------------------------------------------------------------- end to end through compare()


def _bundle(path: Path, values: dict[str, np.ndarray], variant: str = "bf16") -> Path:
    w = BundleWriter(path)
    records = []
    for i, (key, arr) in enumerate(values.items()):
        w.add_array(key, arr)
        module, op = key.split("/")[0], key.split("/")[1].split("#")[0]
        records.append(Record(key=key, module=module, op=op, index=i, shape=list(arr.shape), dtype="float32",
                              tensor=key, input_shapes=[list(arr.shape)]))
    return w.close(Manifest(run={"variant": variant, "device": "npu"}, records=records))


KEYS = ["m.a/aten.mul#0", "m.b/aten.add#0", "m.c/aten.exp#0"]


def _pair(tmp_path: Path, scale: dict[str, float]) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    ref = {k: rng.standard_normal(4096).astype(np.float32) for k in KEYS}
    noise = {k: rng.standard_normal(4096).astype(np.float32) for k in KEYS}
    tgt = {k: (ref[k] * (1 + 1e-3 * scale.get(k, 1.0) * noise[k])).astype(np.float32) for k in KEYS}
    return _bundle(tmp_path / "ref.bundle", ref), _bundle(tmp_path / "tgt.bundle", tgt)


def _history_file(tmp_path: Path, runs: int, target: str = "npu/bf16") -> Path:
    rng = np.random.default_rng(1)
    results = []
    for _ in range(runs):
        for k in KEYS:
            f = math.exp(0.05 * rng.standard_normal())
            results.append({"key": k, "op": k.split("/")[1].split("#")[0], "shape_signature": "4096",
                            "dtype": "float32", "target": target,
                            "metrics": {"norm_l2": 1e-3 * f, "max_rel": 4.4e-3 * f, "nan_mismatch": 0}})
    path = tmp_path / "history.json"
    path.write_text(json.dumps({"schema": "opband.history/1", "results": results}))
    return path


def test_compare_with_history_flags_the_shifted_op(tmp_path: Path) -> None:
    ref, tgt = _pair(tmp_path, {"m.b/aten.add#0": 3.0})
    rep = accuracy.compare(ref, tgt, history=_history_file(tmp_path, 12))
    by_key = {o.key: o for o in rep.ops}
    bad = by_key["m.b/aten.add#0"]
    assert bad.verdict == "fail" and bad.bands and "> band" in bad.reason and "of 12 accepted runs" in bad.reason
    assert by_key["m.a/aten.mul#0"].verdict == "pass" and by_key["m.c/aten.exp#0"].verdict == "pass"
    assert rep.first_divergence is bad and rep.history == {"target": "npu/bf16", "ops_with_bands": 3}


def test_the_same_shift_passes_the_loose_default_budget(tmp_path: Path) -> None:
    """Without history the bf16 budget (24u = 0.09) lets a 3x shift through: bands are what catch it."""
    ref, tgt = _pair(tmp_path, {"m.b/aten.add#0": 3.0})
    assert accuracy.compare(ref, tgt).verdict == "pass"


def test_too_little_history_falls_back_to_the_budget(tmp_path: Path) -> None:
    ref, tgt = _pair(tmp_path, {"m.b/aten.add#0": 3.0})
    rep = accuracy.compare(ref, tgt, history=_history_file(tmp_path, 4))
    assert rep.verdict == "pass" and all(not o.bands and "budget" in o.reason for o in rep.ops)


def test_history_of_another_target_is_not_used(tmp_path: Path) -> None:
    ref, tgt = _pair(tmp_path, {"m.b/aten.add#0": 3.0})
    rep = accuracy.compare(ref, tgt, history=_history_file(tmp_path, 12, target="gpu/bf16"))
    assert all(not o.bands for o in rep.ops)
    rep = accuracy.compare(ref, tgt, history=_history_file(tmp_path, 12, target="gpu/bf16"), target_id="gpu/bf16")
    assert rep.verdict == "fail"


def test_op_type_fallback(tmp_path: Path) -> None:
    """An op key with no history borrows the history of its op type (same op, shapes, dtype, target)."""
    results = [{"key": f"other.{i}/aten.add#0", "op": "aten.add", "shape_signature": "4096", "dtype": "float32",
                "target": "npu/bf16", "metrics": {"norm_l2": 1e-3, "max_rel": 4.4e-3}} for i in range(8)]
    ref, tgt = _pair(tmp_path, {"m.b/aten.add#0": 3.0})
    rep = accuracy.compare(ref, tgt, history={"results": results})
    bad = next(o for o in rep.ops if o.key == "m.b/aten.add#0")
    assert bad.verdict == "fail" and bad.bands[0].band.level == "op type" and "of this op type" in bad.reason


def test_nan_is_an_outcome_of_its_own(tmp_path: Path) -> None:
    h = History.load({("m/aten.mul#0", "4", "float32", "t"): [{"norm_l2": 1e-3, "nan_mismatch": 0}] * 10})
    from accuracy.metrics import Metrics
    from accuracy.verdicts import judge_nonfinite_history

    nan = Metrics(numel=4, nan_mismatch=1, nan_where_ref_finite=1)
    assert judge_nonfinite_history(nan, 10, 0)[0] == "fail"
    assert judge_nonfinite_history(nan, 10, 10)[0] == "pass"
    assert judge_nonfinite_history(nan, 10, 2)[0] == "warn"
    assert judge_nonfinite_history(Metrics(numel=4), 10, 10)[0] == "warn"  # finite where history had NaN
    assert judge_nonfinite_history(Metrics(numel=4), 10, 0) is None
    assert h.runs("m/aten.mul#0", "aten.mul", "4", "float32", "t", 5)[1] == "op"


def test_history_format_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="schema"):
        History.load({"schema": "other/9", "results": []})
    with pytest.raises(ConfigError, match="lacks"):
        History.load({"results": [{"key": "a"}]})
    bad = tmp_path / "h.json"
    bad.write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        History.load(bad)


def test_bands_are_kept_per_output() -> None:
    """A multi-output op's outputs have bands of their own: output 1 (~1e-1 error) does not widen output 0's."""
    rng = np.random.default_rng(2)
    results = [{"key": "m/aten.native_batch_norm#0", "output": out, "op": "aten.native_batch_norm",
                "shape_signature": "4096", "dtype": "float32", "target": "t",
                "metrics": {"norm_l2": scale * math.exp(0.05 * rng.standard_normal())}}
               for _ in range(8) for out, scale in ((0, 1e-3), (1, 1e-1))]
    history = History.from_results(results)
    cfg = BandConfig(metrics=("norm_l2",))
    (b0,), runs0, _ = bands_for(history, "m/aten.native_batch_norm#0", "aten.native_batch_norm", "4096", "float32",
                                "t", cfg)
    (b1,), runs1, _ = bands_for(history, "m/aten.native_batch_norm#0:1", "aten.native_batch_norm:1", "4096",
                                "float32", "t", cfg)
    assert runs0 == runs1 == 8
    assert 1e-3 < b0.upper < 2e-3 and 1e-1 < b1.upper < 2e-1
    # the op-type fallback is per output too
    (t1,), _, _ = bands_for(history, "other/aten.native_batch_norm#0:1", "aten.native_batch_norm:1", "4096",
                            "float32", "t", cfg)
    assert t1.level == "op type" and t1.upper == pytest.approx(b1.upper)
