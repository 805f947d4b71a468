"""Service test fixtures: private PostgreSQL databases, migrated SQLite files, live uvicorn servers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

PG_ADMIN_URL = os.environ.get("OPBAND_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


def _pg_admin():  # type: ignore[no-untyped-def]
    import psycopg

    try:
        return psycopg.connect(PG_ADMIN_URL.replace("postgresql+psycopg://", "postgresql://"), autocommit=True,
                               connect_timeout=5)
    except psycopg.OperationalError as e:
        if os.environ.get("OPBAND_TEST_ALLOW_NO_PG") == "1":
            pytest.skip(f"PostgreSQL not reachable at {PG_ADMIN_URL}: {e}")
        pytest.fail(f"PostgreSQL must be reachable at {PG_ADMIN_URL} for these tests (CI starts it in .ci/run); "
                    f"set OPBAND_TEST_ALLOW_NO_PG=1 to skip them on a machine without it. Error: {e}")


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A private, empty PostgreSQL database for one test, dropped afterwards."""
    name = f"opband_test_{uuid.uuid4().hex[:12]}"
    with _pg_admin() as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    try:
        yield f"{base}/{name}"
    finally:
        with _pg_admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each service test runs once on SQLite and once on a private PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'opband.db'}"
    return request.getfixturevalue("pg_url")  # type: ignore[no-any-return]


@dataclass
class LiveServer:
    url: str
    data_dir: Path
    database_url: str
    process: subprocess.Popen[bytes]
    log: Path

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)

    def blob_files(self) -> list[Path]:
        root = self.data_dir / "blobs"
        return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(data_dir: Path, database_url: str, extra_env: dict[str, str] | None = None,
                 preexec_fn: Callable[[], None] | None = None, port: int | None = None) -> LiveServer:
    """Migrate, then start ``opband serve`` in a subprocess (a real uvicorn) and wait until healthy.

    ``preexec_fn`` runs in the child before it starts (e.g. to set a resource limit); ``port`` reuses
    a port (a restart)."""
    from api.store.db import upgrade

    upgrade(database_url)
    port = port or free_port()
    env = {**os.environ, "OPBAND_DATABASE_URL": database_url, "OPBAND_DATA_DIR": str(data_dir), **(extra_env or {})}
    log = data_dir / "server.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "opband.cli", "serve", "--port", str(port), "--data-dir", str(data_dir)],
        env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, preexec_fn=preexec_fn,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url + "/api/v1/health", timeout=1).status_code == 200:
                return LiveServer(url, data_dir, database_url, proc, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server did not become healthy:\n{log.read_text()}")


def stop_server(server: LiveServer) -> None:
    server.process.terminate()
    try:
        server.process.wait(15)
    except subprocess.TimeoutExpired:
        server.process.kill()


@pytest.fixture
def live_server(tmp_path: Path, database_url: str) -> Iterator[LiveServer]:
    server = start_server(tmp_path / "data", database_url)
    try:
        yield server
    finally:
        stop_server(server)


def wait_done(client: httpx.Client, comparison_id: str, timeout: float = 120) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c = client.get(f"/api/v1/comparisons/{comparison_id}").json()
        if c["status"] in ("done", "failed"):
            return c  # type: ignore[no-any-return]
        time.sleep(0.2)
    raise AssertionError(f"comparison {comparison_id} not finished after {timeout}s")


# --- synthetic bundles, tokens and worker processes (tests/test_api_*.py) -------------------------

@dataclass(frozen=True)
class SynthOp:
    """One captured op of a synthetic bundle; ``noise`` is added to the target's values only."""

    module: str
    op: str = "aten.mm"
    shape: tuple[int, ...] = (64,)
    noise: float = 0.0
    nan: bool = False  # the target's first element is NaN where the reference is finite


def write_bundle(path: Path, ops: list[SynthOp], *, target: bool = False, variant: str = "fp32",
                 environment: dict | None = None, seed: int = 0, run: dict | None = None) -> Path:  # type: ignore[type-arg]
    """A real opband bundle (accuracy.bundle.BundleWriter) from random float32 values.

    The reference values depend only on each op's position, so a reference and a target written
    from the same ops line up; the target adds each op's ``noise`` (relative, Gaussian).
    """
    import numpy as np

    from accuracy.bundle import BundleWriter
    from accuracy.manifest import Manifest, Record

    records = []
    ordinals: dict[tuple[str, str], int] = {}
    rng = np.random.default_rng(seed)
    with BundleWriter(path) as w:
        for i, o in enumerate(ops):
            values = np.random.default_rng(1000 + i).standard_normal(o.shape).astype(np.float32)
            if target and o.noise:
                values = values + (o.noise * rng.standard_normal(o.shape)).astype(np.float32)
            if target and o.nan:
                values.reshape(-1)[0] = np.nan
            ordinal = ordinals.get((o.module, o.op), 0)
            ordinals[(o.module, o.op)] = ordinal + 1
            name = f"t{i}"
            w.add_array(name, values)
            records.append(Record(key=f"{o.module}/{o.op}#{ordinal}", module=o.module, op=o.op, ordinal=ordinal,
                                  index=i, input_shapes=[list(o.shape)], input_dtypes=["float32"],
                                  shape=list(o.shape), dtype="float32", tensor=name))
        env = {"torch": "2.13.0", "device": "cpu", "threads": 2, **(environment or {})}
        return w.close(Manifest(run={"variant": variant, "device": env["device"], "level": "aten", "mode": "full",
                                     **(run or {})},
                                environment=env, records=records))


def create_token(server: LiveServer, project: str, read_only: bool = False) -> str:
    """``opband token create`` against the server's database, as an operator would run it."""
    args = [sys.executable, "-m", "opband.cli", "token", "create", "--project", project, "--data-dir", str(server.data_dir)]
    out = subprocess.run(args + (["--read-only"] if read_only else []), capture_output=True, text=True, timeout=60,
                         env={**os.environ, "OPBAND_DATABASE_URL": server.database_url})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def start_worker(data_dir: Path, database_url: str, extra_env: dict[str, str] | None = None,
                 log_name: str = "worker") -> tuple[subprocess.Popen[bytes], Path]:
    """An ``opband worker`` subprocess claiming jobs from ``database_url``; returns (process, log file)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / f"{log_name}.log"
    env = {**os.environ, "OPBAND_DATABASE_URL": database_url, "OPBAND_DATA_DIR": str(data_dir), **(extra_env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "opband.cli", "worker", "--data-dir", str(data_dir)],
                            env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    return proc, log


def upload_bytes(client: httpx.Client, project: str, body: bytes, token: str | None = None) -> httpx.Response:
    headers = {"Content-Type": "application/octet-stream"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return client.post(f"/api/v1/projects/{project}/bundles", content=body, headers=headers)
