"""Bands from history: accepted past values of a metric in, an upper band and a p-value out.

Pure code, no I/O beyond reading a history file. The method (``docs/bands.md``):

1. History is grouped by (op key and output, input-shape signature, dtype, target); a group with fewer than
   ``min_history`` finite values falls back to the op type (op name instead of op key); with
   still too few the caller falls back to the dtype budget.
2. Values are floored at ``floor = FLOOR_U * u(dtype)`` and logged: error metrics are positive
   and multiplicative, so log error is close to normal across runs.
3. With mean ``m`` and standard deviation ``s`` of the logs (``s`` floored at ``MIN_LOG_SD``, so
   a bitwise-stable history has a band just above its value and still flags any change beyond
   it), the band is the one-sided normal tolerance bound ``exp(m + k s)`` covering ``coverage``
   of future values with ``confidence``: ``k = t'_{confidence}(n - 1, z_{coverage} sqrt(n)) / sqrt(n)``,
   ``t'`` the noncentral t quantile (scipy.stats.nct).
4. A new value's p-value is its upper tail under the predictive distribution
   ``(log x - m) / (s sqrt(1 + 1/n)) ~ t(n - 1)``; across the ops of one comparison the
   out-of-band p-values are controlled with Benjamini-Hochberg at ``fdr``.
5. NaN/Inf are outcomes of their own: an op whose NaN/Inf pattern differs from the reference is
   compared with how often that happened in its history, not banded as a number.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from accuracy.errors import ConfigError
from accuracy.metrics import machine_eps

HISTORY_SCHEMA = "opband.history/1"
FLOOR_U = 2.0**-10  # value floor, in units of u of the dtype
MIN_LOG_SD = 0.02  # floor of the log standard deviation (2 % run-to-run variation)
NONFINITE_KEYS = ("nan_mismatch", "inf_mismatch", "nan_where_ref_finite")


@dataclass(frozen=True)
class BandConfig:
    """The documented defaults; each field is one knob of the method above."""

    coverage: float = 0.99
    confidence: float = 0.95
    min_history: int = 5
    fdr: float = 0.05
    metrics: tuple[str, ...] = ("norm_l2", "max_rel")

    def __post_init__(self) -> None:
        if not (0.5 < self.coverage < 1 and 0.5 < self.confidence < 1):
            raise ConfigError("band coverage and confidence must lie in (0.5, 1)")
        if self.min_history < 3:
            raise ConfigError("min_history must be at least 3: a tolerance bound needs a standard deviation")
        if not 0 < self.fdr < 1:
            raise ConfigError("fdr must lie in (0, 1)")


@lru_cache(maxsize=4096)
def k_factor(n: int, coverage: float, confidence: float) -> float:
    """One-sided normal tolerance factor: P(P(X <= m + k s) >= coverage) = confidence."""
    z = stats.norm.ppf(coverage)
    return float(stats.nct.ppf(confidence, df=n - 1, nc=z * math.sqrt(n)) / math.sqrt(n))


@dataclass(frozen=True)
class Band:
    """The accepted upper range of one metric for one op, learned from ``n`` accepted values."""

    metric: str
    upper: float
    n: int
    mean_log: float
    sd_log: float
    floor: float
    level: str  # "op" (same op key) or "op type" (same op name)
    coverage: float
    confidence: float
    nonfinite: int = 0  # accepted runs whose NaN/Inf pattern differed from the reference

    def describe(self) -> str:
        return (f"{self.coverage:.0%}/{self.confidence:.0%} tolerance bound of {self.n} accepted runs"
                + (" of this op type" if self.level == "op type" else ""))

    def p_value(self, value: float) -> float:
        """Upper-tail p-value of ``value`` under the history's predictive distribution."""
        y = math.log(max(value, self.floor))
        t = (y - self.mean_log) / (self.sd_log * math.sqrt(1 + 1 / self.n))
        return float(stats.t.sf(t, df=self.n - 1))


@dataclass
class BandCheck:
    """One metric of one op against its band."""

    band: Band
    value: float
    p_value: float

    @property
    def out(self) -> bool:
        return self.value > self.band.upper


def fit_band(values: Sequence[float], metric: str, dtype: str, level: str = "op",
             config: BandConfig | None = None, nonfinite: int = 0) -> Band | None:
    """The band of finite accepted ``values``; None when there are fewer than ``min_history``."""
    cfg = config or BandConfig()
    finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if len(finite) < cfg.min_history:
        return None
    floor = FLOOR_U * (machine_eps(dtype) or machine_eps("float32"))
    logs = np.log(np.maximum(np.asarray(finite), floor))
    n = logs.size
    m = float(logs.mean())
    s = max(float(logs.std(ddof=1)), MIN_LOG_SD)
    k = k_factor(n, cfg.coverage, cfg.confidence)
    return Band(metric, float(math.exp(m + k * s)), n, m, s, floor, level, cfg.coverage, cfg.confidence, nonfinite)


