"""Shared fixtures. Room-specific fixtures live in the test modules of that room."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    """Where tests leave files a person should look at (screenshots, reports)."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def demo_bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Captures of the demo decoder: fp32 twice (2 threads and 1), bf16 and int8 (aten level, full mode)."""
    import torch

    from hooks import run_capture

    out = tmp_path_factory.mktemp("bundles")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the second fp32 run differs in thread count: a benign variation
    try:
        ref2 = run_capture("hooks.demo_model:build", out / "ref2.bundle", device="cpu")
    finally:
        torch.set_num_threads(threads)
    paths = {
        "ref": run_capture("hooks.demo_model:build", out / "ref.bundle", device="cpu"),
        "ref2": ref2,
        "bf16": run_capture("hooks.demo_model:build", out / "bf16.bundle", device="cpu", variant="bf16"),
        "int8": run_capture("hooks.demo_model:build", out / "int8.bundle", device="cpu", variant="int8"),
    }
    return paths


from service_fixtures import database_url, live_server, pg_url  # noqa: E402,F401  (shared service fixtures)
