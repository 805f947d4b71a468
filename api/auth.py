"""Project tokens: created once, shown once, stored as sha256; write tokens vs read-only tokens."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from api.store.db import Database
from api.errors import Forbidden, NotFound, Unauthorized
from api.store.models import Project, Token

PREFIX = "opb_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def get_or_create_project(db: Database, name: str, public: bool | None = None) -> Project:
    """The project ``name``, created on first use; safe when two requests create it at once."""
    try:
        return _get_or_create_project(db, name, public)
    except IntegrityError:  # a concurrent request created it first: use theirs
        return _get_or_create_project(db, name, public)


def _get_or_create_project(db: Database, name: str, public: bool | None) -> Project:
    with db.session() as s:
        project = s.scalar(select(Project).where(Project.name == name))
        if project is None:
            project = Project(name=name, public=bool(public))
            s.add(project)
        elif public is not None:
            project.public = public
        s.flush()
        return project


def create_token(db: Database, project: str, read_only: bool = False, name: str | None = None) -> str:
    """Create a token for ``project`` (made if missing) and return it; only its hash is kept."""
    proj = get_or_create_project(db, project)
    token = PREFIX + secrets.token_urlsafe(32)
    with db.session() as s:
        s.add(Token(project_id=proj.id, token_hash=hash_token(token), read_only=read_only, name=name))
    return token


def authorize(db: Database, project_name: str, token: str | None, write: bool, auth_on: bool,
              create_missing: bool = False) -> Project:
    """The project a request may act on, or an error saying why not."""
    with db.session() as s:
        project = s.scalar(select(Project).where(Project.name == project_name))
    if project is None:
        if auth_on or not create_missing:
            raise NotFound(f"project {project_name!r} does not exist"
                           + (": create it with `opband token create --project NAME`" if auth_on else ""))
        return get_or_create_project(db, project_name)
    if not auth_on or (not write and project.public):
        return project
    if not token:
        raise Unauthorized(f"project {project_name!r} needs a token: send 'Authorization: Bearer <token>' "
                           "(create one with `opband token create --project NAME`)")
    with db.session() as s:
        row = s.scalar(select(Token).where(Token.token_hash == hash_token(token)))
    if row is None:
        raise Unauthorized("token not recognised: it may have been mistyped or revoked")
    if row.project_id != project.id:
        raise Forbidden(f"this token belongs to another project and cannot access {project_name!r}")
    if write and row.read_only:
        raise Forbidden(f"this token is read-only; writing to {project_name!r} needs a write token")
    return project
