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


def token_name(db: Database, token: str | None) -> str | None:
    """The name a token was created with (``opband token create --name``), for the audit of who did what."""
    if not token:
        return None
    with db.session() as s:
        return s.scalar(select(Token.name).where(Token.token_hash == hash_token(token)))


def _token_row(db: Database, token: str | None, what: str) -> Token:
    """The stored token behind ``token``, or 401 saying how to get one."""
    if not token:
        raise Unauthorized(f"{what} needs a token: send 'Authorization: Bearer <token>' "
                           "(create one with `opband token create --project NAME`)")
    with db.session() as s:
        row = s.scalar(select(Token).where(Token.token_hash == hash_token(token)))
    if row is None:
        raise Unauthorized("token not recognised: it may have been mistyped or revoked (`opband token list`)")
    return row


def authorize(db: Database, project_name: str, token: str | None, write: bool, auth_on: bool) -> Project:
    """The project a request may act on, or an error saying why not.

    With auth on, the token is checked before the project is looked up, and a project that does not
    exist gets the same 403 as one the token may not see: names cannot be probed.
    """
    with db.session() as s:
        project = s.scalar(select(Project).where(Project.name == project_name))
    if not auth_on:
        if project is None:
            raise NotFound(f"project {project_name!r} does not exist: upload a bundle to it first")
        return project
    if project is not None and not write and project.public:
        return project
    row = _token_row(db, token, f"project {project_name!r}")
    if project is None or row.project_id != project.id:
        raise Forbidden(f"this token does not grant access to project {project_name!r}: use a token of that "
                        "project (`opband token create --project NAME`)")
    if write and row.read_only:
        raise Forbidden(f"this token is read-only; writing to {project_name!r} needs a write token")
    return project


def authorize_upload(db: Database, project_name: str, token: str | None, auth_on: bool) -> Project | None:
    """Like :func:`authorize` for writing; without auth a missing project is allowed (None): the
    upload creates it once the bundle has been validated."""
    if not auth_on:
        with db.session() as s:
            return s.scalar(select(Project).where(Project.name == project_name))
    return authorize(db, project_name, token, write=True, auth_on=True)


def authorize_row(db: Database, project_id: int | None, token: str | None, write: bool, auth_on: bool,
                  missing: NotFound) -> None:
    """Access to a row found by id (``project_id`` None: no such row). With auth on the token is checked
    first, and a row of another project gets the same 404 as a missing one."""
    if not auth_on:
        if project_id is None:
            raise missing
        return
    if project_id is not None and not write:
        with db.session() as s:
            project = s.get(Project, project_id)
        if project is not None and project.public:
            return
    row = _token_row(db, token, "this resource")
    if project_id is None or row.project_id != project_id:
        raise missing
    if write and row.read_only:
        raise Forbidden("this token is read-only; this change needs a write token of the project")


def list_tokens(db: Database, project: str | None = None) -> list[tuple[Token, str]]:
    """Tokens (never their secrets) with their project's name, oldest first."""
    with db.session() as s:
        q = select(Token, Project.name).join(Project, Project.id == Token.project_id).order_by(Token.id)
        if project is not None:
            q = q.where(Project.name == project)
        return [(t, name) for t, name in s.execute(q).all()]


def revoke_token(db: Database, token_id: int) -> bool:
    """Delete a token by its id (from ``opband token list``); False when there is none."""
    with db.session() as s:
        row = s.get(Token, token_id)
        if row is None:
            return False
        s.delete(row)
        return True
