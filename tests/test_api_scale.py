"""Bounded memory per request: the API server's peak RSS does not grow with a bundle's record count.

Before: a 200k-record bundle cost the server 1.28 GB to upload (the manifest parsed in the server,
one ORM object per record) and 3.1 GB to compare. Now the manifest is parsed in a short-lived child
process, records and results are inserted in batches, and each comparison runs in a child process
of its own, so the API server's peak (VmHWM) stays where it was.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from service_fixtures import SynthOp, start_server, stop_server, upload_bytes, wait_done, write_bundle

#: what the API server's peak RSS may grow by over a run that uploads, compares and pages through a
#: bundle; the manifest alone is ~4 KB per record once parsed (400 MB at 10^5 records)
GROWTH_MB = 40


def peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def run_at_scale(tmp_path: Path, database_url: str, records: int, compare: bool) -> dict[str, float]:
    body = write_bundle(tmp_path / "n.bundle", [SynthOp(f"model.layers.{i // 100}.mlp", shape=(4,))
                                                 for i in range(records)]).read_bytes()
    # the embedded setup: comparisons run by the API process's workers, each in a child process
    server = start_server(tmp_path / "data", database_url, {"OPBAND_WORKERS": "1"})
    try:
        with httpx.Client(base_url=server.url, timeout=1800) as c:
            small = write_bundle(tmp_path / "s.bundle", [SynthOp("m.0")]).read_bytes()
            assert upload_bytes(c, "s", small).status_code == 201  # warm: every code path loaded once
            before = peak_mb(server.process.pid)
            up = upload_bytes(c, "s", body)
            assert up.status_code == 201 and up.json()["records"] == records, up.text
            out = {"upload": peak_mb(server.process.pid) - before}
            if compare:
                bid = up.json()["id"]
                job = c.post("/api/v1/projects/s/comparisons", json={"reference": bid, "target": bid}).json()["id"]
                done = wait_done(c, job, timeout=3000)
                assert done["status"] == "done" and done["counts"]["pass"] == records, done
                ops = c.get(f"/api/v1/comparisons/{job}/ops", params={"limit": 1000, "offset": records - 1000})
                assert ops.json()["count"] == records and len(ops.json()["data"]) == 1000
                out["compare+query"] = peak_mb(server.process.pid) - before
            return out
    finally:
        stop_server(server)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_upload_memory_is_flat(tmp_path: Path, database_url: str) -> None:
    growth = run_at_scale(tmp_path, database_url, 20_000, compare=False)
    assert growth["upload"] < GROWTH_MB, growth


@pytest.mark.sweep
def test_upload_and_compare_of_100k_records_keep_the_server_flat(tmp_path: Path, database_url: str) -> None:
    growth = run_at_scale(tmp_path, database_url, 100_000, compare=True)
    print(growth)
    assert growth["upload"] < GROWTH_MB and growth["compare+query"] < GROWTH_MB, growth
