"""Routes for reviewing results: project visibility, baselines, accepted deviations, regression status, bundle diffs."""

from __future__ import annotations

from fastapi import APIRouter, Response

from api.store import curation, queries
from api.auth import authorize, token_name
from api.store.models import Project
from api.limits import RowId
from api.routes.core import BundleId, ProjectName, ServicesDep, TokenDep, readable, readable_bundle, read_project
from api.schemas import (
    BaselineCreate, BaselinePromote, BaselinePublic, BundleDiff, DeviationCreate, DeviationPublic, Page,
    ProjectPublic, ProjectUpdate, RegressionPublic, RegressionUpdate,
)
from api.services import Services

router = APIRouter()


def write_project(svc: Services, name: str, token: str | None) -> Project:
    return authorize(svc.db, name, token, write=True, auth_on=svc.settings.auth)


@router.patch("/projects/{project}", response_model=ProjectPublic)
def update_project(project: ProjectName, body: ProjectUpdate, svc: ServicesDep, token: TokenDep) -> ProjectPublic:
    """Make a project public (readable without a token) or private again."""
    row = curation.set_public(svc.db, write_project(svc, project, token), body.public)
    return ProjectPublic.model_validate(row)


@router.post("/projects/{project}/baselines", status_code=201, response_model=BaselinePublic)
def create_baseline(project: ProjectName, body: BaselineCreate, svc: ServicesDep, token: TokenDep) -> BaselinePublic:
    return curation.create_baseline(svc.db, write_project(svc, project, token), body.name)


@router.get("/projects/{project}/baselines", response_model=Page[BaselinePublic])
def list_baselines(project: ProjectName, svc: ServicesDep, token: TokenDep) -> Page[BaselinePublic]:
    rows = curation.list_baselines(svc.db, read_project(svc, project, token))
    return Page(data=rows, count=len(rows))


@router.get("/projects/{project}/baselines/{name:path}", response_model=BaselinePublic)
def get_baseline(project: ProjectName, name: str, svc: ServicesDep, token: TokenDep) -> BaselinePublic:
    return curation.get_baseline(svc.db, read_project(svc, project, token), name)


@router.post("/projects/{project}/baselines/{name:path}/comparisons", response_model=BaselinePublic)
def promote(project: ProjectName, name: str, body: BaselinePromote, svc: ServicesDep, token: TokenDep) -> BaselinePublic:
    """Accept a finished comparison into the baseline ``name``."""
    return curation.promote(svc.db, write_project(svc, project, token), name, body.comparison, body.force)


@router.delete("/projects/{project}/baselines/{name:path}", status_code=204)
def delete_baseline(project: ProjectName, name: str, svc: ServicesDep, token: TokenDep) -> Response:
    curation.delete_baseline(svc.db, write_project(svc, project, token), name)
    return Response(status_code=204)


@router.post("/projects/{project}/deviations", status_code=201, response_model=DeviationPublic)
def create_deviation(project: ProjectName, body: DeviationCreate, svc: ServicesDep, token: TokenDep) -> DeviationPublic:
    """Accept a known deviation: matching regressions become 'accepted' until it expires."""
    return curation.create_deviation(svc.db, write_project(svc, project, token), body)


@router.get("/projects/{project}/deviations", response_model=Page[DeviationPublic])
def list_deviations(project: ProjectName, svc: ServicesDep, token: TokenDep,
                    include_expired: bool = False) -> Page[DeviationPublic]:
    rows = curation.list_deviations(svc.db, read_project(svc, project, token), include_expired)
    return Page(data=rows, count=len(rows))


@router.delete("/projects/{project}/deviations/{deviation_id}", status_code=204)
def delete_deviation(project: ProjectName, deviation_id: RowId, svc: ServicesDep, token: TokenDep) -> Response:
    curation.delete_deviation(svc.db, write_project(svc, project, token), deviation_id,
                              token_name(svc.db, token) or "anonymous")
    return Response(status_code=204)


@router.patch("/regressions/{regression_id}", response_model=RegressionPublic)
def update_regression(regression_id: RowId, body: RegressionUpdate, svc: ServicesDep, token: TokenDep) -> RegressionPublic:
    """Acknowledge (or re-open, accept, resolve) a regression."""
    readable(svc, token, lambda: queries.get_regression(svc.db, regression_id), "regression", regression_id, write=True)
    actor = body.author or token_name(svc.db, token) or "anonymous"
    row = curation.set_regression_status(svc.db, regression_id, body.status, actor, body.note)
    return RegressionPublic.model_validate(row)


@router.get("/bundles/{a}/diff/{b}", response_model=BundleDiff)
def bundle_diff(a: BundleId, b: BundleId, svc: ServicesDep, token: TokenDep) -> BundleDiff:
    """What changed between two bundles' environments and capture settings."""
    return queries.bundle_diff(readable_bundle(svc, a, token), readable_bundle(svc, b, token))
