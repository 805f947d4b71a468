"""The FastAPI application: routes under /api/v1, the dashboard at /, Prometheus at /metrics."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import plotly
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from sqlalchemy.exc import InterfaceError, OperationalError
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

from api.errors import Forbidden, ServiceError, outage
from api.limits import BodyLimit
from api.middleware import RequestLog
from api.observability import JobsByStatus, configure_logging
from api.routes.admin import router as admin_router
from api.routes.core import router
from api.routes.coverage import router as coverage_router
from api.routes.dashboard import router as dashboard_router
from api.routes.docs import router as docs_router
from api.routes.review import router as review_router
from api.schemas import ErrorPublic, ValidationErrorPublic
from api.services import Services
from api.settings import Settings
from api.store.maintenance import sweep_partials

STATIC = Path(__file__).resolve().parent / "static"
PLOTLY_JS = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"
log = logging.getLogger("opband.api")


#: the error answers every /api/v1 route may give (all JSON with a ``detail``)
ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    400: {"model": ErrorPublic, "description": "malformed request (e.g. a NUL byte in the URL)"},
    401: {"model": ErrorPublic, "description": "a token is needed (auth on) or was not recognised"},
    403: {"model": ErrorPublic, "description": "the token may not do this (another project, or read-only)"},
    404: {"model": ErrorPublic, "description": "no such resource (or not visible to this token)"},
    409: {"model": ErrorPublic, "description": "conflicts with the current state"},
    411: {"model": ErrorPublic, "description": "a JSON body without Content-Length"},
    413: {"model": ErrorPublic, "description": "body over a limit (OPBAND_MAX_JSON_BYTES, OPBAND_MAX_UPLOAD_BYTES)"},
    422: {"model": ValidationErrorPublic, "description": "invalid parameters or body"},
    503: {"model": ErrorPublic, "description": "database or disk unavailable; try again later"},
}
SWEEP_SECONDS = 600


async def _sweep_partials_forever(services: Services) -> None:
    """Remove upload temp files left by crashes: once at start, then every SWEEP_SECONDS."""
    stale = max(2 * services.settings.upload_idle_seconds, 60.0)
    while True:
        try:
            await asyncio.to_thread(sweep_partials, services.upload_temp_dir, stale)
        except Exception:  # noqa: BLE001 - the next sweep tries again
            log.warning("sweeping partial uploads failed", exc_info=True)
        await asyncio.sleep(SWEEP_SECONDS)


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
        sweeper = asyncio.create_task(_sweep_partials_forever(services))
        log.info("service started", extra={"database": services.db.engine.dialect.name, "queue": settings.queue,
                                           "in_process_workers": services.workers.alive(), "auth": settings.auth})
        try:
            yield
        finally:
            sweeper.cancel()
            services.close()

    app = FastAPI(title="opband", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Operator-level numerical accuracy regression service")
    for api_router in (router, review_router, coverage_router, dashboard_router, admin_router):
        app.include_router(api_router, prefix="/api/v1", responses=ERROR_RESPONSES)
    app.include_router(docs_router)  # /docs and /redoc, assets from an installed package
    app.add_middleware(BodyLimit, max_bytes=settings.max_json_bytes)
    app.add_middleware(RequestLog)

    @app.exception_handler(ServiceError)
    async def service_error(_: Request, exc: ServiceError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    async def infrastructure(request: Request, exc: Exception) -> JSONResponse:
        down = outage(exc)
        if down is None:
            raise exc  # not an outage: a bug, answered by `unexpected` below
        log.warning("outage", extra={"path": request.url.path, "error": f"{type(exc).__name__}: {exc}"[:500]})
        return JSONResponse({"detail": str(down)}, status_code=down.status)

    for kind in (OSError, OperationalError, InterfaceError):
        app.add_exception_handler(kind, infrastructure)  # type: ignore[arg-type]

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error", extra={"path": request.url.path})
        return JSONResponse({"detail": "internal error: this is opband's bug, not your request; please report it "
                                       "with the time and path"}, status_code=500)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        found = exc.errors()[:20]  # never echo raw input: a key or message may be a client's 100 MB string
        errors = [{"loc": [p if isinstance(p, int) else str(p)[:80] for p in e["loc"]], "msg": str(e["msg"])[:300],
                   "type": str(e["type"])} for e in found]
        parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors]
        return JSONResponse({"detail": "; ".join(parts) or "invalid request", "errors": errors},
                            status_code=422)

    @app.get("/metrics", include_in_schema=False)
    def metrics(request: Request) -> Response:
        if settings.auth:  # with auth on, metrics (route names, volumes) are not for anyone who asks
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not settings.metrics_token or not hmac.compare_digest(given.encode(), settings.metrics_token.encode()):
                raise Forbidden("/metrics needs 'Authorization: Bearer <OPBAND_METRICS_TOKEN>' when auth is on "
                                "(set OPBAND_METRICS_TOKEN on the server and in the scraper)")
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
