"""The operator's asyncio Kubernetes client, with named timeouts and connection limits."""

from __future__ import annotations

import json
from collections.abc import Awaitable
from typing import Any, Final

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException

#: Seconds for any single API request (reads and writes).
REQUEST_TIMEOUT_S: Final = 30.0
#: Pooled connections to the apiserver (each watch of the caches holds one; writes share the rest).
CONNECTION_LIMIT: Final = 64


async def make_api_client() -> client.ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig (``$KUBECONFIG``)."""
    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except ConfigException:
        await config.load_kube_config(client_configuration=cfg, persist_config=False)
    cfg.connection_pool_maxsize = CONNECTION_LIMIT
    return client.ApiClient(cfg)


async def as_json(call: Awaitable[Any]) -> dict[str, Any]:
    """Await an API call made with ``_preload_content=False`` and decode its body as a plain dict
    (the operator works on manifests as dicts, the same shape its pure builders produce)."""
    return await request_json(call)


async def request_json(call: Awaitable[Any]) -> dict[str, Any]:
    """Like :func:`as_json`, and an answer outside 2xx raises :class:`ApiException` with its
    status, headers (``Retry-After``) and body, as a call with preloaded content would."""
    resp = await call
    try:
        body = await resp.read()
        if not 200 <= resp.status <= 299:
            exc = ApiException(status=resp.status, reason=resp.reason)
            exc.headers = resp.headers
            exc.body = body.decode(errors="replace")
            raise exc
        data: dict[str, Any] = json.loads(body) if body else {}
    finally:
        resp.release()
    return data
