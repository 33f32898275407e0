"""The fleet's two token Secrets and the environment variables that read them (pure).

================  =================================  ===============================================
Secret            key ``token``: who presents it     env var in the pods
================  =================================  ===============================================
``<drs>-control``  the sidecar, the operator           ``DRS_CONTROL_TOKEN`` (engines)
``<drs>-serving``  frontends, engines (KV fetch,        ``DRS_SERVING_TOKEN`` (engines and frontends)
                   gang polling)
================  =================================  ===============================================

(``drs_protocol.auth``.) Each Secret is owned by the DisaggReplicaSet (``ownerReferences``: it
goes with the fleet), created once with a random token (:data:`TOKEN_BYTES` bytes, hex) when it is
missing, and never compared or replaced afterwards: the operator does not rotate a token. Pods read
it through a ``secretKeyRef`` (the dev cluster's pod runner resolves those, it mounts no volumes);
the token is never in a ConfigMap, the status or an Event.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any, Final

from drs_protocol import env

from drs_operator.api import names
from drs_operator.api.objects import Manifest
from drs_operator.manifests.common import Owner

TOKEN_BYTES: Final = 32


def build_token_secret(owner: Owner, name: str, token: str | None = None) -> Manifest:
    """A token Secret named ``name`` (``token`` or a fresh random one)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": owner.metadata(name, names.labels(owner.name)),
        "type": "Opaque",
        "stringData": {env.TOKEN_SECRET_KEY: token or secrets.token_hex(TOKEN_BYTES)},
    }


def build_control_secret(owner: Owner, token: str | None = None) -> Manifest:
    """The Secret holding the engines' control-API token."""
    return build_token_secret(owner, names.control_secret_name(owner.name), token)


def build_serving_secret(owner: Owner, token: str | None = None) -> Manifest:
    """The Secret holding the fleet's serving token."""
    return build_token_secret(owner, names.serving_secret_name(owner.name), token)


def missing_secrets(owner: Owner, live: Mapping[str, Manifest]) -> list[Manifest]:
    """The token Secrets to create: those of the two not in ``live`` (by name), fresh tokens."""
    wanted = (build_control_secret, build_serving_secret)
    built = [build(owner) for build in wanted]
    return [secret for secret in built if secret["metadata"]["name"] not in live]


def token_env(variable: str, secret_name: str) -> dict[str, Any]:
    """An env entry reading a token Secret's ``token`` key."""
    return {"name": variable, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": env.TOKEN_SECRET_KEY}}}


def control_token_env(drs: str) -> dict[str, Any]:
    """``DRS_CONTROL_TOKEN`` from ``<drs>-control``."""
    return token_env(env.CONTROL_TOKEN, names.control_secret_name(drs))


def serving_token_env(drs: str) -> dict[str, Any]:
    """``DRS_SERVING_TOKEN`` from ``<drs>-serving``."""
    return token_env(env.SERVING_TOKEN, names.serving_secret_name(drs))
