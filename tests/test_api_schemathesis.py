"""Schemathesis against a live server, on SQLite and PostgreSQL, with auth off and on: a bounded run
(fixed seed, a few examples per operation) that must find no server error and no response that
breaks the OpenAPI document (status codes, content types, bodies)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from service_fixtures import (
    LiveServer, SynthOp, create_token, start_server, stop_server, upload_bytes, wait_done, write_bundle,
)

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
EXAMPLES = 8
SEED = 13


#: (backend, auth): make test runs one of each backend and each auth mode; make sweep runs all four
CONFIGS = [pytest.param(("sqlite", False), id="sqlite-auth-off"), pytest.param(("postgresql", True), id="postgresql-auth-on"),
           pytest.param(("sqlite", True), id="sqlite-auth-on", marks=pytest.mark.sweep),
           pytest.param(("postgresql", False), id="postgresql-auth-off", marks=pytest.mark.sweep)]


@pytest.fixture
def fuzzed(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[LiveServer, str | None]]:
    backend, auth = request.param
    database_url = f"sqlite:///{tmp_path / 'opband.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    server = start_server(tmp_path / "data", database_url, {"OPBAND_AUTH": "true"} if auth else {})
    try:
        yield server, (create_token(server, "st") if auth else None)
    finally:
        stop_server(server)


def seed_project(server: LiveServer, tmp_path: Path, token: str | None) -> dict[str, object]:
    """A project with bundles, a finished failing comparison, a regression, a deviation and a baseline,
    so that generated requests reach real rows, not only 404s."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    ops = [SynthOp("m.0"), SynthOp("m.1", noise=0.5)]
    with httpx.Client(base_url=server.url, timeout=60, headers=headers) as c:
        ref = upload_bytes(c, "st", write_bundle(tmp_path / "r.bundle", ops).read_bytes(), token).json()["id"]
        tgt = upload_bytes(c, "st", write_bundle(tmp_path / "t.bundle", ops, target=True).read_bytes(), token).json()["id"]
        cid = c.post("/api/v1/projects/st/comparisons", json={"reference": ref, "target": tgt}).json()["id"]
        wait_done(c, cid)
        reg = c.get("/api/v1/projects/st/regressions").json()["data"][0]["id"]
        dev = c.post("/api/v1/projects/st/deviations", json={"key_pattern": "x.*", "reason": "r", "author": "a"}).json()
        c.post("/api/v1/projects/st/baselines", json={"name": "main"}).raise_for_status()
    return {"project": "st", "bundle_id": ref, "a": ref, "b": tgt, "comparison_id": cid, "regression_id": reg,
            "deviation_id": dev["id"], "name": "main"}


def schemathesis(server: LiveServer, token: str | None, tmp_path: Path, known: dict[str, object] | None) -> str:
    """One bounded schemathesis run; returns its output, failing the test on any finding."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "schemathesis.toml"
    lines = []
    if known:
        lines.append("[parameters]")
        lines += [f'{name} = {value!r}'.replace("'", '"') for name, value in known.items()]
    config.write_text("\n".join(lines) + "\n")
    args = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run",
            f"{server.url}/openapi.json", "--checks", CHECKS, "--max-examples", str(EXAMPLES), "--seed", str(SEED),
            "--workers", "1", "--no-shrink", "--request-timeout", "30", "--phases", "examples,coverage,fuzzing"]
    if token:
        args += ["--header", f"Authorization: Bearer {token}"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    report = out.stdout + out.stderr
    assert out.returncode == 0, f"schemathesis found problems:\n{report[-8000:]}\nserver log:\n{server.log.read_text()[-3000:]}"
    assert " passed" in report and "failed" not in report.split("SUMMARY")[-1], report[-3000:]
    return report


@pytest.mark.parametrize("fuzzed", CONFIGS, indirect=True)
def test_schemathesis_finds_no_server_error_and_no_schema_violation(
        fuzzed: tuple[LiveServer, str | None], tmp_path: Path) -> None:
    """Before: 15, 60, 0 and 1 server errors in the four configurations, and a document that lied."""
    server, token = fuzzed
    known = seed_project(server, tmp_path, token)
    schemathesis(server, token, tmp_path / "free", None)  # every parameter generated (ids past ranges, NULs, ...)
    schemathesis(server, token, tmp_path / "known", known)  # the seeded rows' names and ids: deep paths
    with server.client() as c:
        assert c.get("/api/v1/health").status_code == 200


def test_openapi_document_describes_errors_security_and_upload() -> None:
    from api.app import create_app

    doc = create_app().openapi()
    assert doc["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http", "scheme": "bearer", "description": doc["components"]["securitySchemes"]["HTTPBearer"]["description"]}
    upload = doc["paths"]["/api/v1/projects/{project}/bundles"]["post"]
    assert upload["requestBody"]["content"] == {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
    assert {"200", "201", "400", "401", "403", "404", "408", "413", "422", "503"} <= set(upload["responses"])
    content = doc["paths"]["/api/v1/bundles/{bundle_id}/content"]["get"]["responses"]["200"]["content"]
    assert list(content) == ["application/octet-stream"]
    v422 = doc["components"]["schemas"]["ValidationErrorPublic"]["properties"]
    assert v422["detail"]["type"] == "string" and v422["errors"]["type"] == "array"
    ops = doc["paths"]["/api/v1/comparisons/{comparison_id}/ops"]["get"]["parameters"]
    sort = next(p for p in ops if p["name"] == "sort")
    assert "worst" in sort["schema"]["enum"]
    patch = doc["paths"]["/api/v1/regressions/{regression_id}"]["patch"]
    rid = next(p for p in patch["parameters"] if p["name"] == "regression_id")
    assert rid["schema"]["maximum"] == 2**31 - 1
