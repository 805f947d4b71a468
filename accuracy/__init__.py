"""opband's pure core: bundle format, alignment, metrics, budgets, verdicts and reports.

Imports neither ``hooks`` nor ``api``, and no torch, web or database code.
"""

from accuracy.bands import BandConfig, History
from accuracy.budgets import BudgetPolicy
from accuracy.bundle import Bundle, BundleWriter
from accuracy.compare import ComparisonReport, OpResult, compare
from accuracy.errors import BundleError, ConfigError, OpbandError
from accuracy.manifest import Manifest, Record
from accuracy.metrics import Metrics, compare_arrays

__all__ = [
    "BandConfig", "BudgetPolicy", "Bundle", "BundleError", "History", "BundleWriter", "ComparisonReport", "ConfigError", "Manifest", "Metrics",
    "OpResult", "OpbandError", "Record", "compare", "compare_arrays",
]
