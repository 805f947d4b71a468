"""The FastAPI application: routes under /api/v1, the dashboard at /, Prometheus at /metrics."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import plotly
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

from api.errors import ServiceError
from api.middleware import RequestLog
from api.observability import JobsByStatus, configure_logging
from api.routes.core import router
from api.routes.coverage import router as coverage_router
from api.routes.dashboard import router as dashboard_router
from api.routes.docs import router as docs_router
from api.routes.review import router as review_router
from api.services import Services
from api.settings import Settings

STATIC = Path(__file__).resolve().parent / "static"
PLOTLY_JS = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"
log = logging.getLogger("opband.api")


def create_app(settings: Settings | None = None, *, start_workers: bool = True) -> FastAPI:
    """Build the app; the database must already be at the migrations' head (``opband db upgrade``)."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        configure_logging(settings)
        services = Services.open(settings)
        app.state.services = services
        app.state.metrics = CollectorRegistry(auto_describe=True)
        app.state.metrics.register(JobsByStatus(services.db))
        if start_workers and settings.runs_jobs_in_process:
            services.workers.start()
        log.info("service started", extra={"database": services.db.engine.dialect.name, "queue": settings.queue,
                                           "in_process_workers": services.workers.alive(), "auth": settings.auth})
        try:
            yield
        finally:
            services.close()

    app = FastAPI(title="opband", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Operator-level numerical accuracy regression service")
    app.include_router(router, prefix="/api/v1")
    app.include_router(review_router, prefix="/api/v1")
    app.include_router(coverage_router, prefix="/api/v1")
    app.include_router(dashboard_router, prefix="/api/v1")
    app.include_router(docs_router)  # /docs and /redoc, assets from an installed package
    app.add_middleware(RequestLog)

    @app.exception_handler(ServiceError)
    async def service_error(_: Request, exc: ServiceError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        errors = [{k: e[k] for k in ("loc", "msg", "type") if k in e} for e in exc.errors()]  # never echo raw input
        return JSONResponse({"detail": "; ".join(parts) or "invalid request", "errors": errors},
                            status_code=422)

    @app.get("/metrics", include_in_schema=False)
    def metrics(request: Request) -> Response:
        body = generate_latest(REGISTRY) + generate_latest(request.app.state.metrics)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/coverage", include_in_schema=False)
    def coverage_page() -> FileResponse:
        return FileResponse(STATIC / "coverage.html")

    @app.get("/static/vendor/plotly.min.js", include_in_schema=False)
    def plotly_js() -> FileResponse:
        return FileResponse(PLOTLY_JS, media_type="application/javascript")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
