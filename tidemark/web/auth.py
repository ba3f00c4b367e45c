"""Who calls the dead-letter plugin and what they may do, decided by Airflow's auth manager.

Airflow authenticates its own routes, not a plugin's FastAPI app, so the plugin does it
itself, the way Airflow does: the JWT from the ``Authorization: Bearer`` header, else the
``_token`` cookie Airflow's UI sets (``airflow.api_fastapi.core_api.security.get_user``).
A pipeline's dead letters belong to its DAG ``tidemark_<pipeline>``: reading them needs read
access to that DAG, discarding or redriving them needs edit access.

Cookie-authenticated POSTs also need a CSRF token, and no POST may come from another origin.
The token is an HMAC-SHA256 of the user's id keyed with Airflow's ``[api] secret_key``: not of
the JWT, which Airflow refreshes in the cookie while a page stays open. Each response carries
it masked with fresh random bytes (as Django does), so it never repeats in compressed pages
(BREACH). Airflow is imported lazily: this module loads in any process, Airflow's own only use
it.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

from fastapi import Request

from tidemark.config import dag_id

COOKIE = "_token"  # airflow.api_fastapi.auth.managers.base_auth_manager.COOKIE_NAME_JWT_TOKEN
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


class NotAuthenticated(Exception):
    """No valid Airflow token: 401 for the API, the login page for a browser."""


class Forbidden(Exception):
    """Authenticated, not allowed: 403."""


@dataclass
class Caller:
    user: Any  # airflow's BaseUser
    token: str  # the caller's own JWT, forwarded when Tidemark calls Airflow's API for them
    via_cookie: bool

    @property
    def name(self) -> str:
        return self.user.get_name()


def _auth_manager():
    from airflow.api_fastapi.app import get_auth_manager

    return get_auth_manager()


async def authenticate(request: Request) -> Caller:
    from airflow.api_fastapi.core_api.security import get_user
    from fastapi import HTTPException
    from fastapi.security import HTTPAuthorizationCredentials

    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    bearer = None
    if scheme.lower() == "bearer" and credentials.strip():
        bearer = HTTPAuthorizationCredentials(scheme="Bearer", credentials=credentials.strip())
    try:
        user = await get_user(request, None, bearer)
    except HTTPException as exc:  # missing (401), expired (401) or invalid (403) token
        raise NotAuthenticated(str(exc.detail)) from None
    token = bearer.credentials if bearer else request.cookies.get(COOKIE, "")
    return Caller(user, token, via_cookie=bearer is None)


async def guard(request: Request) -> Caller:
    """The app-wide dependency: authenticated, and for a POST same-origin with a CSRF token
    when the cookie authenticated it."""
    caller = await authenticate(request)
    if request.method not in SAFE_METHODS:
        if not same_origin(request):
            raise Forbidden(
                f"cross-origin request refused (Origin {request.headers.get('origin')!r})"
            )
        if caller.via_cookie and not csrf_ok(caller, await _csrf_sent(request)):
            raise Forbidden("missing or wrong CSRF token; reload the page and try again")
    return caller


# -- CSRF and origin ------------------------------------------------------------------------
def _secret() -> bytes:
    from airflow.configuration import conf

    return conf.get("api", "secret_key").encode()


def _csrf_secret(caller: Caller) -> bytes:
    """Bound to the user, unknown to other sites, the same across Airflow's token refreshes."""
    user = str(caller.user.get_id()).encode()
    return hmac.new(_secret(), b"tidemark-csrf\x00" + user, hashlib.sha256).digest()


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))


def csrf_token(caller: Caller) -> str:
    """The token a page embeds in its forms: hex of a random mask and the secret XOR it, new
    for every response."""
    secret = _csrf_secret(caller)
    pad = secrets.token_bytes(len(secret))
    return (pad + _xor(pad, secret)).hex()


def csrf_ok(caller: Caller, sent: str | None) -> bool:
    secret = _csrf_secret(caller)
    try:
        raw = bytes.fromhex(sent or "")
    except ValueError:
        return False
    if len(raw) != 2 * len(secret):
        return False
    return hmac.compare_digest(_xor(raw[: len(secret)], raw[len(secret) :]), secret)


