"""Routes that remove data: delete a comparison, a bundle or a project; apply a retention policy; collect garbage."""

from __future__ import annotations

import hmac
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import Field

from api.errors import Forbidden
from api.routes.core import BundleId, ComparisonId, ProjectName, ServicesDep, TokenDep, project_by_id, readable
from api.routes.review import write_project
from api.schemas import RequestBody
from api.store import queries, retention
from api.store.maintenance import gc

router = APIRouter()
Force = Annotated[bool, Query(description="also delete what depends on it (comparisons of a bundle; a baseline's comparison)")]


class RetentionCreate(RequestBody):
    keep_runs: int = Field(ge=0, le=1_000_000, description="per target name, keep the newest this many comparisons")
    keep_days: float = Field(ge=0, le=36_500, description="and every comparison (and bundle) younger than this")
    apply: bool = Field(default=False, description="false: only report what would go")


@router.delete("/comparisons/{comparison_id}", status_code=204)
def delete_comparison(comparison_id: ComparisonId, svc: ServicesDep, token: TokenDep, force: Force = False) -> Response:
    """Delete a comparison and its per-op results (one in a baseline needs force=true)."""
    # readable(write=True): a write token of the comparison's project, or the same 404 as a missing one
    c = readable(svc, token, lambda: queries.get_comparison(svc.db, comparison_id), "comparison", comparison_id, write=True)
    retention.delete_comparison(svc.db, project_by_id(svc, c.project_id), comparison_id, force)
    return Response(status_code=204)


@router.delete("/bundles/{bundle_id}", status_code=204)
def delete_bundle(bundle_id: BundleId, svc: ServicesDep, token: TokenDep, force: Force = False) -> Response:
    """Delete a bundle, its blob and (with force=true) the comparisons that use it."""
    b = readable(svc, token, lambda: queries.get_bundle(svc.db, bundle_id), "bundle", bundle_id, write=True)
    retention.delete_bundle(svc.db, svc.store, project_by_id(svc, b.project_id), bundle_id, force)
    return Response(status_code=204)


@router.delete("/projects/{project}", status_code=204)
def delete_project(project: ProjectName, svc: ServicesDep, token: TokenDep) -> Response:
    """Delete a project: every bundle, blob, comparison, baseline, deviation and token of it."""
    retention.delete_project(svc.db, svc.store, write_project(svc, project, token))
    return Response(status_code=204)


@router.post("/projects/{project}/retention")
def apply_retention(project: ProjectName, body: RetentionCreate, svc: ServicesDep, token: TokenDep) -> dict[str, Any]:
    """Let old comparisons and bundles go: per target keep ``keep_runs`` and all younger than ``keep_days``;
    never what a baseline holds or a regression names. ``apply: false`` (default) only reports."""
    proj = write_project(svc, project, token)
    return retention.retention(svc.db, svc.store, proj, body.keep_runs, body.keep_days, body.apply).as_dict()


@router.post("/admin/gc")
async def collect_garbage(svc: ServicesDep, apply: bool = False,
                          grace_seconds: Annotated[float, Query(ge=0, le=86_400 * 30)] = 600,
                          authorization: Annotated[str | None, Header()] = None) -> dict[str, Any]:
    """Blobs no bundle names, bundles whose blob is gone, stale upload temp files (as `opband gc`).
    With auth on it needs 'Authorization: Bearer <OPBAND_ADMIN_TOKEN>'."""
    settings = svc.settings
    if settings.auth:
        given = (authorization or "").removeprefix("Bearer ").strip()
        if not settings.admin_token or not hmac.compare_digest(given.encode(), settings.admin_token.encode()):
            raise Forbidden("the admin routes need 'Authorization: Bearer <OPBAND_ADMIN_TOKEN>' when auth is on")
    report = await run_in_threadpool(gc, svc.db, svc.store, apply, grace_seconds, svc.upload_temp_dir,
                                     max(2 * settings.upload_idle_seconds, 60))
    return report.as_dict()

