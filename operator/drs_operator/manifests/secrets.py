"""The fleet's two token Secrets and the environment variables that read them (pure).

================  =================================  ===============================================
Secret            key ``token``: who presents it     mounted in the pods at (``drs_protocol.auth``)
================  =================================  ===============================================
``<drs>-control``  the sidecar, the operator           ``/etc/drs/tokens/control`` (engines)
``<drs>-serving``  frontends, engines (KV fetch,        ``/etc/drs/tokens/serving`` (engines, frontends)
                   gang polling)
================  =================================  ===============================================

(``drs_protocol.auth``.) Each Secret is owned by the DisaggReplicaSet (``ownerReferences``: it
goes with the fleet) and created with a random token (:data:`TOKEN_BYTES` bytes, hex) when it is
missing; afterwards only a rotation changes it (``manifests.rotation``). Pods mount it read-only as
a directory (:func:`token_mount`) named to the process by ``DRS_SERVING_TOKEN_DIR`` /
``DRS_CONTROL_TOKEN_DIR``: the process re-reads it while it runs (``drs_protocol.token_source``),
so a rotation needs no restart. The token is never in a ConfigMap, the status or an Event. A Secret
deleted under a running fleet is re-created at the next pass as the first phase of a rotation
(``rotation.recreated_secret``), and :func:`secret_notes` says so in a Warning Event naming the
pods that read it.
"""

from __future__ import annotations

import datetime
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from drs_protocol import auth, env, routes

from drs_operator.api import names
from drs_operator.api.constants import EventReason, EventType
from drs_operator.api.objects import Manifest
from drs_operator.manifests.common import Owner
from drs_operator.manifests.rotation import recreated_secret
from drs_operator.status_events import EventNote

TOKEN_BYTES: Final = 32
#: The pod volumes of the two Secrets.
CONTROL_VOLUME: Final = "control-token"
SERVING_VOLUME: Final = "serving-token"


@dataclass(frozen=True)
class TokenMount:
    """A token Secret's pod volume, the container's mount of it, and the env entry naming it."""

    volume: dict[str, Any]
    mount: dict[str, Any]
    env: dict[str, Any]


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


def missing_secrets(
    owner: Owner,
    live: Mapping[str, Manifest],
    pods: Mapping[str, Manifest],
    request: str | None,
    now: datetime.datetime,
) -> list[Manifest]:
    """The token Secrets to create: those of the two not in ``live`` (by name), fresh tokens; one
    that running pods read is re-created as phase 1 of a rotation (``rotation.recreated_secret``)."""
    wanted = (build_control_secret, build_serving_secret)
    built = [build(owner) for build in wanted]
    return [
        recreated_secret(secret, request, now) if _readers(pods, secret["metadata"]["name"]) else secret
        for secret in built
        if secret["metadata"]["name"] not in live
    ]


def _readers(pods: Mapping[str, Manifest], secret_name: str) -> list[str]:
    """The live pods that mount ``secret_name`` or read it through a ``secretKeyRef``."""
    found = []
    for name, pod in sorted(pods.items()):
        spec = pod.get("spec") or {}
        refs = [
            ((var.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")
            for container in spec.get("containers") or []
            for var in container.get("env") or []
        ]
        refs += [(volume.get("secret") or {}).get("secretName") for volume in spec.get("volumes") or []]
        if secret_name in refs:
            found.append(name)
    return found


def secret_notes(created: list[Manifest], pods: Mapping[str, Manifest]) -> list[EventNote]:
    """An Event per Secret created: Normal the first time; a Warning naming the pods when pods that
    read it run (it was deleted under them): they keep presenting the token they hold and accept
    the new one, which they present from the rotation's second phase on (``manifests.rotation``)."""
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
            "with a new token as the first phase of a rotation; those pods keep presenting the token they "
            "hold, accept the new one now and switch to it after the rotation window"
        )
        notes.append(EventNote(EventType.WARNING, EventReason.TOKEN_SECRET_RECREATED, message))
    return notes


def token_mount(volume: str, secret_name: str, mount_path: str, dir_env: str) -> TokenMount:
    """A token Secret mounted read-only at ``mount_path`` and the env entry naming the directory."""
    return TokenMount(
        volume={"name": volume, "secret": {"secretName": secret_name}},
        mount={"name": volume, "mountPath": mount_path, "readOnly": True},
        env={"name": dir_env, "value": mount_path},
    )


def control_token_mount(drs: str) -> TokenMount:
    """``<drs>-control`` at ``/etc/drs/tokens/control`` (``DRS_CONTROL_TOKEN_DIR``)."""
    return token_mount(CONTROL_VOLUME, names.control_secret_name(drs), auth.CONTROL_TOKEN_DIR, env.CONTROL_TOKEN_DIR)


def serving_token_mount(drs: str) -> TokenMount:
    """``<drs>-serving`` at ``/etc/drs/tokens/serving`` (``DRS_SERVING_TOKEN_DIR``)."""
    return token_mount(SERVING_VOLUME, names.serving_secret_name(drs), auth.SERVING_TOKEN_DIR, env.SERVING_TOKEN_DIR)


def health_url(pod: Manifest) -> str | None:
    """``http://<pod IP>:<port>`` of the pod's ``/health`` probe (None: no address or no such probe)."""
    ip = str(((pod.get("status") or {}).get("podIP")) or "")
    for container in (pod.get("spec") or {}).get("containers") or []:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = (container.get(probe) or {}).get("httpGet") or {}
            if ip and get.get("path") == routes.HEALTH and isinstance(get.get("port"), int):
                return names.url(ip, get["port"])
    return None


def reader_urls(pods: Mapping[str, Manifest], secret_name: str) -> dict[str, str | None]:
    """The live pods that read ``secret_name`` (:func:`_readers`), each with its ``/health`` URL
    (None: not reachable yet), for asking which generation of the Secret they read."""
    return {name: health_url(pods[name]) for name in _readers(pods, secret_name)}
