"""Blob store on any S3-compatible object store (AWS S3, MinIO, moto) through boto3."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import boto3
from botocore.config import Config
from boto3.exceptions import S3UploadFailedError
from botocore.exceptions import BotoCoreError, ClientError

from api.errors import Unavailable


class S3Store:
    """``s3://bucket/prefix``: multipart uploads from a file, downloads to a temp file for mmap."""

    def __init__(self, url: str, endpoint_url: str | None = None) -> None:
        rest = url.removeprefix("s3://")
        self.bucket, _, prefix = rest.partition("/")
        if not self.bucket:
            raise ValueError(f"store URL {url!r} has no bucket: use s3://bucket/prefix")
        self.prefix = prefix.strip("/")
        self.client = boto3.client(
            "s3", endpoint_url=endpoint_url, config=Config(retries={"max_attempts": 3, "mode": "standard"})
        )

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put_file(self, key: str, path: Path) -> None:
        try:
            self.client.upload_file(str(path), self.bucket, self._key(key))
        except (ClientError, BotoCoreError, S3UploadFailedError) as e:
            raise Unavailable(f"the blob store s3://{self.bucket} refused the upload ({e}); try again later") from e
        finally:
            path.unlink(missing_ok=True)

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    @contextmanager
    def local_path(self, key: str) -> Iterator[Path]:
        with tempfile.TemporaryDirectory(prefix="opband-blob-") as d:
            path = Path(d) / "blob.bundle"
            self.client.download_file(self.bucket, self._key(key), str(path))
            yield path

    def open(self, key: str) -> BinaryIO:
        return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]  # type: ignore[no-any-return]

    def temp_dir(self) -> Path:
        return Path(tempfile.gettempdir())

    def keys(self) -> Iterator[tuple[str, float]]:
        start = f"{self.prefix}/" if self.prefix else ""
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
            for obj in page.get("Contents", []):
                yield obj["Key"][len(start):], obj["LastModified"].timestamp()

    def check(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if code in ("404", "NoSuchBucket", "NotFound"):
                raise RuntimeError(f"bucket {self.bucket!r} does not exist: create it (e.g. `mc mb local/{self.bucket}`)") from e
            raise
