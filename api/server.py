"""Run the service: ``opband serve`` in the foreground, or a background server for the demo."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from api.app import create_app
from api.store.db import upgrade
from api.settings import Settings


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def serve(settings: Settings, migrate: bool = True) -> None:
    """Serve until interrupted. Embedded SQLite is migrated on start; other databases are checked."""
    if migrate and settings.effective_database_url.startswith("sqlite"):
        upgrade(settings.effective_database_url)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level,
                access_log=False)  # opband.http logs one JSON line per request instead


class BackgroundServer:
    """uvicorn in a thread, for ``opband demo`` (a real HTTP server on a free loopback port)."""

    def __init__(self, settings: Settings) -> None:
        upgrade(settings.effective_database_url)
        self.settings = settings
        config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.settings.port}"

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the opband server did not start; see the log above")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
