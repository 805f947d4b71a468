"""Deleting data on purpose: one comparison, one bundle, a whole project, or what a retention policy
lets go. Rows go in one transaction; blobs after it commits (a crash in between leaves orphan blobs
that ``opband gc`` removes, never a row without its blob)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import delete, or_, select, union

from api.errors import Conflict, InvalidInput, NotFound
from api.store.blobs import BlobStore
from api.store.db import Database
from api.store.models import BaselineMember, BundleRow, Comparison, Project, Regression, aware, utcnow


def _delete_blobs(store: BlobStore, keys: list[str]) -> None:
    for key in keys:
        store.delete(key)


def delete_comparison(db: Database, project: Project, comparison_id: str, force: bool = False) -> None:
    """Delete a comparison with its results. One a baseline holds needs ``force`` (its bands learn from it);
    regressions it opened or last saw go with it."""
    with db.session() as s:
        c = s.get(Comparison, comparison_id)
        if c is None or c.project_id != project.id:
            raise NotFound(f"comparison {comparison_id!r} does not exist in project {project.name!r}")
        if not force and s.scalar(select(BaselineMember.baseline_id).where(BaselineMember.comparison_id == c.id)):
            raise Conflict(f"comparison {comparison_id} is in a baseline (bands learn from it): remove it from the "
                           "baseline, or send force=true to delete it anyway")
        s.execute(delete(Comparison).where(Comparison.id == c.id))


def delete_bundle(db: Database, store: BlobStore, project: Project, bundle_id: str, force: bool = False) -> None:
    """Delete a bundle, its records and its blob. One that comparisons use needs ``force`` (they go too)."""
    with db.session() as s:
        b = s.get(BundleRow, bundle_id)
        if b is None or b.project_id != project.id:
            raise NotFound(f"bundle {bundle_id!r} does not exist in project {project.name!r}")
        users = list(s.scalars(select(Comparison.id).where(
            or_(Comparison.reference_id == b.id, Comparison.target_id == b.id))))
        if users and not force:
            raise Conflict(f"bundle {bundle_id} is used by {len(users)} comparison(s) (e.g. {users[0]}): delete them "
                           "first, or send force=true to delete them with it")
        key = b.storage_key
        s.execute(delete(Comparison).where(Comparison.id.in_(users)))
        s.execute(delete(BundleRow).where(BundleRow.id == b.id))
    _delete_blobs(store, [key])


def delete_project(db: Database, store: BlobStore, project: Project) -> int:
    """Delete a project with every row and blob of it (tokens included); returns how many blobs went."""
    with db.session() as s:
        keys = list(s.scalars(select(BundleRow.storage_key).where(BundleRow.project_id == project.id)))
        s.execute(delete(Comparison).where(Comparison.project_id == project.id))
        s.execute(delete(Project).where(Project.id == project.id))
    _delete_blobs(store, keys)
    return len(keys)


@dataclass
class RetentionReport:
    """What a retention policy lets go (removed unless a dry run)."""

    comparisons: list[str] = field(default_factory=list)
    bundles: list[str] = field(default_factory=list)
    kept_comparisons: int = 0
    applied: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"comparisons": self.comparisons, "bundles": self.bundles, "kept_comparisons": self.kept_comparisons,
                "applied": self.applied}


def retention(db: Database, store: BlobStore, project: Project, keep_runs: int, keep_days: float,
              apply: bool = False) -> RetentionReport:
    """Per target name, keep the newest ``keep_runs`` comparisons and every one younger than ``keep_days``;
    never one a baseline holds or a regression names (its history). The rest go, and so do bundles that
    no kept comparison uses and that are older than ``keep_days``. A dry run (default) only reports."""
    if keep_runs < 0 or keep_days < 0:
        raise InvalidInput("keep_runs and keep_days must be 0 or more")
    cutoff = utcnow() - timedelta(days=keep_days)
    report = RetentionReport(applied=apply)
    with db.session() as s:
        held = set(s.scalars(union(
            select(BaselineMember.comparison_id),
            select(Regression.first_comparison_id).where(Regression.project_id == project.id),
            select(Regression.last_comparison_id).where(Regression.project_id == project.id))))
        rows = s.execute(
            select(Comparison.id, Comparison.created_at, BundleRow.target)
            .join(BundleRow, BundleRow.id == Comparison.target_id)
            .where(Comparison.project_id == project.id)
            .order_by(BundleRow.target, Comparison.created_at.desc())).all()
        seen: dict[str, int] = {}
        for cid, created, target in rows:
            seen[target] = seen.get(target, 0) + 1
            young = aware(created) >= cutoff
            if seen[target] <= keep_runs or young or cid in held:
                report.kept_comparisons += 1
            else:
                report.comparisons.append(cid)
        gone = set(report.comparisons)
        used = {bid for cid, ref, tgt in s.execute(select(Comparison.id, Comparison.reference_id, Comparison.target_id)
                                                   .where(Comparison.project_id == project.id))
                if cid not in gone for bid in (ref, tgt)}
        bundles = s.execute(select(BundleRow.id, BundleRow.created_at, BundleRow.storage_key)
                            .where(BundleRow.project_id == project.id)).all()
        doomed = [(bid, key) for bid, created, key in bundles if bid not in used and aware(created) < cutoff]
        report.bundles = [bid for bid, _ in doomed]
        if apply:
            s.execute(delete(Comparison).where(Comparison.id.in_(report.comparisons)))
            s.execute(delete(BundleRow).where(BundleRow.id.in_(report.bundles)))
    if apply:
        _delete_blobs(store, [key for _, key in doomed])
    return report
