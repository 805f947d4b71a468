"""Service errors and the one table that maps them to HTTP statuses."""

from __future__ import annotations


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
