"""``GET /projects/{project}/coverage``: the op x model coverage matrix of a project's runs."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import StringConstraints

from accuracy.coverage import coverage
from api.routes.core import ProjectName, ServicesDep, TokenDep, read_project
from api.store.coverage import project_exercises

router = APIRouter()


@router.get("/projects/{project}/coverage")
def project_coverage(
    project: ProjectName, svc: ServicesDep, token: TokenDep,
    op: Annotated[list[Annotated[str, StringConstraints(max_length=100)]] | None,
                  Query(description="an op list to measure the covered share of (repeatable: aten.mm, "
                                    "aten.add.Tensor); at most 500, so the URL stays under the HTTP server's 64 KB",
                        max_length=500)] = None,
    bundles: Annotated[int, Query(ge=1, le=2000, description="the latest this many bundles")] = 200,
) -> dict[str, Any]:
    """Ops, overloads, dtypes, input-shape classes and value regimes the project's runs exercised, per model,
    with the verdicts of each bundle's latest comparison (schema ``opband.coverage/1``, as `opband coverage --json`)."""
    row = read_project(svc, project, token)
    return coverage(project_exercises(svc.db, row, bundles), op or None).to_dict()
