"""JSON routes behind the dashboard pages (under /api/v1): each authorizes and makes one query call."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.dashboard_schemas import ComparisonRuns, Heatmap, OpDetail, OpGroups, OpHistory, Overview, RegressionEventPublic
from api.limits import MAX_ROW_ID
from api.routes.core import Limit, Offset, ProjectName, ServicesDep, TokenDep, read_project, readable
from api.schemas import Page
from api.services import Services
from api.store.models import Comparison
from api.store import dashboard_queries as dq
from api.store import queries

router = APIRouter(tags=["dashboard"])
OpKey = Annotated[str, Query(min_length=1, max_length=1000, description="op key, e.g. model.layers.0.mlp/aten.mm#0")]


def readable_comparison(svc: Services, comparison_id: str, token: str | None) -> Comparison:
    """The comparison, if the token may read its project (another project's gets the same 404 as a missing one)."""
    return readable(svc, token, lambda: queries.get_comparison(svc.db, comparison_id), "comparison", comparison_id)


@router.get("/projects/{project}/overview", response_model=Overview)
def overview(project: ProjectName, svc: ServicesDep, token: TokenDep) -> Overview:
    """Targets x their latest verdict, open regressions and recent comparisons."""
    return dq.overview(svc.db, read_project(svc, project, token))


@router.get("/comparisons/{comparison_id}/runs", response_model=ComparisonRuns)
def comparison_runs(comparison_id: str, svc: ServicesDep, token: TokenDep) -> ComparisonRuns:
    """Both runs of a comparison (labels, targets, devices, variants, tags) and their environment diff."""
    return dq.comparison_runs(svc.db, readable_comparison(svc, comparison_id, token))


@router.get("/comparisons/{comparison_id}/op-groups", response_model=OpGroups)
def op_groups(
    comparison_id: str, svc: ServicesDep, token: TokenDep,
    verdict: Annotated[str | None, Query(description="comma-separated verdicts")] = None,
    module: Annotated[str | None, Query(description="module path glob")] = None,
    op: str | None = None, search: Annotated[str | None, Query(max_length=1000, description="part of the op key")] = None,
    fold: Annotated[bool, Query(description="fold inherited failures under the local failure they follow")] = True,
    sort: str = "worst", order: str = "desc", limit: Limit = 50, offset: Offset = 0,
) -> OpGroups:
    """Every op of a comparison, filtered and paged; inherited failures folded under their first divergence."""
    readable_comparison(svc, comparison_id, token)
    rows, count = queries.op_results(svc.db, comparison_id, op=op, module=module, verdict=verdict, search=search,
                                     inherited=False if fold else None, sort=sort, order=order,
                                     limit=limit, offset=offset)
    return OpGroups(data=dq.op_groups(svc.db, comparison_id, rows, fold), count=count, folded=fold)


@router.get("/comparisons/{comparison_id}/op", response_model=OpDetail)
def op_detail(comparison_id: str, key: OpKey, svc: ServicesDep, token: TokenDep) -> OpDetail:
    """One op in one comparison: metrics, error histogram and quantiles, reference and target statistics."""
    return dq.op_detail(svc.db, svc.store, readable_comparison(svc, comparison_id, token), key)


@router.get("/projects/{project}/op-history", response_model=OpHistory)
def op_history(project: ProjectName, key: OpKey, svc: ServicesDep, token: TokenDep, metric: str = "norm_l2",
               target: str | None = None, points: Annotated[int, Query(ge=1, le=1000)] = 200) -> OpHistory:
    """An op's metric per target over time, with budget, band, out-of-band points and the runs it was accepted in."""
    return dq.op_history(svc.db, read_project(svc, project, token), key, metric, target, points)


@router.get("/projects/{project}/heatmap", response_model=Heatmap)
def heatmap(project: ProjectName, svc: ServicesDep, token: TokenDep, metric: str = "severity",
            target: str | None = None, runs: Annotated[int, Query(ge=1, le=200)] = 30,
            ops: Annotated[int, Query(ge=1, le=500)] = 60,
            order: Annotated[str, Query(description="execution (where drift starts) or similar (ops that move "
                                                    "together side by side)")] = "execution") -> Heatmap:
    """Ops x the latest comparisons, coloured by severity: where drift started and which ops move together."""
    return dq.heatmap(svc.db, read_project(svc, project, token), metric, target, runs, ops, order)


@router.get("/projects/{project}/regression-events", response_model=Page[RegressionEventPublic])
def regression_events(project: ProjectName, svc: ServicesDep, token: TokenDep, regression: Annotated[int | None, Query(ge=1, le=MAX_ROW_ID)] = None,
                      limit: Limit = 50, offset: Offset = 0) -> Page[RegressionEventPublic]:
    """Who acknowledged, accepted or re-opened which regression, and when (newest first)."""
    rows, count = dq.regression_events(svc.db, read_project(svc, project, token), regression, limit, offset)
    return Page(data=rows, count=count)
