"""Apply decided actions: create, replace, delete children; patch status; post Events.

Every write goes through :class:`Applier`, which counts it (``drs_operator_api_writes_total``),
so "a converged reconcile makes zero writes" is something a test can read off ``/metrics``, and
sends it within the client-side limits of one shared :class:`~drs_operator.kube.throttle.Throttle`
(in flight, rate, retries of 429/5xx honouring ``Retry-After``). ``AlreadyExists`` on create and
``NotFound`` on delete mean another actor (or an earlier run of this reconcile) got there first:
both are success for a level-based reconcile.

What the apiserver answers to a create or replace goes into the watch cache at once, and a
deleted child shows as terminating there, so the next reconcile acts on its own writes even
before their watch events arrive (``kube/informer.py``).
"""

from __future__ import annotations

import datetime
import logging
import uuid
from collections.abc import Callable
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from drs_operator.api.constants import API_VERSION, GROUP, KIND, PLURAL, VERSION
from drs_operator.api.objects import Manifest
from drs_operator.kube.cache import ClusterCache
from drs_operator.kube.client import REQUEST_TIMEOUT_S, request_json
from drs_operator.kube.throttle import Limits, Throttle
from drs_operator.metrics import OperatorMetrics

log = logging.getLogger(__name__)
COMPONENT = "drs-operator"


class Applier:
    def __init__(
        self,
        api: client.ApiClient,
        metrics: OperatorMetrics,
        throttle: Throttle | None = None,
        cache: ClusterCache | None = None,
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.networking = client.NetworkingV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.metrics = metrics
        self.throttle = throttle or Throttle(Limits())
        self.cache = cache

    async def _send(self, call: Callable[[], Any]) -> Manifest:
        """One write within the throttle's limits; the answer's body as a dict."""
        return await self.throttle.call(lambda: request_json(call()))

    def _remember(self, obj: Manifest) -> None:
        informer = self.cache.informer(obj["kind"], obj["metadata"]["namespace"]) if self.cache else None
        if informer is not None:
            informer.upsert({**obj, "kind": obj["kind"]})

    def _count(self, verb: str, kind: str) -> None:
        self.metrics.api_writes.labels(verb=verb, kind=kind).inc()

    def _methods(self, kind: str) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
        """(create, replace, delete) of a namespaced child kind."""
        table: dict[str, tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]] = {
            "Pod": (self.core.create_namespaced_pod, self.core.replace_namespaced_pod, self.core.delete_namespaced_pod),
            "Service": (
                self.core.create_namespaced_service,
                self.core.replace_namespaced_service,
                self.core.delete_namespaced_service,
            ),
            "ConfigMap": (
                self.core.create_namespaced_config_map,
                self.core.replace_namespaced_config_map,
                self.core.delete_namespaced_config_map,
            ),
            "Secret": (
                self.core.create_namespaced_secret,
                self.core.replace_namespaced_secret,
                self.core.delete_namespaced_secret,
            ),
            "Deployment": (
                self.apps.create_namespaced_deployment,
                self.apps.replace_namespaced_deployment,
                self.apps.delete_namespaced_deployment,
            ),
            "NetworkPolicy": (
                self.networking.create_namespaced_network_policy,
                self.networking.replace_namespaced_network_policy,
                self.networking.delete_namespaced_network_policy,
            ),
        }
        return table[kind]

    async def create(self, obj: Manifest) -> bool:
        """Create ``obj``; False when it already exists."""
        create, _, _ = self._methods(obj["kind"])
        self._count("create", obj["kind"])
        try:
            made = await self._send(
                lambda: create(
                    obj["metadata"]["namespace"], obj, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S
                )
            )
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        self._remember({**made, "kind": obj["kind"]})
        return True

    async def replace(self, obj: Manifest, live: Manifest) -> None:
        """Replace ``live`` with ``obj`` (PUT, guarded by the live resourceVersion)."""
        _, replace, _ = self._methods(obj["kind"])
        body = {**obj, "metadata": {**obj["metadata"], "resourceVersion": live["metadata"]["resourceVersion"]}}
        if obj["kind"] == "Service":  # the allocated cluster IPs are immutable
            spec = dict(body["spec"])
            for key in ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy"):
                if key in (live.get("spec") or {}):
                    spec[key] = live["spec"][key]
            body["spec"] = spec
        self._count("replace", obj["kind"])
        made = await self._send(
            lambda: replace(
                obj["metadata"]["name"],
                obj["metadata"]["namespace"],
                body,
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
        )
        self._remember({**made, "kind": obj["kind"]})

    async def delete(self, kind: str, namespace: str, name: str, grace_seconds: int | None = None) -> None:
        _, _, delete = self._methods(kind)
        self._count("delete", kind)
        body = client.V1DeleteOptions(grace_period_seconds=grace_seconds, propagation_policy="Background")
        try:
            await self._send(
                lambda: delete(name, namespace, body=body, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S)
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
        informer = self.cache.informer(kind, namespace) if self.cache else None
        if informer is not None:
            informer.mark_deleting(namespace, name, datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))

    async def annotate_pod(self, namespace: str, name: str, annotations: dict[str, str]) -> bool:
        """Merge ``annotations`` into a pod's metadata (a pod-object update, not its spec); False
        when the pod is gone (404). The patched pod goes into the watch cache."""
        self._count("patch", "Pod")
        body = {"metadata": {"annotations": annotations}}
        try:
            made = await self._send(
                lambda: self.core.patch_namespaced_pod(  # type: ignore[call-arg]
                    name,
                    namespace,
                    body,
                    _content_type="application/merge-patch+json",
                    _preload_content=False,
                    _request_timeout=REQUEST_TIMEOUT_S,
                )
            )
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        self._remember({**made, "kind": "Pod"})
        return True

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self._count("patch", "DisaggReplicaSet/status")
        await self._send(
            lambda: self.custom.patch_namespaced_custom_object_status(  # type: ignore[call-arg]
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                name,
                {"status": status},
                _content_type="application/merge-patch+json",
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
        )

    async def event(self, owner: Manifest, type_: str, reason: str, message: str) -> None:
        """Post a core/v1 Event about the DisaggReplicaSet (best effort: never fails a reconcile)."""
        meta = owner["metadata"]
        now = datetime.datetime.now(datetime.UTC)
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(name=f"{meta['name']}.{uuid.uuid4().hex[:12]}", namespace=meta["namespace"]),
            involved_object=client.V1ObjectReference(
                api_version=API_VERSION, kind=KIND, name=meta["name"], namespace=meta["namespace"], uid=meta["uid"]
            ),
            reason=reason,
            message=message[:1024],
            type=type_,
            first_timestamp=now,
            last_timestamp=now,
            count=1,
            source=client.V1EventSource(component=COMPONENT),
            reporting_component=COMPONENT,
            reporting_instance=COMPONENT,
        )
        self._count("create", "Event")
        try:
            await self._send(
                lambda: self.core.create_namespaced_event(
                    meta["namespace"], body, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S
                )
            )
        except (ApiException, OSError) as exc:
            log.warning("could not post event %s: %s", reason, exc)
