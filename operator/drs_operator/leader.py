"""Leader election on a ``coordination.k8s.io/v1`` Lease, so two operator replicas never both act.

kopf's peering only pauses an operator when it sees a peer of *higher* priority; two replicas of
one Deployment have the same priority. So ``drs operator`` holds a Lease instead, the way
client-go's leaderelection does: acquire (create, or take over an expired lease), renew every
``RENEW_PERIOD_S``, and stop acting at once if a renewal fails for longer than the lease duration
(the process exits; the Deployment restarts it as a follower).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import socket
from typing import Any

from drs_protocol import env
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

log = logging.getLogger(__name__)

LEASE_NAME = "drs-operator-leader"
LEASE_DURATION_S = 15
RENEW_PERIOD_S = 5.0
RETRY_PERIOD_S = 2.0
API_TIMEOUT_S = 10.0


def identity() -> str:
    """``<pod or host name>_<pid>``: unique per operator process."""
    return f"{os.environ.get(env.POD_NAME) or socket.gethostname()}_{os.getpid()}"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _expired(spec: Any, now: datetime.datetime) -> bool:
    renew = spec.renew_time or spec.acquire_time
    if renew is None:
        return True
    return bool(renew + datetime.timedelta(seconds=spec.lease_duration_seconds or LEASE_DURATION_S) < now)


class LeaderElector:
    def __init__(self, api: client.ApiClient, namespace: str, name: str = LEASE_NAME, me: str | None = None) -> None:
        self.api = client.CoordinationV1Api(api)
        self.namespace = namespace
        self.name = name
        self.me = me or identity()
        self.last_renewed: datetime.datetime | None = None

    async def try_acquire_or_renew(self) -> bool:
        now = _now()
        try:
            lease = await self.api.read_namespaced_lease(self.name, self.namespace, _request_timeout=API_TIMEOUT_S)
        except ApiException as exc:
            if exc.status != 404:
                raise
            body = client.V1Lease(
                metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                spec=client.V1LeaseSpec(
                    holder_identity=self.me,
                    lease_duration_seconds=LEASE_DURATION_S,
                    acquire_time=now,
                    renew_time=now,
                    lease_transitions=0,
                ),
            )
            try:
                await self.api.create_namespaced_lease(self.namespace, body, _request_timeout=API_TIMEOUT_S)
            except ApiException as create_exc:
                if create_exc.status == 409:  # somebody else created it first
                    return False
                raise
            self.last_renewed = now
            return True
        spec = lease.spec
        if spec.holder_identity != self.me and not _expired(spec, now):
            return False
        if spec.holder_identity != self.me:
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
            spec.acquire_time = now
            log.info("taking over lease %s/%s from %s", self.namespace, self.name, spec.holder_identity)
        spec.holder_identity = self.me
        spec.renew_time = now
        spec.lease_duration_seconds = LEASE_DURATION_S
        try:  # replace carries resourceVersion: a concurrent writer makes this fail with 409
            await self.api.replace_namespaced_lease(self.name, self.namespace, lease, _request_timeout=API_TIMEOUT_S)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        self.last_renewed = now
        return True

    async def acquire(self) -> None:
        """Block until this process holds the lease."""
        announced = False
        while True:
            try:
                if await self.try_acquire_or_renew():
                    log.info("became leader (%s) on lease %s/%s", self.me, self.namespace, self.name)
                    return
            except (TimeoutError, ApiException, OSError) as exc:
                log.warning("leader election: %s", exc)
            if not announced:
                log.info("waiting to become leader on lease %s/%s", self.namespace, self.name)
                announced = True
            await asyncio.sleep(RETRY_PERIOD_S)

    async def hold(self, lost: asyncio.Event) -> None:
        """Renew every RENEW_PERIOD_S. Set ``lost`` when another process holds the lease, or when
        renewals have failed for so long that the lease may have expired."""
        while True:
            await asyncio.sleep(RENEW_PERIOD_S)
            try:
                if await self.try_acquire_or_renew():
                    continue
                log.error("lease %s/%s is held by another operator: stopping", self.namespace, self.name)
                lost.set()
                return
            except (TimeoutError, ApiException, OSError) as exc:
                log.warning("lease renewal failed: %s", exc)
            last = self.last_renewed or _now()
            if (_now() - last).total_seconds() >= LEASE_DURATION_S - RENEW_PERIOD_S:
                log.error("could not renew lease %s/%s in time: stopping", self.namespace, self.name)
                lost.set()
                return

    async def release(self) -> None:
        """Give the lease up on a clean shutdown so a follower takes over at once."""
        try:
            lease = await self.api.read_namespaced_lease(self.name, self.namespace, _request_timeout=API_TIMEOUT_S)
            if lease.spec.holder_identity == self.me:
                lease.spec.renew_time = _now() - datetime.timedelta(seconds=LEASE_DURATION_S + 1)
                lease.spec.holder_identity = ""
                await self.api.replace_namespaced_lease(
                    self.name, self.namespace, lease, _request_timeout=API_TIMEOUT_S
                )
        except (TimeoutError, ApiException, OSError) as exc:
            log.warning("could not release the lease: %s", exc)
