"""Blob stores behind one small interface, chosen by URL: a local folder or an S3-compatible bucket."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol

if TYPE_CHECKING:
    from api.settings import Settings

CHUNK = 1 << 20


class BlobStore(Protocol):
    """Where bundle bytes live. Keys are ``<project>/<sha256>.bundle``."""

    def put_file(self, key: str, path: Path) -> None:
        """Store the file at ``path`` under ``key`` (the file may be moved)."""

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...

    @contextmanager
    def local_path(self, key: str) -> Iterator[Path]:
        """A local file holding the blob, for memory-mapped reading."""

    def open(self, key: str) -> BinaryIO:
        """A binary stream of the blob, for downloads."""

    def check(self) -> None:
        """Raise if the store cannot be reached (readiness probe)."""

    def keys(self) -> Iterator[tuple[str, float]]:
        """Every stored blob's key and its last-modified time (epoch seconds), for garbage collection."""


class LocalStore:
    """A folder on disk; writes are atomic renames within the folder."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / ".tmp").mkdir(exist_ok=True)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents:
            raise ValueError(f"blob key {key!r} escapes the store")
        return path

    def temp_dir(self) -> Path:
        """A folder on the store's filesystem, so uploads land with a rename, not a copy."""
        return self.root / ".tmp"

    def put_file(self, key: str, path: Path) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(path, dest)
        except OSError:
            shutil.copyfile(path, dest)

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    @contextmanager
    def local_path(self, key: str) -> Iterator[Path]:
        path = self._path(key)
        if not path.exists():
            raise FileNotFoundError(f"blob {key} is missing from {self.root}")
        yield path

    def open(self, key: str) -> BinaryIO:
        return open(self._path(key), "rb")

    def check(self) -> None:
        probe = tempfile.NamedTemporaryFile(dir=self.temp_dir(), delete=True)
        probe.close()

    def keys(self) -> Iterator[tuple[str, float]]:
        for path in self.root.rglob("*"):
            rel = path.relative_to(self.root)
            if rel.parts[0] != ".tmp" and path.is_file():
                yield rel.as_posix(), path.stat().st_mtime


def make_store(url: str, endpoint_url: str | None = None) -> BlobStore:
    """A store for ``url``: ``s3://bucket/prefix`` (boto3) or a folder / ``file://`` path."""
    if url.startswith("s3://"):
        from api.store.s3 import S3Store

        return S3Store(url, endpoint_url)
    return LocalStore(url.removeprefix("file://"))


def store_from_settings(settings: Settings) -> BlobStore:
    """The blob store the settings name (``OPBAND_STORE_URL`` or the data folder; S3 endpoint if set)."""
    return make_store(settings.effective_store_url, settings.s3_endpoint_url)
