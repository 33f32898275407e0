"""Who may call this engine: the serving and control tokens of ``drs_protocol.auth``, checked once.

:class:`EngineAuth` is an ASGI middleware in front of every route of the engine app, so a route
added later (a control route, an info route) is covered without naming it: ``/health`` and
``/metrics`` are open; ``/control/...`` needs the control token; everything else, unknown paths
included, the serving token. A missing or wrong token answers 401 (``drs_protocol.auth.
unauthorized``, with the realm's ``www-authenticate``) before the route runs or reads a byte of
the body. The comparison is constant-time; the token is never logged or echoed.

An engine started without a serving token serves the serving realm to anyone (logged at start);
one started without a control token refuses the whole control API (403, :func:`check_control`,
which the control routes call too, so a control route registered outside this app's middleware,
e.g. in a test, is still guarded). A request whose control token the middleware accepted carries
that in its scope (:data:`CHECKED_REALM`), and :func:`check_control` does not compare it again.
"""

from __future__ import annotations

from typing import Any

from drs_protocol import auth, env
from drs_protocol.auth import Realm
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from drs_engine.errors import ForbiddenError, UnauthorizedError
from drs_engine.server.state import EngineState

_AUTH_HEADER = auth.AUTH_HEADER.encode()
#: The scope key :class:`EngineAuth` sets to the realm whose token it has just accepted, so that
#: :func:`check_control` behind it does not parse and compare the same header again.
CHECKED_REALM = "drs_engine.auth.checked_realm"


def _presented(scope: Scope) -> tuple[str | None, bool]:
    """(the presented token, whether an ``authorization`` header was there at all)."""
    for name, value in scope.get("headers") or ():
        if name == _AUTH_HEADER:
            return auth.presented_token(value.decode("latin-1")), True
    return None, False


def _refusal(realm: Realm, presented: str | None, had_header: bool) -> str:
    return auth.unauthorized(
        realm, presented=presented is not None, malformed=had_header and presented is None
    ).error.message


def check_control(state: EngineState, request: Request) -> None:
    """The control routes' check: 403 when the control API is off; 401 without the right token."""
    tokens = state.control_tokens
    if not tokens.configured:
        raise ForbiddenError(
            f"the control API is disabled on this engine: start it with --control-token-file or {env.CONTROL_TOKEN}"
        )
    if request.scope.get(CHECKED_REALM) is Realm.CONTROL:  # EngineAuth accepted this request's token
        return
    header = request.headers.get(auth.AUTH_HEADER)
    presented = auth.presented_token(header)
    if not tokens.matches(presented):
        raise UnauthorizedError(_refusal(Realm.CONTROL, presented, header is not None))


class EngineAuth:
    """The middleware: the realm of the path, then its tokens (none for the open realm).

    Per request it reads attributes only: the sources' accepted tokens are re-read off the
    request path (``drs_protocol.token_source``, about once a second)."""

    def __init__(self, app: ASGIApp, state: EngineState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        realm = auth.realm_of(scope.get("path", ""))
        if realm is Realm.OPEN:
            await self.app(scope, receive, send)
            return
        # control: a disabled control API is check_control's 403
        tokens = self.state.serving_tokens if realm is Realm.SERVING else self.state.control_tokens
        if not tokens.configured:
            await self.app(scope, receive, send)
            return
        presented, had_header = _presented(scope)
        if tokens.matches(presented):
            scope[CHECKED_REALM] = realm
            await self.app(scope, receive, send)
            return
        answer: dict[str, Any] = auth.unauthorized(
            realm, presented=presented is not None, malformed=had_header and presented is None
        ).model_dump(mode="json")
        response = JSONResponse(answer, status_code=401, headers=auth.challenge(realm))
        await response(scope, receive, send)
