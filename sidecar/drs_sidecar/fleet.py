"""Which engines there are: read from the DisaggReplicaSet's status, or given as flags.

:func:`engines_from_status` is pure: it parses ``status`` with the operator's own models (the one
schema source) and lists every engine of every replica with its URL and readiness.
:class:`KubeFleet` reads the resource each time it is asked (a refit always acts on the current
status, never on a cached one) and records a completed refit in the annotation
``disagg.dev/weights-version``, which the operator copies into ``status.weights`` (status is
written by the operator only). :class:`StaticFleet` is a fixed list of engine URLs, for running
the sidecar beside engines outside Kubernetes.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from drs_operator.api import DisaggReplicaSetStatus
from drs_operator.api.constants import (
    ANNOTATION_DESIRED_WEIGHTS,
    ANNOTATION_ENGINE_WEIGHTS,
    ANNOTATION_WEIGHTS_VERSION,
    GROUP,
    PLURAL,
    VERSION,
)
from drs_operator.api.names import control_secret_name
from drs_protocol.env import CONTROL_TOKEN_SECRET_KEY
from drs_protocol.token_source import KEY_NEXT
from drs_protocol.weights_state import DesiredWeights, HeldWeights, dump_engine_weights, parse_desired_weights
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException
from pydantic import ValidationError

from drs_sidecar.errors import FleetError

#: Seconds for one read or patch of the resource.
KUBE_TIMEOUT_S: Final = 10.0


@dataclass(frozen=True, slots=True)
class Engine:
    name: str
    role: str
    replica: int
    url: str | None
    ready: bool
    width: int = 1  #: GPUs (tensor-parallel ranks): its ranks in a collective refit group


def engines_from_status(status: Mapping[str, Any] | None) -> list[Engine]:
    """Every engine the status lists, replica by replica (unplaced replicas have none)."""
    try:
        parsed = DisaggReplicaSetStatus.model_validate(status or {})
    except ValidationError as exc:
        raise FleetError(f"status cannot be read: {exc}") from exc
    return [
        Engine(
            name=e.name,
            role=e.role.value,
            replica=rs.index,
            url=e.url,
            ready=e.ready and e.url is not None,
            width=e.width,
        )
        for rs in parsed.replica_statuses
        for e in rs.engines
    ]


class Fleet(Protocol):
    async def engines(self) -> list[Engine]: ...
    async def publish(self, version: str) -> None: ...
    async def publish_engines(self, held: Mapping[str, HeldWeights]) -> None: ...
    async def desire(self, weights: DesiredWeights | None) -> None: ...
    async def desired(self) -> DesiredWeights | None: ...
    async def close(self) -> None: ...


class StaticFleet:
    """Engines given by URL (``drs sidecar --engine URL``): all taken as ready and one GPU wide; a
    completed refit is recorded nowhere but the sidecar's memory."""

    def __init__(self, urls: Sequence[str]) -> None:
        self._engines = [Engine(name=url, role="engine", replica=0, url=url.rstrip("/"), ready=True) for url in urls]
        self._desired: DesiredWeights | None = None

    async def engines(self) -> list[Engine]:
        return list(self._engines)

    async def publish(self, version: str) -> None:
        return None

    async def publish_engines(self, held: Mapping[str, HeldWeights]) -> None:
        return None

    async def desire(self, weights: DesiredWeights | None) -> None:
        self._desired = weights

    async def desired(self) -> DesiredWeights | None:
        return self._desired

    async def close(self) -> None:
        return None


class KubeFleet:
    """One DisaggReplicaSet, read through the Kubernetes API (in-cluster config or KUBECONFIG)."""

    def __init__(self, api: Any, namespace: str, name: str) -> None:
        self._api = api
        self._custom = client.CustomObjectsApi(api)
        self._core = client.CoreV1Api(api)
        self.namespace = namespace
        self.name = name

    @classmethod
    async def connect(cls, namespace: str, name: str) -> KubeFleet:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            await config.load_kube_config()
        return cls(client.ApiClient(), namespace, name)

    async def _read(self) -> dict[str, Any]:
        try:
            body: dict[str, Any] = await self._custom.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, self.name, _request_timeout=KUBE_TIMEOUT_S
            )
        except ApiException as exc:
            raise FleetError(f"DisaggReplicaSet {self.namespace}/{self.name}: {exc.status} {exc.reason}") from exc
        return body

    async def engines(self) -> list[Engine]:
        return engines_from_status((await self._read()).get("status"))

    async def publish(self, version: str) -> None:
        await self._annotate(ANNOTATION_WEIGHTS_VERSION, version, f"recording weights version {version!r}")

    async def publish_engines(self, held: Mapping[str, HeldWeights]) -> None:
        """Record what each engine holds (version and digest), for the operator's per-engine
        status and WeightsSplit (:mod:`drs_protocol.weights_state`)."""
        text = dump_engine_weights(dict(held))
        await self._annotate(ANNOTATION_ENGINE_WEIGHTS, text, "recording per-engine weights")

    async def desire(self, weights: DesiredWeights | None) -> None:
        """Store the desired weights (annotation ``disagg.dev/desired-weights``; None removes it)."""
        what = "recording the desired weights" if weights else "removing the desired weights"
        await self._annotate(ANNOTATION_DESIRED_WEIGHTS, weights.dump() if weights else None, what)

    async def desired(self) -> DesiredWeights | None:
        """The desired weights an earlier refit stored (None: none, or unreadable)."""
        annotations = ((await self._read()).get("metadata") or {}).get("annotations") or {}
        return parse_desired_weights(annotations.get(ANNOTATION_DESIRED_WEIGHTS))

    async def _annotate(self, key: str, value: str | None, what: str) -> None:
        patch = {"metadata": {"annotations": {key: value}}}
        try:
            await self._custom.patch_namespaced_custom_object(  # type: ignore[call-arg]
                GROUP,
                VERSION,
                self.namespace,
                PLURAL,
                self.name,
                patch,
                _content_type="application/merge-patch+json",  # the client's default is a JSON patch
                _request_timeout=KUBE_TIMEOUT_S,
            )
        except ApiException as exc:
            raise FleetError(f"{what}: {exc.status} {exc.reason}") from exc

    async def control_token(self) -> str:
        """The engines' control token, from the Secret the operator created for this resource."""
        secret_name = control_secret_name(self.name)
        try:
            secret = await self._core.read_namespaced_secret(
                secret_name, self.namespace, _request_timeout=KUBE_TIMEOUT_S
            )
        except ApiException as exc:
            raise FleetError(f"Secret {self.namespace}/{secret_name}: {exc.status} {exc.reason}") from exc
        data = secret.data or {}
        # a Secret re-created under running engines holds its new token under `next` for one
        # rotation window (drs_protocol.token_source): the engines accept it there
        key = CONTROL_TOKEN_SECRET_KEY if CONTROL_TOKEN_SECRET_KEY in data else KEY_NEXT
        if key not in data:
            raise FleetError(f"Secret {self.namespace}/{secret_name} has no key {CONTROL_TOKEN_SECRET_KEY!r}")
        return base64.b64decode(data[key]).decode()

    async def close(self) -> None:
        await self._api.close()
