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
the token is never in a ConfigMap, the status or an Event. A Secret deleted under a running
fleet is re-created with a new token at the next pass, and :func:`secret_notes` says so in a
Warning Event naming the pods that still hold the old one.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any, Final

from drs_protocol import env

from drs_operator.api import names
from drs_operator.api.constants import EventReason, EventType
from drs_operator.api.objects import Manifest
from drs_operator.manifests.common import Owner
from drs_operator.status_events import EventNote

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


def _readers(pods: Mapping[str, Manifest], secret_name: str) -> list[str]:
    """The live pods whose containers read ``secret_name`` through a ``secretKeyRef``."""
    found = []
    for name, pod in sorted(pods.items()):
        containers = (pod.get("spec") or {}).get("containers") or []
        refs = (
            ((var.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")
            for container in containers
            for var in container.get("env") or []
        )
        if secret_name in refs:
            found.append(name)
    return found


def secret_notes(created: list[Manifest], pods: Mapping[str, Manifest]) -> list[EventNote]:
    """An Event per Secret created: Normal the first time; a Warning naming the pods when pods that
    read it run (it was deleted under them): they keep the token they started with, pods started
    from now on read the new one, and the two refuse each other (401) until the old pods restart."""
    notes = []
    for secret in created:
        name = secret["metadata"]["name"]
        readers = _readers(pods, name)
        if not readers:
            notes.append(EventNote(EventType.NORMAL, EventReason.TOKEN_SECRET_CREATED, f"created Secret {name}"))
            continue
        shown = ", ".join(readers[:5]) + (f" and {len(readers) - 5} more" if len(readers) > 5 else "")
        message = (
            f"Secret {name} was missing while {len(readers)} pod(s) that read it run ({shown}): re-created "
            "with a new token; those pods keep the old one and refuse pods started from now on (401) "
            "until they restart"
        )
        notes.append(EventNote(EventType.WARNING, EventReason.TOKEN_SECRET_RECREATED, message))
    return notes


def token_env(variable: str, secret_name: str) -> dict[str, Any]:
    """An env entry reading a token Secret's ``token`` key."""
    return {"name": variable, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": env.TOKEN_SECRET_KEY}}}


def control_token_env(drs: str) -> dict[str, Any]:
    """``DRS_CONTROL_TOKEN`` from ``<drs>-control``."""
    return token_env(env.CONTROL_TOKEN, names.control_secret_name(drs))


def serving_token_env(drs: str) -> dict[str, Any]:
    """``DRS_SERVING_TOKEN`` from ``<drs>-serving``."""
    return token_env(env.SERVING_TOKEN, names.serving_secret_name(drs))
