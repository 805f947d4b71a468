"""/docs (Swagger UI) and /redoc with their assets served from an installed package (fastapi-offline), no CDN."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import fastapi_offline
from fastapi import APIRouter, HTTPException
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse, Response

#: swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js, favicon.png
DOCS_ASSETS = Path(fastapi_offline.__file__).resolve().parent / "static"
ASSET_URL = "/static/docs-vendor"
TITLE = "opband"
#: the docs pages may load nothing from elsewhere (Swagger UI's and ReDoc's pages use inline scripts/styles)
CSP = ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
       "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; connect-src 'self'")
#: ReDoc's bundle shows one image from Redocly's servers (the "API docs by Redocly" logo): served without it
REDOC_REMOTE_IMAGE = re.compile(rb"https://[\w.-]*redoc\.ly/[\w./-]+\.svg")
BLANK_SVG = b"data:image/svg+xml,%3Csvg xmlns='http://www.w3.org/2000/svg'/%3E"

router = APIRouter(include_in_schema=False)


@router.get("/docs")
def swagger_ui() -> HTMLResponse:
    page = get_swagger_ui_html(openapi_url="/openapi.json", title=f"{TITLE} API: Swagger UI",
                               oauth2_redirect_url="/docs/oauth2-redirect",
                               swagger_js_url=f"{ASSET_URL}/swagger-ui-bundle.js",
                               swagger_css_url=f"{ASSET_URL}/swagger-ui.css",
                               swagger_favicon_url=f"{ASSET_URL}/favicon.png")
    page.headers["Content-Security-Policy"] = CSP
    return page


@router.get("/docs/oauth2-redirect")
def swagger_ui_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


@router.get("/redoc")
def redoc() -> HTMLResponse:
    page = get_redoc_html(openapi_url="/openapi.json", title=f"{TITLE} API: ReDoc",
                          redoc_js_url=f"{ASSET_URL}/redoc.standalone.js",
                          redoc_favicon_url=f"{ASSET_URL}/favicon.png", with_google_fonts=False)
    page.headers["Content-Security-Policy"] = CSP
    return page


@lru_cache(maxsize=1)
def _redoc_js() -> bytes:
    return REDOC_REMOTE_IMAGE.sub(lambda _: BLANK_SVG, (DOCS_ASSETS / "redoc.standalone.js").read_bytes())


@router.get(ASSET_URL + "/{name}")
def docs_asset(name: str) -> Response:
    """One of the packaged assets, by name only (no paths)."""
    path = DOCS_ASSETS / name
    if "/" in name or name.startswith(".") or not path.is_file():
        raise HTTPException(404, f"no docs asset {name!r}")
    if name == "redoc.standalone.js":
        return Response(_redoc_js(), media_type="application/javascript")
    return FileResponse(path)
