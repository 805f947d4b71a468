"""HTTP routes under /api/v1. Each one parses, authorizes, and makes one service call."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from accuracy.compare import is_golden_run
from api.store import queries
from api.auth import authorize, authorize_row, authorize_upload, get_or_create_project
from api.errors import InvalidInput, NotFound
from api.store.ingest import IngestLimits, spool, store_bundle
from api.store.models import BundleRow, Comparison, Project
from api.schemas import (
    BundleDetail, BundlePublic, ComparisonCreate, ComparisonPublic, DriftSeries, OpResultPublic, Page,
    ProjectPublic, RegressionPublic, RunSummary, TargetPublic,
)
from accuracy.manifest import RunNames, run_names
from api.observability import UPLOADS
from api.services import Services

router = APIRouter()
T = TypeVar("T")


def get_services(request: Request) -> Services:
    return request.app.state.services  # type: ignore[no-any-return]


_BEARER = HTTPBearer(auto_error=False, description="a project token from `opband token create` (needed when the "
                                                  "server runs with OPBAND_AUTH=true)")


def bearer(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)] = None) -> str | None:
    return credentials.credentials.strip() if credentials else None


ServicesDep = Annotated[Services, Depends(get_services)]
TokenDep = Annotated[str | None, Depends(bearer)]
ProjectName = Annotated[str, Path(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                                  description="letters, digits, '.', '_' and '-'")]
Limit = Annotated[int, Query(ge=1, le=1000)]


def one_of(values: Iterable[str], description: str | None = None) -> Any:
    """A query parameter documented as an enum; the store checks it and names the choices in its 422."""
    return Query(description=description, json_schema_extra={"enum": list(values)})


def one_or_more(values: Iterable[str], description: str) -> Any:
    """A comma-separated list of ``values``, documented as a pattern; the store checks it (422 naming them)."""
    word = "(" + "|".join(values) + ")"
    return Query(description=description, json_schema_extra={"pattern": f"^{word}(,{word})*$"})


Metric = Annotated[str, one_of(queries.METRIC_COLUMNS)]

Offset = Annotated[int, Query(ge=0, le=1_000_000_000)]


def run_names_query(
    label: Annotated[str | None, Query(max_length=200, description="a name for this run, e.g. nightly-2026-12-01")] = None,
    target: Annotated[str | None, Query(max_length=200, description="the target name its series are kept under, "
                                        "e.g. ascend-910b/bf16 (default: the manifest's, else variant@device)")] = None,
    tag: Annotated[list[str] | None, Query(description="key=value, repeatable: branch, commit, cann, driver ...")] = None,
) -> RunNames:
    """Run names given as query parameters (a 422 saying what is wrong otherwise)."""
    try:
        return run_names(label, target, tag)
    except ValueError as e:
        raise InvalidInput(str(e)) from None


def read_project(svc: Services, name: str, token: str | None) -> Project:
    return authorize(svc.db, name, token, write=False, auth_on=svc.settings.auth)


def comparison_public(c: Comparison) -> ComparisonPublic:
    out = ComparisonPublic.model_validate(c)
    out.target_variant, out.target_device = c.target.variant, c.target.device
    out.reference_run, out.target_run = RunSummary.model_validate(c.reference), RunSummary.model_validate(c.target)
    return out


def project_by_id(svc: Services, project_id: int) -> Project:
    with svc.db.session() as s:
        project = s.get(Project, project_id)
    assert project is not None
    return project


def readable(svc: Services, token: str | None, lookup: Callable[[], T], what: str, ident: str | int,
             write: bool = False) -> T:
    """The row ``lookup`` finds, if the token may see it. With auth on the token is checked first, and
    another project's row gets the same 404 as a missing one (ids cannot be probed)."""
    missing = NotFound(f"{what} {ident!r} does not exist")
    try:
        row = lookup()
    except NotFound:
        authorize_row(svc.db, None, token, write, svc.settings.auth, missing)
        raise
    authorize_row(svc.db, row.project_id, token, write, svc.settings.auth, missing)  # type: ignore[attr-defined]
    return row


def _project_of_comparison(svc: Services, comparison_id: str, token: str | None) -> Comparison:
    return readable(svc, token, lambda: queries.get_comparison(svc.db, comparison_id), "comparison", comparison_id)


@router.get("/health")
def health() -> dict[str, str]:
    """Alive: the process answers."""
    return {"status": "ok"}


@router.get("/ready", responses={503: {"description": "database, store or queue unreachable; detail says which"}})
def ready(svc: ServicesDep) -> dict[str, str | int]:
    """Ready: database (at the schema head), blob store and job queue reachable."""
    return svc.readiness()


@router.get("/projects", response_model=Page[ProjectPublic])
def projects(svc: ServicesDep) -> Page[ProjectPublic]:
    rows = [p for p in queries.list_projects(svc.db) if p.public or not svc.settings.auth]
    return Page(data=[ProjectPublic.model_validate(p) for p in rows], count=len(rows))


BINARY = {"schema": {"type": "string", "format": "binary"}}


