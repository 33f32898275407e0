"""Ask the API whether each ``spec.networkPolicy.engineClients`` peer selects a pod
(``drs_operator.policy_peers`` has the rules and the messages).

Per peer: the namespaces its ``namespaceSelector`` selects (a list of namespaces by label; none
without one: the fleet's namespace), then a ``limit=1`` list of pods by its ``podSelector`` in
each, stopping at the first pod. Each call within :data:`PEER_CALL_S`. The answers are kept per
fleet for :data:`policy_peers.RECHECK_S` (:class:`PeerChecker`), so a fleet reconciled every
couple of seconds costs its peers' lists once per interval. A call that fails leaves the last
report in place (none: no condition this pass) and is logged; it never fails the reconcile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Final

from kubernetes_asyncio import client

from drs_operator.api.spec import PolicyPeer
from drs_operator.kube.client import as_json
from drs_operator.policy_peers import (
    MAX_NAMESPACES,
    RECHECK_S,
    PeerQuery,
    PeerReport,
    no_namespace_message,
    no_pod_message,
    peer_queries,
)

log = logging.getLogger(__name__)

#: Seconds for one list call of a peer check.
PEER_CALL_S: Final = 10.0


async def _names(call: object) -> list[str]:
    body = await as_json(call)  # type: ignore[arg-type]
    return [str(item["metadata"]["name"]) for item in body.get("items") or []]


async def empty_peer(api: client.ApiClient, namespace: str, query: PeerQuery) -> str | None:
    """The message for ``query`` when its peer selects no pod, else None."""
    core = client.CoreV1Api(api)
    if query.namespaces is None:
        spaces = [namespace]
    else:
        spaces = await _names(
            core.list_namespace(
                label_selector=query.namespaces,
                limit=MAX_NAMESPACES,
                _preload_content=False,
                _request_timeout=PEER_CALL_S,
            )
        )
        if not spaces:
            return no_namespace_message(query)
    for space in spaces:
        found = await _names(
            core.list_namespaced_pod(
                space,
                label_selector=query.pods or "",
                limit=1,
                _preload_content=False,
                _request_timeout=PEER_CALL_S,
            )
        )
        if found:
            return None
    return no_pod_message(query, spaces)


async def check_peers(api: client.ApiClient, namespace: str, peers: Sequence[PolicyPeer]) -> PeerReport:
    """Every peer with a selector checked (raises what a failed call raised)."""
    queries, problems = peer_queries(peers)
    found = await asyncio.gather(*(empty_peer(api, namespace, q) for q in queries))
    return PeerReport(checked=len(queries) + len(problems), empty=(*problems, *(m for m in found if m)))


class PeerChecker:
    """The last report per fleet, asked again once it is :data:`RECHECK_S` old."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._last: dict[tuple[str, str], tuple[float, tuple[PolicyPeer, ...], PeerReport]] = {}

    def forget(self, namespace: str, name: str) -> None:
        self._last.pop((namespace, name), None)

    async def report(
        self, api: client.ApiClient, namespace: str, name: str, peers: Sequence[PolicyPeer]
    ) -> PeerReport | None:
        """The fleet's report: the cached one while it is fresh and the peers unchanged, else a new one."""
        key, now, wanted = (namespace, name), self.clock(), tuple(peers)
        last = self._last.get(key)
        if last is not None and last[1] == wanted and now - last[0] < RECHECK_S:
            return last[2]
        try:
            report = await check_peers(api, namespace, wanted)
        except Exception as exc:  # advisory: a failed check never stops the reconcile's status write
            log.warning("%s/%s: could not check spec.networkPolicy.engineClients: %r", namespace, name, exc)
            return last[2] if last is not None and last[1] == wanted else None
        self._last[key] = (now, wanted, report)
        return report
