"""What people decide about results: baselines, accepted deviations, regression status, project visibility."""

from __future__ import annotations

import fnmatch

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError

from accuracy.verdicts import Verdict
from api.store.db import Database
from api.errors import Conflict, InvalidInput, NotFound
from api.store.models import (
    AcceptedDeviation, Baseline, BaselineMember, Comparison, Project, Regression, RegressionEvent, aware, utcnow,
)
from api.schemas import BaselinePublic, DeviationCreate, DeviationPublic


def set_public(db: Database, project: Project, public: bool) -> Project:
    with db.session() as s:
        row = s.get(Project, project.id)
        assert row is not None
        row.public = public
    return row


def _baseline_public(s: object, b: Baseline) -> BaselinePublic:
    ids = list(s.scalars(select(BaselineMember.comparison_id)  # type: ignore[attr-defined]
                         .where(BaselineMember.baseline_id == b.id).order_by(BaselineMember.added_at)))
    return BaselinePublic(name=b.name, created_at=b.created_at, comparisons=ids)


def _baseline(s: object, project: Project, name: str) -> Baseline:
    b = s.scalar(select(Baseline).where(Baseline.project_id == project.id, Baseline.name == name))  # type: ignore[attr-defined]
    if b is None:
        raise NotFound(f"baseline {name!r} does not exist in project {project.name!r}: create it with "
                       f"POST /projects/{project.name}/baselines")
    return b  # type: ignore[no-any-return]


def create_baseline(db: Database, project: Project, name: str) -> BaselinePublic:
    try:
        with db.session() as s:
            b = Baseline(project_id=project.id, name=name)
            s.add(b)
            s.flush()
            return _baseline_public(s, b)
    except IntegrityError:
        raise Conflict(f"baseline {name!r} already exists in project {project.name!r}") from None


def list_baselines(db: Database, project: Project) -> list[BaselinePublic]:
    with db.session() as s:
        rows = s.scalars(select(Baseline).where(Baseline.project_id == project.id).order_by(Baseline.name))
        return [_baseline_public(s, b) for b in rows]


def get_baseline(db: Database, project: Project, name: str) -> BaselinePublic:
    with db.session() as s:
        return _baseline_public(s, _baseline(s, project, name))


def delete_baseline(db: Database, project: Project, name: str) -> None:
    with db.session() as s:
        s.delete(_baseline(s, project, name))


def promote(db: Database, project: Project, name: str, comparison_id: str, force: bool = False) -> BaselinePublic:
    """Accept a finished comparison into a baseline (its results become history that bands learn from)."""
    with db.session() as s:
        b = _baseline(s, project, name)
        c = s.get(Comparison, comparison_id)
        if c is None or c.project_id != project.id:
            raise NotFound(f"comparison {comparison_id!r} does not exist in project {project.name!r}")
        if c.status != "done":
            raise Conflict(f"comparison {comparison_id} is {c.status}: only a finished comparison can be promoted")
        if c.verdict == Verdict.FAIL and not force:
            raise Conflict(f"comparison {comparison_id} has verdict fail: accept its deviations first, or send "
                           "force=true to promote it anyway")
        if s.get(BaselineMember, (b.id, c.id)) is None:
            s.add(BaselineMember(baseline_id=b.id, comparison_id=c.id))
            s.flush()
        return _baseline_public(s, b)


def regression_event(reg: Regression, status: str, actor: str, note: str | None,
                     deviation: AcceptedDeviation | None = None) -> RegressionEvent:
    """The audit row of one change of a regression's status, a person's or opband's own (``actor``)."""
    return RegressionEvent(project_id=reg.project_id, regression_id=reg.id, status=status, actor=actor,
                           note=note[:2000] if note else note, deviation_id=deviation.id if deviation else None,
                           expires_at=deviation.expires_at if deviation else None)


def create_deviation(db: Database, project: Project, body: DeviationCreate) -> DeviationPublic:
    """Record an accepted deviation; open regressions it matches become 'accepted' now."""
    if body.expires_at is not None and aware(body.expires_at) <= utcnow():
        raise InvalidInput(f"expires_at {body.expires_at.isoformat()} is in the past: an expired deviation accepts nothing")
    with db.session() as s:
        d = AcceptedDeviation(project_id=project.id, **body.model_dump())
        s.add(d)
        s.flush()
        matched = 0
        for reg in s.scalars(select(Regression).where(Regression.project_id == project.id,
                                                      Regression.status.in_(("active", "acknowledged")))):
            if fnmatch.fnmatchcase(reg.key, d.key_pattern) and d.shape_signature in (None, reg.shape_signature):
                reg.status, reg.accepted_by, reg.updated_at = "accepted", d.id, utcnow()
                s.add(regression_event(reg, "accepted", d.author, d.reason, d))
                matched += 1
        out = DeviationPublic.model_validate(d)
        out.accepted_regressions = matched
        return out


def list_deviations(db: Database, project: Project, include_expired: bool = False) -> list[DeviationPublic]:
    now = utcnow()
    with db.session() as s:
        rows = s.scalars(select(AcceptedDeviation).where(AcceptedDeviation.project_id == project.id)
                         .order_by(AcceptedDeviation.created_at.desc()))
        return [DeviationPublic.model_validate(d) for d in rows
                if include_expired or d.expires_at is None or aware(d.expires_at) > now]


def delete_deviation(db: Database, project: Project, deviation_id: int, actor: str = "anonymous") -> None:
    """Withdraw an acceptance: the regressions it accepted are open ("active") again."""
    with db.session() as s:
        # FOR UPDATE: a job crediting this deviation (its FK check takes a key-share lock on the row)
        # either commits first, and the UPDATE below sees its row, or waits and then fails its FK
        # check and is retried; so no regression is left "accepted" by a deviation that is gone
        if s.scalar(select(AcceptedDeviation.id).where(AcceptedDeviation.id == deviation_id,
                                                       AcceptedDeviation.project_id == project.id)
                    .with_for_update()) is None:
            raise NotFound(f"accepted deviation {deviation_id} does not exist in project {project.name!r}")
        reopened = list(s.scalars(select(Regression.id).where(Regression.accepted_by == deviation_id,
                                                              Regression.status == "accepted")))
        s.execute(update(Regression).where(Regression.id.in_(reopened))
                  .values(status="active", accepted_by=None, updated_at=utcnow()))
        s.add_all(RegressionEvent(project_id=project.id, regression_id=r, status="active", actor=actor,
                                  note=f"accepted deviation {deviation_id} withdrawn", deviation_id=deviation_id)
                  for r in reopened)
        s.execute(delete(AcceptedDeviation).where(AcceptedDeviation.id == deviation_id))


def set_regression_status(db: Database, regression_id: int, status: str, actor: str = "anonymous",
                          note: str | None = None) -> Regression:
    """A person's decision about a regression (kept by later comparisons), recorded in its audit."""
    with db.session() as s:
        reg = s.get(Regression, regression_id)
        if reg is None:
            raise NotFound(f"regression {regression_id} does not exist")
        reg.status, reg.accepted_by, reg.updated_at = status, None, utcnow()  # a person's decision: kept
        s.add(RegressionEvent(project_id=reg.project_id, regression_id=reg.id, status=status, actor=actor, note=note))
    return reg
