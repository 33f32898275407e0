"""Reading one DisaggReplicaSet through the Kubernetes API: a GET, and a watch that survives the
server's timeouts, a 410 (resource version gone) and a dropped connection.

Credentials: the pod's ServiceAccount when in a cluster, else ``kubeconfig`` (or ``$KUBECONFIG``,
else ``~/.kube/config``). Every call has a named timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any, Final

import aiohttp
from drs_operator.api.constants import GROUP, PLURAL, VERSION
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from drs_client.errors import FleetNotFound, FleetUnreadable
from drs_client.fleet import FleetView
from drs_client.parse import view_of

log = logging.getLogger(__name__)

#: Seconds for one GET of the resource.
KUBE_TIMEOUT_S: Final = 10.0
#: Seconds the apiserver keeps one watch open (then it is opened again from the last version).
WATCH_TIMEOUT_S: Final = 60
#: Seconds between tries when the API cannot be reached while watching (doubling up to the max).
RETRY_BASE_S: Final = 0.5
RETRY_MAX_S: Final = 10.0


async def api_client(kubeconfig: str | os.PathLike[str] | None = None) -> Any:
    """An ApiClient of its own: in-cluster credentials when there are any (and no ``kubeconfig``
    was given), else the kubeconfig file."""
    if kubeconfig is None:
        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            pass
        else:
            return client.ApiClient(configuration=configuration)
    path = None if kubeconfig is None else str(Path(kubeconfig))
    return await config.new_client_from_config(config_file=path, persist_config=False)


class KubeReader:
    """One DisaggReplicaSet, read with its own ApiClient (closed by :meth:`close`)."""

    def __init__(self, api: Any, namespace: str, name: str, *, watch_timeout_s: int = WATCH_TIMEOUT_S) -> None:
        self._api = api
        self._custom = client.CustomObjectsApi(api)
        self.namespace = namespace
        self.name = name
        self.watch_timeout_s = watch_timeout_s

    async def read(self) -> dict[str, Any]:
        """The resource as the API returns it (``FleetNotFound``, ``FleetUnreadable``)."""
        try:
            body: dict[str, Any] = await self._custom.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, self.name, _request_timeout=KUBE_TIMEOUT_S
            )
        except ApiException as exc:
            if exc.status == 404:
                raise FleetNotFound(self.namespace, self.name, "not found") from exc
            raise FleetUnreadable(self.namespace, self.name, f"{exc.status} {exc.reason}") from exc
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise FleetUnreadable(self.namespace, self.name, f"the API did not answer: {exc!r}") from exc
        return body

    async def view(self) -> FleetView:
        return view_of(await self.read())

    async def watch(self) -> AsyncGenerator[FleetView, None]:
        """The view now, then every time it changes; ends with ``FleetNotFound`` when the resource is
        deleted. The API's hiccups are retried (with back-off), never raised."""
        body = await self.read()
        current = view_of(body)
        yield current
        version = str(body["metadata"]["resourceVersion"])
        delay = RETRY_BASE_S
        while True:
            try:
                async for event in self._events(version):
                    obj = event["raw_object"]
                    version = str(obj["metadata"]["resourceVersion"])
                    if event["type"] == "DELETED":
                        raise FleetNotFound(self.namespace, self.name, "deleted")
                    if event["type"] in ("ADDED", "MODIFIED"):
                        view = view_of(obj)
                        if view != current:
                            current = view
                            yield view
                delay = RETRY_BASE_S
                continue
            except ApiException as exc:
                if exc.status != 410:
                    log.warning("watching %s/%s: %s %s", self.namespace, self.name, exc.status, exc.reason)
                    await asyncio.sleep(delay)
                    delay = min(RETRY_MAX_S, delay * 2)
            except (TimeoutError, aiohttp.ClientError) as exc:
                log.warning("watching %s/%s: %r", self.namespace, self.name, exc)
                await asyncio.sleep(delay)
                delay = min(RETRY_MAX_S, delay * 2)
            # resource version gone (410) or the watch broke: read afresh and go on from there
            with contextlib.suppress(FleetUnreadable):
                body = await self.read()
                version = str(body["metadata"]["resourceVersion"])
                view = view_of(body)
                if view != current:
                    current = view
                    yield view

    async def _events(self, version: str) -> AsyncIterator[dict[str, Any]]:
        stream = watch.Watch()
        async with stream.stream(
            self._custom.list_namespaced_custom_object,
            GROUP,
            VERSION,
            self.namespace,
            PLURAL,
            field_selector=f"metadata.name={self.name}",
            resource_version=version,
            timeout_seconds=self.watch_timeout_s,
            _request_timeout=self.watch_timeout_s + KUBE_TIMEOUT_S,
        ) as events:
            async for event in events:
                yield event

    async def close(self) -> None:
        await self._api.close()
