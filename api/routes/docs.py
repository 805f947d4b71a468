"""/docs (Swagger UI) and /redoc with their assets served from an installed package (fastapi-offline), no CDN."""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import APIRouter, HTTPException
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse

#: swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js, favicon.png
DOCS_ASSETS = Path(fastapi_offline.__file__).resolve().parent / "static"
ASSET_URL = "/static/docs-vendor"
TITLE = "opband"

router = APIRouter(include_in_schema=False)


@router.get("/docs")
def swagger_ui() -> HTMLResponse:
    return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{TITLE} API: Swagger UI",
                               oauth2_redirect_url="/docs/oauth2-redirect",
                               swagger_js_url=f"{ASSET_URL}/swagger-ui-bundle.js",
                               swagger_css_url=f"{ASSET_URL}/swagger-ui.css",
                               swagger_favicon_url=f"{ASSET_URL}/favicon.png")


@router.get("/docs/oauth2-redirect")
def swagger_ui_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


@router.get("/redoc")
def redoc() -> HTMLResponse:
    return get_redoc_html(openapi_url="/openapi.json", title=f"{TITLE} API: ReDoc",
                          redoc_js_url=f"{ASSET_URL}/redoc.standalone.js",
                          redoc_favicon_url=f"{ASSET_URL}/favicon.png", with_google_fonts=False)


@router.get(ASSET_URL + "/{name}")
def docs_asset(name: str) -> FileResponse:
    """One of the packaged assets, by name only (no paths)."""
    path = DOCS_ASSETS / name
    if "/" in name or name.startswith(".") or not path.is_file():
        raise HTTPException(404, f"no docs asset {name!r}")
    return FileResponse(path)
