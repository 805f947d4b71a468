"""A worker survives a job that cannot even be set up; the job is retried once its lease expires."""

from __future__ import annotations

import hashlib
import shutil
import time
import uuid
from pathlib import Path

import pytest
from service_fixtures import SynthOp, write_bundle

import api.jobs.comparisons as jobs
from api.auth import get_or_create_project
from api.store.db import upgrade
from api.store.ingest import SpooledUpload, store_bundle
from api.store.models import Comparison
from api.services import Services
from api.settings import Settings


def test_worker_outlives_a_database_hiccup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'opband.db'}"
    upgrade(url)
    svc = Services.open(Settings(database_url=url, data_dir=tmp_path / "data", workers=1, job_lease_seconds=5,
                                     job_in_child_process=False))  # the fault below is injected in this process
    try:
        proj = get_or_create_project(svc.db, "p")
        ids = []
        for is_target in (False, True):
            path = write_bundle(tmp_path / f"{is_target}.bundle", [SynthOp("m", noise=0.1 if is_target else 0)],
                                target=is_target)
            spool = tmp_path / f"{is_target}.up"
            shutil.copy(path, spool)
            data = path.read_bytes()
            ids.append(store_bundle(svc.db, svc.store, proj,
                                    SpooledUpload(spool, hashlib.sha256(data).hexdigest(), len(data)))[0].id)
        real, calls = jobs.accepted_history, []

        def flaky(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("database hiccup")
            return real(*args, **kwargs)

        monkeypatch.setattr(jobs, "accepted_history", flaky)

        def queue() -> str:
            with svc.db.session() as s:
                c = Comparison(id=uuid.uuid4().hex, project_id=proj.id, reference_id=ids[0], target_id=ids[1])
                s.add(c)
            svc.workers.notify()
            return c.id

        first = queue()
        svc.workers.start()
        second = queue()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with svc.db.session() as s:
                states = [s.get(Comparison, j).status for j in (first, second)]  # type: ignore[union-attr]
            if states == ["done", "done"]:
                break
            time.sleep(0.2)
        assert states == ["done", "done"], states
        assert svc.workers.alive() == 1, "the worker thread must survive the failed job"
        assert len(calls) >= 3, "the interrupted job ran again after its lease expired"
    finally:
        svc.close()
