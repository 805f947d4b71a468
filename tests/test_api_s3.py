"""The S3 blob store against a real S3-compatible server (moto in server mode), through a live opband server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from service_fixtures import SynthOp, free_port, start_server, stop_server, upload_bytes, wait_done, write_bundle

AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture
def s3_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    for k, v in AWS.items():
        monkeypatch.setenv(k, v)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_upload_compare_download_on_s3(s3_endpoint: str, database_url: str, tmp_path: Path) -> None:
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket="opband-test")
    env = {"OPBAND_STORE_URL": "s3://opband-test/blobs", "OPBAND_S3_ENDPOINT_URL": s3_endpoint, **AWS}
    server = start_server(tmp_path / "data", database_url, env)
    try:
        ops = [SynthOp("m.0"), SynthOp("m.1", noise=0.5)]
        ref_bytes = write_bundle(tmp_path / "a.bundle", ops).read_bytes()
        with server.client() as c:
            ready = c.get("/api/v1/ready").json()
            assert ready["store"] == "S3Store", ready
            ref = upload_bytes(c, "s", ref_bytes).json()
            tgt = upload_bytes(c, "s", write_bundle(tmp_path / "b.bundle", ops, target=True).read_bytes()).json()
            assert upload_bytes(c, "s", ref_bytes).json()["id"] == ref["id"]
            keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="opband-test")["Contents"])
            assert keys == sorted([f"blobs/s/{ref['sha256']}.bundle", f"blobs/s/{tgt['sha256']}.bundle"])
            assert upload_bytes(c, "s", b"not a bundle").status_code == 422
            assert len(s3.list_objects_v2(Bucket="opband-test")["Contents"]) == 2, "a refused upload stores nothing"
            job = c.post("/api/v1/projects/s/comparisons", json={"reference": ref["id"], "target": tgt["id"]}).json()
            done = wait_done(c, job["id"])
            assert done["status"] == "done" and done["counts"]["fail"] == 1, done
            assert c.get(f"/api/v1/bundles/{ref['id']}/content").content == ref_bytes
            s3.delete_object(Bucket="opband-test", Key=keys[0])
            s3.delete_object(Bucket="opband-test", Key=keys[1])
            s3.delete_bucket(Bucket="opband-test")
            gone = c.get("/api/v1/ready")
            assert gone.status_code == 503 and "bucket 'opband-test' does not exist" in gone.json()["detail"]
            refused = upload_bytes(c, "s", write_bundle(tmp_path / "c.bundle", [SynthOp("m.9")]).read_bytes())
            assert refused.status_code == 503 and "blob store" in refused.json()["detail"], refused.text
            assert c.get("/api/v1/projects/s/bundles").json()["count"] == 2
    finally:
        stop_server(server)
