"""Comparisons that have nothing to compare say so instead of passing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import accuracy
from accuracy.bundle import BundleWriter
from accuracy.manifest import Manifest


def test_empty_bundles_are_an_error_not_a_pass(tmp_path: Path, demo_bundles: dict[str, Path]) -> None:
    empty = tmp_path / "empty.bundle"
    BundleWriter(empty).close(Manifest(run={"variant": "fp32"}))
    with pytest.raises(accuracy.OpbandError, match="nothing to compare: the reference holds 0 records"):
        accuracy.compare(empty, empty)
    with pytest.raises(accuracy.OpbandError, match="target 0"):
        accuracy.compare(demo_bundles["ref"], empty)
    r = subprocess.run([sys.executable, "-m", "api.cli", "compare", str(demo_bundles["ref"]), str(empty)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "nothing to compare" in r.stderr
