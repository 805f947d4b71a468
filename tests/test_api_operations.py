"""Operations: health and readiness, JSON logs, Prometheus metrics, and a docker-compose file that validates."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml
from service_fixtures import LiveServer, SynthOp, stop_server, upload_bytes, wait_done, write_bundle

from api.settings import Settings

ROOT = Path(__file__).resolve().parent.parent


def events(server: LiveServer) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in server.log.read_text().splitlines() if line.startswith("{")]


def test_health_ready_logs_metrics(live_server: LiveServer, tmp_path: Path) -> None:
    ops = [SynthOp("m.0"), SynthOp("m.1", noise=0.5)]
    with live_server.client() as c:
        assert c.get("/api/v1/health").json() == {"status": "ok"}
        ready = c.get("/api/v1/ready").json()
        assert ready["status"] == "ready" and ready["queue"] == "embedded" and ready["in_process_workers"] == 2
        assert ready["database"] in ("sqlite", "postgresql") and ready["store"] == "LocalStore"
        body = write_bundle(tmp_path / "a.bundle", ops).read_bytes()
        ref = upload_bytes(c, "o", body).json()["id"]
        tgt = upload_bytes(c, "o", write_bundle(tmp_path / "b.bundle", ops, target=True).read_bytes()).json()["id"]
        job = c.post("/api/v1/projects/o/comparisons", json={"reference": ref, "target": tgt}).json()["id"]
        wait_done(c, job)
        c.get(f"/api/v1/comparisons/{job}/ops")
        c.get("/api/v1/no/such/route")
        done_metric = r'opband_comparison_duration_seconds_count\{status="done"\} 1\.0'
        deadline = time.monotonic() + 15  # a worker observes the job's duration just after its row says done
        while not re.search(done_metric, metrics := c.get("/metrics").text) and time.monotonic() < deadline:
            time.sleep(0.2)
    assert re.search(r'opband_http_requests_total\{method="GET",route="/api/v1/comparisons/\{comparison_id\}/ops",'
                     r'status="200"\} 1\.0', metrics), "requests are counted by route template"
    assert 'route="<unmatched>",status="404"' in metrics
    assert re.search(r'opband_http_request_duration_seconds_count\{method="POST",route="/api/v1/projects/\{project\}/bundles"\} 2\.0', metrics)
    upload = float(re.search(r"^opband_upload_bytes_total (\S+)$", metrics, re.M).group(1))  # type: ignore[union-attr]
    assert upload >= len(body) * 2
    assert re.search(done_metric, metrics)
    assert 'opband_jobs{status="done"} 1.0' in metrics and 'opband_jobs{status="pending"} 0.0' in metrics
    deadline = time.monotonic() + 15
    log = events(live_server)
    while not any(e["message"] == "job finished" for e in log) and time.monotonic() < deadline:
        time.sleep(0.2)
        log = events(live_server)
    requests = [e for e in log if e["message"] == "request"]
    assert {"method", "path", "status", "duration_ms", "route"} <= set(requests[0])
    assert any(e["path"] == f"/api/v1/comparisons/{job}/ops" and e["status"] == 200 for e in requests)
    assert any(e["status"] == 404 and e["route"] == "<unmatched>" for e in requests)
    started = [e for e in log if e["message"] == "job started"]
    finished = [e for e in log if e["message"] == "job finished"]
    assert [e["job_id"] for e in started] == [job] and finished[0]["job_id"] == job
    assert finished[0]["status"] == "done" and finished[0]["duration_ms"] > 0 and finished[0]["worker"]


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_ready_fails_when_database_goes(live_server: LiveServer) -> None:
    import psycopg
    from service_fixtures import PG_ADMIN_URL

    with live_server.client() as c:
        assert c.get("/api/v1/ready").status_code == 200
        name = live_server.database_url.rsplit("/", 1)[1]
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        r = c.get("/api/v1/ready")
        assert r.status_code == 503 and "database" in r.json()["detail"], r.text
        assert c.get("/api/v1/health").status_code == 200
    stop_server(live_server)


@pytest.fixture(scope="module")
def compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())  # type: ignore[no-any-return]


def test_compose_services(compose: dict) -> None:  # type: ignore[type-arg]
    services = compose["services"]
    assert {"postgres", "minio", "minio-init", "migrate", "api", "worker"} <= set(services)
    assert services["worker"]["deploy"]["replicas"] >= 2
    assert "mc mb" in services["minio-init"]["entrypoint"]
    assert services["api"]["environment"]["OPBAND_WORKERS"] == "0"
    for name in ("api", "worker"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_compose_environment_is_valid_settings(compose: dict) -> None:  # type: ignore[type-arg]
    fields = set(Settings.model_fields)
    for name in ("migrate", "api", "worker"):
        env = compose["services"][name]["environment"]
        opband = {k.removeprefix("OPBAND_").lower(): v for k, v in env.items() if k.startswith("OPBAND_")}
        unknown = set(opband) - fields
        assert not unknown, f"{name}: OPBAND_* variables that Settings does not read: {unknown}"
        settings = Settings(**opband)
        assert settings.queue == "database" and settings.auth and settings.host == "0.0.0.0"
        assert settings.effective_store_url.startswith("s3://") and settings.s3_endpoint_url
        assert settings.effective_database_url.startswith("postgresql+psycopg://")
    worker = compose["services"]["worker"]
    assert worker["environment"]["OPBAND_WORKER_METRICS_PORT"] in [str(p) for p in worker["expose"]]
