"""Service errors and the one table that maps them to HTTP statuses."""

from __future__ import annotations

import errno


class ServiceError(Exception):
    """A request the service refuses; the message tells the user what was wrong."""

    status = 400


class NotFound(ServiceError):
    status = 404


class InvalidInput(ServiceError):
    status = 422


class TooLarge(ServiceError):
    status = 413


class Conflict(ServiceError):
    status = 409


class Unauthorized(ServiceError):
    status = 401


class Forbidden(ServiceError):
    status = 403


class Unavailable(ServiceError):
    status = 503


class RequestTimeout(ServiceError):
    status = 408


#: OS errors that mean "the disk is full", not "the request was wrong"
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def outage(exc: BaseException) -> Unavailable | None:
    """The 503 an infrastructure failure deserves (database unreachable, disk full), or None if ``exc``
    is not one. Read by the app's exception handlers, so every route answers outages the same way."""
    from sqlalchemy.exc import InterfaceError, OperationalError

    if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
        return Unavailable(f"the server's disk is full ({exc.strerror}): try again later; operators: free space "
                           "under the data dir / blob store")
    if isinstance(exc, (OperationalError, InterfaceError)):
        if "full" in str(getattr(exc, "orig", None) or "").lower():  # SQLite: "database or disk is full"
            return Unavailable("the database's disk is full: try again later; operators: free space for it")
        return Unavailable("the database is unavailable: try again shortly; operators: see the server log and "
                           "GET /api/v1/ready")
    return None