@router.post("/projects/{project}/bundles", status_code=201, response_model=BundlePublic,
             openapi_extra={"requestBody": {"required": True, "description": "the bundle file's bytes",
                                            "content": {"application/octet-stream": BINARY}}},
             responses={200: {"description": "these exact bytes were uploaded before: the same bundle",
                              "model": BundlePublic},
                        408: {"description": "the body stalled (OPBAND_UPLOAD_IDLE_SECONDS)"},
                        413: {"description": "over the upload, manifest or record limit"},
                        422: {"description": "not a valid bundle"}})
async def upload_bundle(project: ProjectName, request: Request, response: Response, svc: ServicesDep,
                        token: TokenDep, names: Annotated[RunNames, Depends(run_names_query)]) -> BundlePublic:
    """Upload one bundle file as the raw request body (streamed to disk, hashed, validated).
    ``label``, ``target`` and ``tag`` (``key=value``, repeatable) override the manifest's run names."""
    settings = svc.settings
    proj = await run_in_threadpool(authorize_upload, svc.db, project, token, settings.auth)
    declared = request.headers.get("content-length")
    try:
        length = int(declared) if declared is not None else None
    except ValueError:
        raise InvalidInput(f"Content-Length {declared[:40]!r} is not a number") from None
    upload = await spool(request.stream(), svc.upload_temp_dir, settings.max_upload_bytes, length,
                         settings.upload_idle_seconds, settings.min_free_bytes)
    limits = IngestLimits(settings.max_manifest_bytes, settings.max_records)
    row, created = await run_in_threadpool(store_bundle, svc.db, svc.store,
                                           proj or (lambda: get_or_create_project(svc.db, project)), upload, names,
                                           limits)
    UPLOADS.labels("created" if created else "duplicate").inc()
    response.status_code = 201 if created else 200
    return BundlePublic.model_validate(row)


TagFilter = Annotated[list[str] | None, Query(description="key=value, repeatable: runs carrying every one of these tags")]


@router.get("/projects/{project}/bundles", response_model=Page[BundlePublic])
def list_bundles(project: ProjectName, svc: ServicesDep, token: TokenDep, limit: Limit = 50, offset: Offset = 0,
                 label: str | None = None, target: Annotated[str | None, Query(description="target name")] = None,
                 tag: TagFilter = None) -> Page[BundlePublic]:
    """This project's runs, newest first; filtered by label, target name and tags."""
    rows, count = queries.list_bundles(svc.db, read_project(svc, project, token), limit, offset,
                                       label=label, target=target, tags=_tag_filter(tag))
    return Page(data=[BundlePublic.model_validate(r) for r in rows], count=count)


BundleId = Annotated[str, Path(max_length=64, description="a bundle id (32 hex digits)")]
ComparisonId = Annotated[str, Path(max_length=64, description="a comparison id (32 hex digits)")]


def readable_bundle(svc: Services, bundle_id: str, token: str | None) -> BundleRow:
    return readable(svc, token, lambda: queries.get_bundle(svc.db, bundle_id), "bundle", bundle_id)


def _tag_filter(tag: list[str] | None) -> dict[str, str]:
    from accuracy.manifest import parse_tags

    try:
        return parse_tags(tag)
    except ValueError as e:
        raise InvalidInput(str(e)) from None


@router.get("/projects/{project}/targets", response_model=list[TargetPublic])
def list_targets(project: ProjectName, svc: ServicesDep, token: TokenDep) -> list[TargetPublic]:
    """The project's target names, each with its run count and latest finished comparison."""
    return queries.targets(svc.db, read_project(svc, project, token))


@router.get("/bundles/{bundle_id}", response_model=BundleDetail)
def get_bundle(bundle_id: BundleId, svc: ServicesDep, token: TokenDep) -> BundleDetail:
    return BundleDetail.model_validate(readable_bundle(svc, bundle_id, token))


@router.get("/bundles/{bundle_id}/content", response_class=StreamingResponse,
            responses={200: {"description": "the bundle file's bytes", "content": {"application/octet-stream": BINARY}}})
def download_bundle(bundle_id: BundleId, svc: ServicesDep, token: TokenDep) -> StreamingResponse:
    row = readable_bundle(svc, bundle_id, token)
    stream = svc.store.open(row.storage_key)

    def chunks():  # type: ignore[no-untyped-def]
        try:
            while chunk := stream.read(1 << 20):
                yield chunk
        finally:
            stream.close()

    return StreamingResponse(chunks(), media_type="application/octet-stream",
                             headers={"Content-Length": str(row.size), "ETag": f'"{row.sha256}"',
                                      "Content-Disposition": f'attachment; filename="{bundle_id}.bundle"'})