def benjamini_hochberg(p_values: Sequence[float], q: float) -> list[bool]:
    """Which hypotheses BH rejects at false-discovery rate ``q``."""
    p = np.asarray(p_values, dtype=np.float64)
    m = p.size
    if m == 0:
        return []
    order = np.argsort(p)
    passed = p[order] <= q * np.arange(1, m + 1) / m
    reject = np.zeros(m, bool)
    if passed.any():
        reject[order[: int(np.nonzero(passed)[0].max()) + 1]] = True
    return reject.tolist()


# ---------------------------------------------------------------------------------- history


HistoryKey = tuple[str, str, str, str]  # (op key, shape signature, dtype, target)


@dataclass
class History:
    """Accepted past per-op metric values, indexed by op key and by op type."""

    by_key: dict[HistoryKey, list[Mapping[str, Any]]] = field(default_factory=dict)
    by_type: dict[HistoryKey, list[Mapping[str, Any]]] = field(default_factory=dict)

    @classmethod
    def load(cls, source: History | Mapping[Any, Any] | Iterable[Mapping[str, Any]] | str | os.PathLike[str]) -> History:
        """From a History, a path to a history JSON file, its parsed dict, a list of results, or a
        mapping ``{(key, shape_signature, dtype, target): [metrics dict, ...]}``."""
        if isinstance(source, History):
            return source
        if isinstance(source, (str, os.PathLike)):
            try:
                source = json.loads(Path(source).read_text(encoding="utf-8"))
            except OSError as e:
                raise ConfigError(f"cannot read history {source}: {e.strerror}") from e
            except json.JSONDecodeError as e:
                raise ConfigError(f"history {source} is not valid JSON: {e}") from e
        if isinstance(source, Mapping) and "results" in source:
            schema = source.get("schema", HISTORY_SCHEMA)
            if schema != HISTORY_SCHEMA:
                raise ConfigError(f"history schema {schema!r} is not supported (this reader reads {HISTORY_SCHEMA!r})")
            return cls.from_results(source["results"])
        if isinstance(source, Mapping):
            out = cls()
            for k, runs in source.items():
                if not (isinstance(k, tuple) and len(k) == 4):
                    raise ConfigError("a history mapping is keyed by (op key, shape signature, dtype, target) tuples")
                out.by_key.setdefault(tuple(map(str, k)), []).extend(runs)
            return out
        return cls.from_results(source)

    @classmethod
    def from_results(cls, results: Iterable[Mapping[str, Any]]) -> History:
        out = cls()
        by_key: dict[HistoryKey, list[Mapping[str, Any]]] = defaultdict(list)
        by_type: dict[HistoryKey, list[Mapping[str, Any]]] = defaultdict(list)
        for i, r in enumerate(results):
            try:
                suffix = _output_suffix(r.get("output"))
                key = (str(r["key"]) + suffix, str(r.get("shape_signature", "")), str(r["dtype"]), str(r.get("target", "")))
                metrics = r["metrics"]
            except (KeyError, TypeError) as e:
                raise ConfigError(f"history result {i} lacks {e}: each needs key, dtype and metrics") from e
            if not isinstance(metrics, Mapping):
                raise ConfigError(f"history result {i}: metrics must be an object")
            by_key[key].append(metrics)
            if r.get("op"):
                by_type[(str(r["op"]) + suffix, key[1], key[2], key[3])].append(metrics)
        out.by_key, out.by_type = dict(by_key), dict(by_type)
        return out

    def runs(self, key: str, op: str, signature: str, dtype: str, target: str,
             min_history: int) -> tuple[list[Mapping[str, Any]], str]:
        """The accepted runs of an op (or of its op type when the op has too few) and the level."""
        own = self.by_key.get((key, signature, dtype, target), [])
        if len(own) >= min_history or not self.by_type:
            return own, "op"
        pooled = self.by_type.get((op, signature, dtype, target), [])
        return (pooled, "op type") if len(pooled) > len(own) else (own, "op")


def _output_suffix(output: Any) -> str:
    """Bands are kept per output of a multi-output op: ``key:N`` for output N > 0 (as record ids)."""
    try:
        n = int(output or 0)
    except (TypeError, ValueError):
        return ""
    return f":{n}" if n > 0 else ""


def metric_value(metrics: Mapping[str, Any], name: str) -> float:
    """A metric from a stored metrics dict (``"inf"``/``"nan"`` strings included)."""
    v = metrics.get(name)
    if v is None and name.startswith("p") and isinstance(metrics.get("quantiles"), Mapping):
        v = metrics["quantiles"].get(name)
    if v is None:
        return math.nan
    return float(v)


def is_nonfinite_outcome(metrics: Mapping[str, Any]) -> bool:
    return any(float(metrics.get(k) or 0) > 0 for k in NONFINITE_KEYS)


def bands_for(history: History, key: str, op: str, signature: str, dtype: str, target: str,
              config: BandConfig) -> tuple[list[Band], int, int]:
    """Bands for each configured metric, and (runs, non-finite runs) of the history used."""
    runs, level = history.runs(key, op, signature, dtype, target, config.min_history)
    nonfinite = sum(1 for r in runs if is_nonfinite_outcome(r))
    out = []
    for name in config.metrics:
        band = fit_band([metric_value(r, name) for r in runs if not is_nonfinite_outcome(r)], name, dtype, level,
                        config, nonfinite)
        if band is not None:
            out.append(band)
    return out, len(runs), nonfinite
