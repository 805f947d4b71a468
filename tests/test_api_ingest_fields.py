"""Odd but schema-valid manifests: free-form metadata is stored bounded, over-long indexed fields get a 422."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from service_fixtures import LiveServer

from accuracy.bundle import BundleWriter
from accuracy.manifest import Manifest, Record


def odd_bundle(path: Path, run: dict[str, Any] | None = None, env: dict[str, Any] | None = None,
               op: str = "aten.mm", dtype: str = "float32") -> bytes:
    w = BundleWriter(path)
    w.add_array("t0", np.ones(4, np.float32))
    w.close(Manifest(run=run or {}, environment=env or {}, records=[
        Record(key=f"m/{op}#0", module="m", op=op, index=0, shape=[4], dtype=dtype, tensor="t0")]))
    return path.read_bytes()


STORED = {
    "long_label": {"run": {"label": "L" * 300}},
    "long_variant": {"run": {"variant": "v" * 60}},
    "int_level": {"run": {"level": 3}},
    "dict_level": {"run": {"level": {"a": 1}}},
    "list_commit": {"env": {"git_commit": ["x"]}},
}
REFUSED = {"long_op": {"op": "o" * 300}, "long_dtype": {"dtype": "f" * 50}}


def test_odd_manifests_never_give_a_5xx(live_server: LiveServer, tmp_path: Path) -> None:
    with live_server.client() as c:
        for name, kw in STORED.items():
            r = c.post("/api/v1/projects/odd/bundles", content=odd_bundle(tmp_path / f"{name}.bundle", **kw))
            assert r.status_code == 201, (name, r.status_code, r.text)
        blobs = live_server.blob_files()
        for name, kw in REFUSED.items():
            r = c.post("/api/v1/projects/odd/bundles", content=odd_bundle(tmp_path / f"{name}.bundle", **kw))
            assert r.status_code == 422, (name, r.status_code, r.text)
            assert "this server indexes at most" in r.json()["detail"]
        assert live_server.blob_files() == blobs, "a refused upload must leave no blob"
        listing = c.get("/api/v1/projects/odd/bundles")
        assert listing.status_code == 200 and listing.json()["count"] == len(STORED)
        labels = {b["label"] for b in listing.json()["data"]}
        assert "L" * 200 in labels, "an over-long label is stored truncated to its column"
