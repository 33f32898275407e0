"""The engines' two credentials: which bearer token each engine route needs, and how it is read.

Every engine route belongs to one :class:`Realm`:

==============  ==========================================================  ==============================
realm           routes                                                      token (Secret, key ``token``)
==============  ==========================================================  ==============================
``open``        ``/health``, ``/metrics`` (what the kubelet and Prometheus   none
                need)
``control``     ``/control/...``                                            ``<drs>-control``
                                                                            (:data:`env.CONTROL_TOKEN`)
``serving``     everything else: the turn legs, ``/v1/models``,             ``<drs>-serving``
                ``/server_info``, ``/v1/gang``, the KV fetch                (:data:`env.SERVING_TOKEN`)
==============  ==========================================================  ==============================

A caller sends ``authorization: Bearer <token>`` (:func:`bearer`); the engine compares it in
constant time (:func:`token_matches`). A missing or wrong token answers 401 with the OpenAI
error body (``type: authentication_error``, ``param`` the header) and
``www-authenticate: Bearer realm="drs-serving"`` (or ``drs-control``), :func:`unauthorized`;
the token itself is never in an answer or a log line. An engine started without a serving token
serves its serving realm to anyone (a hand-started engine, the tests' engines) and says so in
its log; the operator always renders one. Who presents the serving token: the frontends
(upstream clients), a decode engine fetching a context's KV, a gang rank polling its leader,
anything else calling an engine's serving routes directly. The control token: the trainer's
sidecar and the operator (``GET /control/weights``).

Both tokens are read the same way by every process (``drs_protocol.token_source``): the
operator mounts each Secret as a directory (:data:`SERVING_TOKEN_DIR`, :data:`CONTROL_TOKEN_DIR`,
named to the process by :data:`env.SERVING_TOKEN_DIR` / :data:`env.CONTROL_TOKEN_DIR`) that is
re-read about once a second, so a rotation (keys ``token``, ``next``, ``previous``) reaches a
running process; without one, a file given on the command line (:func:`read_token`), else the
environment variable.
"""

from __future__ import annotations

import hmac
from enum import StrEnum
from pathlib import Path
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict

from drs_protocol import fields, routes
from drs_protocol.errors import error_body


class Realm(StrEnum):
    """Which credential a route needs (``open``: none)."""

    OPEN = "open"
    SERVING = "serving"
    CONTROL = "control"


#: The header a caller presents its token in, and the scheme (``fields``' control-API names).
AUTH_HEADER: Final = fields.CONTROL_AUTH_HEADER
CHALLENGE_HEADER: Final = fields.CONTROL_AUTH_CHALLENGE_HEADER
SCHEME: Final = fields.CONTROL_AUTH_SCHEME
#: The routes anyone may call: the kubelet's probe and Prometheus' scrape.
OPEN_PATHS: Final = frozenset({routes.HEALTH, routes.METRICS})
#: Every route under this prefix is the control API's.
CONTROL_PREFIX: Final = "/control"
#: Where the operator mounts the two token Secrets in engine and frontend pods.
SERVING_TOKEN_DIR: Final = "/etc/drs/tokens/serving"
CONTROL_TOKEN_DIR: Final = "/etc/drs/tokens/control"
#: ``www-authenticate`` realm per realm that needs a token.
REALM_NAMES: Final = {Realm.SERVING: "drs-serving", Realm.CONTROL: "drs-control"}


def realm_of(path: str) -> Realm:
    """The realm of an engine request path (a path not routed is still the serving realm: an
    unauthenticated caller learns nothing about which routes exist)."""
    if path in OPEN_PATHS:
        return Realm.OPEN
    if path == CONTROL_PREFIX or path.startswith(CONTROL_PREFIX + "/"):
        return Realm.CONTROL
    return Realm.SERVING


def bearer(token: str) -> dict[str, str]:
    """The header a caller of an engine sends (either realm)."""
    return fields.control_auth(token)


def presented_token(header_value: str | None) -> str | None:
    """The token of an ``authorization`` value in the Bearer scheme (case-insensitive), or None."""
    return fields.bearer_token(header_value or "")


def token_matches(presented: str | None, expected: str) -> bool:
    """Constant-time comparison of a presented token against the expected one (None: no match)."""
    if presented is None:
        return False
    return hmac.compare_digest(presented.encode(), expected.encode())


def challenge(realm: Realm) -> dict[str, str]:
    """The ``www-authenticate`` header of a 401 in ``realm``."""
    return {CHALLENGE_HEADER: f'{SCHEME} realm="{REALM_NAMES[realm]}"'}


class UnauthorizedDetail(BaseModel):
    """The ``error`` object of a 401 from an engine."""

    model_config = ConfigDict(extra="forbid")

    message: str
    type: Literal["authentication_error"] = "authentication_error"
    param: Literal["authorization"] = AUTH_HEADER
    code: Literal[401] = 401
    realm: Realm


class Unauthorized(BaseModel):
    """The body of an engine's 401 (the OpenAI error shape plus the realm)."""

    model_config = ConfigDict(extra="forbid")

    error: UnauthorizedDetail


def unauthorized(realm: Realm, *, presented: bool, malformed: bool = False) -> Unauthorized:
    """The 401 answer in ``realm``: no token presented, a header not in the Bearer scheme
    (``malformed``), or a token that does not match (never echoed)."""
    name = "serving" if realm is Realm.SERVING else "control"
    if malformed:
        why = f"the {AUTH_HEADER} header given is not in the {SCHEME} scheme"
    else:
        why = f"{'a wrong' if presented else 'no'} token was given"
    message = f"this engine route needs the fleet's {name} token ('{AUTH_HEADER}: {SCHEME} <token>'); {why}"
    body = error_body(401, message, param=AUTH_HEADER, realm=realm.value)
    return Unauthorized.model_validate(body)


def read_token(token_file: str | Path | None, env_value: str | None) -> str | None:
    """A token from ``token_file`` (stripped; it wins) or else ``env_value`` (the environment
    variable's value); None when neither holds one. An unreadable file raises ``OSError``."""
    if token_file is not None:
        return Path(token_file).read_text().strip() or None
    return (env_value or "").strip() or None