@router.post("/projects/{project}/comparisons", status_code=202, response_model=ComparisonPublic)
def create_comparison(project: ProjectName, body: ComparisonCreate, svc: ServicesDep, token: TokenDep) -> ComparisonPublic:
    """Queue a comparison of two bundles of this project; poll GET /comparisons/{id} for its status."""
    proj = authorize(svc.db, project, token, write=True, auth_on=svc.settings.auth)
    for side, bid in (("reference", body.reference), ("target", body.target)):
        try:
            b = queries.get_bundle(svc.db, bid)
        except NotFound:
            b = None
        if b is None or b.project_id != proj.id:  # one answer for both: ids of other projects cannot be probed
            raise InvalidInput(f"{side} bundle {bid!r} does not exist in project {project!r}: upload it there first")
        run = b.run or {}
        if side == "reference" and body.mode == "golden" and not is_golden_run(run):
            raise InvalidInput(f"mode golden needs a float64 recomputation of the reference as the reference, and "
                               f"bundle {bid} is a {run.get('variant', '?')} capture: upload the bundle of "
                               "`opband capture --replay REF --golden -o GOLDEN.bundle` and compare it with the target")
    with svc.db.session() as s:
        c = Comparison(id=uuid.uuid4().hex, project_id=proj.id, reference_id=body.reference,
                       target_id=body.target, mode=body.mode, status="pending", shards=body.shards)
        s.add(c)
    svc.workers.notify()
    return comparison_public(queries.get_comparison(svc.db, c.id))


@router.get("/projects/{project}/comparisons", response_model=Page[ComparisonPublic])
def list_comparisons(project: ProjectName, svc: ServicesDep, token: TokenDep, limit: Limit = 50, offset: Offset = 0,
                     status: Annotated[str | None, one_or_more(queries.COMPARISON_STATUSES,
                                                               "comma-separated job statuses")] = None,
                     target: Annotated[str | None, Query(description="target name of the target run")] = None,
                     label: Annotated[str | None, Query(description="label of either run")] = None,
                     ) -> Page[ComparisonPublic]:
    rows, count = queries.list_comparisons(svc.db, read_project(svc, project, token), limit, offset, status,
                                           target=target, label=label)
    return Page(data=[comparison_public(r) for r in rows], count=count)


@router.get("/comparisons/{comparison_id}", response_model=ComparisonPublic)
def get_comparison(comparison_id: ComparisonId, svc: ServicesDep, token: TokenDep) -> ComparisonPublic:
    return comparison_public(_project_of_comparison(svc, comparison_id, token))


@router.get("/comparisons/{comparison_id}/ops", response_model=Page[OpResultPublic])
def comparison_ops(
    comparison_id: ComparisonId, svc: ServicesDep, token: TokenDep,
    op: str | None = None, module: Annotated[str | None, Query(description="module path glob")] = None,
    shape: Annotated[str | None, Query(description="input shape signature, e.g. 64x128,128x128")] = None,
    verdict: Annotated[str | None, one_or_more(queries.VERDICTS, "comma-separated verdicts")] = None,
    metric: Annotated[str | None, one_of(queries.METRIC_COLUMNS)] = None,
    min: float | None = None, max: float | None = None,  # noqa: A002
    sort: Annotated[str, one_of(queries.SORTS)] = "worst", order: Annotated[str, one_of(("asc", "desc"))] = "desc",
    limit: Limit = 50, offset: Offset = 0,
    metrics: bool = False,
) -> Page[OpResultPublic]:
    """Per-op results, worst first by default."""
    _project_of_comparison(svc, comparison_id, token)
    rows, count = queries.op_results(svc.db, comparison_id, op=op, module=module, shape=shape, verdict=verdict,
                                     metric=metric, min_value=min, max_value=max, sort=sort, order=order,
                                     limit=limit, offset=offset)
    data = [OpResultPublic.model_validate(r) for r in rows]
    if not metrics:
        for d in data:
            d.metrics = None
    return Page(data=data, count=count)


@router.get("/projects/{project}/regressions", response_model=Page[RegressionPublic])
def list_regressions(project: ProjectName, svc: ServicesDep, token: TokenDep,
                     status: Annotated[str | None, one_or_more(queries.REGRESSION_STATUSES,
                                                               "comma-separated regression statuses")] = "active",
                     op: str | None = None, shape: str | None = None,
                     target: Annotated[str | None, Query(description="target name, e.g. ascend-910b/bf16 or bf16@cpu")] = None,
                     dtype: Annotated[str | None, Query(description="the target's output dtype, e.g. bfloat16")] = None,
                     limit: Limit = 50, offset: Offset = 0) -> Page[RegressionPublic]:
    """Ops out of band, one row per (op key, input shapes, dtype, target), most recently updated first."""
    rows, count = queries.regressions(svc.db, read_project(svc, project, token), status, op, shape, limit, offset,
                                      target=target, dtype=dtype)
    return Page(data=[RegressionPublic.model_validate(r) for r in rows], count=count)


@router.get("/projects/{project}/drift", response_model=list[DriftSeries])
def project_drift(project: ProjectName, svc: ServicesDep, token: TokenDep, metric: Metric = "norm_l2",
                  key: Annotated[str | None, Query(description="op key glob; default: the worst series")] = None,
                  target: Annotated[str | None, Query(description="target name, e.g. ascend-910b/bf16 or bf16@cpu")] = None,
                  series: Annotated[int, Query(ge=1, le=100)] = 8,
                  points: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[DriftSeries]:
    """A metric per op key across this project's comparisons, oldest first."""
    return queries.drift(svc.db, read_project(svc, project, token), metric, key, target, series, points)
