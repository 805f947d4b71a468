"""``benchmarks/gpu_check.py`` stays runnable for the session that is lent a GPU: its CPU dry run
captures, compares and prints the table here, and without CUDA the default run says what to do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def test_dry_run_on_cpu_prints_one_row_per_target(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [line for line in p.stdout.splitlines() if line.startswith("| fp32 on cpu |") or line.startswith("| bf16 on cpu |")]
    assert len(rows) == 2
    assert "statistics on cpu: ok: device and host statistics agree" in p.stdout, p.stdout[-2000:]
    assert rows[0].split("|")[2].strip() == "pass" and "none" in rows[0]  # same device, same dtype: bitwise equal
    reports = json.loads((tmp_path / "reports.json").read_text())
    bf16 = reports["bf16 on cpu"]
    worst = max(o["metrics"]["norm_l2"] for o in bf16["ops"] if o.get("metrics"))
    assert 1e-3 < worst < 0.1  # bf16 rounding: visible, within the bf16 budgets
    assert sorted(p.name for p in tmp_path.glob("*.bundle")) == ["ref-fp32-cpu.bundle", "tgt-bf16-cpu.bundle",
                                                                 "tgt-fp32-cpu.bundle"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a CUDA device the default run is the real check")
def test_without_cuda_the_default_run_says_what_to_do(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 2 and "--device cpu" in p.stderr


def test_the_device_session_script_parses_and_names_files_that_exist() -> None:
    """``benchmarks/gpu_session.sh`` (the one device call a GPU session makes) is valid bash and every
    script and test file it runs is here."""
    script = ROOT / "benchmarks" / "gpu_session.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0
    text = script.read_text()
    named = {w for w in text.replace('"', " ").split() if w.startswith(("benchmarks/", "tests/")) and w.endswith(".py")}
    assert {"benchmarks/gpu_check.py", "benchmarks/capture.py", "tests/test_hooks_gpu.py"} <= named
    assert all((ROOT / w).is_file() for w in named), sorted(w for w in named if not (ROOT / w).is_file())