async def _csrf_sent(request: Request) -> str | None:
    if request.headers.get(CSRF_HEADER):
        return request.headers[CSRF_HEADER]
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "application/x-www-form-urlencoded":
        form = parse_qs((await request.body()).decode("utf-8", "replace"))
        sent = form.get(CSRF_FIELD)
        return sent[0] if sent else None
    return None


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


def same_origin(request: Request) -> bool:
    origin = request.headers.get("origin")
    if origin is None:  # not a browser's cross-site form or fetch
        return True
    from airflow.configuration import conf

    allowed = {_origin(str(request.base_url))}
    if base := conf.get("api", "base_url", fallback=""):
        allowed.add(_origin(base))
    return origin.lower() in allowed


# -- authorization ------------------------------------------------------------------------------
# Multi-team Airflow: a DAG belongs to its bundle's team, and the auth manager decides only
# with that team in the request (Airflow's own routes pass it the same way:
# airflow.api_fastapi.core_api.security.requires_access_dag).
def _multi_team() -> bool:
    from airflow.configuration import conf

    return conf.getboolean("core", "multi_team", fallback=False)


# A DAG no bundle holds (deleted, renamed, never deployed, run only from the CLI) has no known
# team. Treating it as "no team" would open its letters to every team, so such a pipeline
# needs the access a caller has to every team's DAGs at once: in practice, an admin's.
class _Team(enum.Enum):
    UNKNOWN = "unknown"


_UNKNOWN: Final = _Team.UNKNOWN


def _teams(dag_ids: Iterable[str]) -> dict[str, str | None | _Team]:
    """The team of each DAG (multi-team mode; else none): a name, None for a DAG of a bundle
    without a team, or _UNKNOWN for a DAG Airflow does not know."""
    if not _multi_team():
        return {}
    from airflow.models.dag import DagModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    wanted = sorted(set(dag_ids))
    with create_session() as session:
        known = set(session.scalars(select(DagModel.dag_id).where(DagModel.dag_id.in_(wanted))))
    named = DagModel.get_dag_id_to_team_name_mapping(wanted)
    return {d: (named.get(d) if d in known else _UNKNOWN) for d in wanted}


def _allowed(caller: Caller, method: str, dag: str, team: str | None | _Team) -> bool:
    from airflow.api_fastapi.auth.managers.models.resource_details import DagDetails
    from airflow.models.team import Team

    am = _auth_manager()
    if team is _UNKNOWN:
        every = [None, *sorted(Team.get_all_team_names())]
        return all(
            am.is_authorized_dag(
                method=method, user=caller.user, details=DagDetails(id=dag, team_name=t)
            )
            for t in every
        )
    return am.is_authorized_dag(
        method=method, user=caller.user, details=DagDetails(id=dag, team_name=team)
    )


def may_read_all(caller: Caller) -> bool:
    """Read access to every DAG: no need to narrow lists to pipelines one by one. Never
    assumed in multi-team mode, where a reader's access depends on each DAG's team."""
    if _multi_team():
        return False
    return _auth_manager().is_authorized_dag(method="GET", user=caller.user)


def readable(caller: Caller, pipelines: Iterable[str]) -> list[str]:
    by_dag = {dag_id(p): p for p in pipelines}
    teams = _teams(by_dag)
    ok: set[str] = {d for d, t in teams.items() if t is _UNKNOWN and _allowed(caller, "GET", d, t)}
    for team in {teams.get(d) for d in by_dag} - {_UNKNOWN}:
        ok |= _auth_manager().filter_authorized_dag_ids(
            dag_ids={d for d in by_dag if teams.get(d) == team},
            user=caller.user,
            method="GET",
            team_name=team,
        )
    return sorted(by_dag[d] for d in ok)


def require(caller: Caller, method: str, pipelines: Iterable[str]) -> None:
    """Forbidden unless the caller may read (GET) or edit (PUT) every pipeline's DAG."""
    chosen = sorted(set(pipelines))
    teams = _teams(dag_id(p) for p in chosen)
    for p in chosen:
        if not _allowed(caller, method, dag_id(p), teams.get(dag_id(p))):
            need = "read" if method == "GET" else "edit"
            raise Forbidden(
                f"{caller.name} may not {'see' if method == 'GET' else 'change'} "
                f"dead letters of {p}: needs {need} access to DAG {dag_id(p)}"
            )


def login_url(request: Request) -> str:
    here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return _auth_manager().get_url_login(next_url=here)
