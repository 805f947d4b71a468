"""A project's op coverage from the index: op records of its bundles, regimes of its sweeps and the
verdicts of each bundle's latest comparison as target (``accuracy.coverage`` does the counting)."""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import select

from accuracy.coverage import COUNTED_KINDS, Exercise, compute_dtype, model_name
from api.store.db import Database
from api.store.models import BundleRow, Comparison, OpRecordRow, OpResultRow, Project

#: A verdict reason written by a band check (accuracy.verdicts): "... <= band 4.0e-03 (...)" or
#: "... in 3 of 12 accepted runs"; every other reason comes from the default budget.
_BAND_REASON = re.compile(r"(?:[<>]=? band \d|accepted runs)")


def band_state(reason: str) -> str:
    return "band" if _BAND_REASON.search(reason or "") else "budget"


def project_exercises(db: Database, project: Project, max_bundles: int = 200) -> list[Exercise]:
    """Every counted op record of the project's latest ``max_bundles`` bundles, with its verdict."""
    with db.session() as s:
        bundles = list(s.scalars(select(BundleRow).where(BundleRow.project_id == project.id)
                                 .order_by(BundleRow.created_at.desc()).limit(max_bundles)))
        bundles.reverse()
        ids = [b.id for b in bundles]
        regimes: dict[str, str] = {}
        for b in bundles:
            cases = ((b.run or {}).get("sweep") or {}).get("cases") or {}
            regimes.update({k: str(v.get("regime")) for k, v in cases.items() if isinstance(v, dict)})
        latest: dict[str, str] = {}
        for c in s.scalars(select(Comparison).where(Comparison.project_id == project.id, Comparison.status == "done",
                                                    Comparison.target_id.in_(ids)).order_by(Comparison.created_at)):
            latest[c.target_id] = c.id
        verdicts: dict[tuple[str, int], tuple[str, str]] = {}
        if latest:
            target_of = {cid: bid for bid, cid in latest.items()}
            for row in s.execute(select(OpResultRow.comparison_id, OpResultRow.index, OpResultRow.verdict,
                                        OpResultRow.inherited, OpResultRow.reason)
                                 .where(OpResultRow.comparison_id.in_(list(latest.values())))):
                if row.verdict != "missing":
                    verdicts[(target_of[row.comparison_id], row.index)] = (
                        "inherited" if row.inherited else row.verdict, band_state(row.reason))
        by_id = {b.id: b for b in bundles}
        out = []
        for r in s.execute(select(OpRecordRow.bundle_id, OpRecordRow.key, OpRecordRow.op, OpRecordRow.index,
                                  OpRecordRow.shape_signature, OpRecordRow.dtype)
                           .where(OpRecordRow.bundle_id.in_(ids), OpRecordRow.kind.in_(COUNTED_KINDS))
                           .order_by(OpRecordRow.bundle_id, OpRecordRow.index)):
            b = by_id[r.bundle_id]
            run: dict[str, Any] = b.run or {}
            call = (run.get("calls") or {}).get(r.key)
            verdict, band = verdicts.get((b.id, r.index), (None, None))
            out.append(Exercise(model_name(run, b.label or b.id), r.op, compute_dtype([], r.dtype, b.variant),
                                r.shape_signature,
                                regimes.get(r.key, "model"), call.get("target") if isinstance(call, dict) else None,
                                r.key, verdict, band))
    return out
