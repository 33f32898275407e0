"""kopf wiring. Handlers are thin: watches only *enqueue* the key of the DisaggReplicaSet an
event concerns; a pool of workers reconciles keys from scratch (``reconcile.py``).

kopf watches the DisaggReplicaSets. Children, nodes and GPU pods are watched by the operator's
own caches (``kube/cache.py``: kopf's watches cannot be narrowed per handler, and its per-object
machinery is too heavy for every pod of a large cluster); their events enqueue keys the same way.
The caches start on every replica (a follower that takes over has them warm); the workers start
only after leadership and after every cache has listed once.

Why not kopf's create/update handlers: those reconcile from the diff that triggered them and
store progress in annotations (writes on every change). A keyed queue gives level-based,
deduplicated, per-object serialised reconciles with zero writes at steady state, and no finalizer
on the resource, so deleting it never waits for the operator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import kopf

from drs_operator.api.constants import GROUP, PLURAL, VERSION
from drs_operator.kube.apply import Applier
from drs_operator.kube.cache import ClusterCache
from drs_operator.kube.client import REQUEST_TIMEOUT_S, make_api_client
from drs_operator.kube.engines import EngineClient
from drs_operator.kube.throttle import Throttle
from drs_operator.leader import LeaderElector
from drs_operator.reconcile import Context, reconcile
from drs_operator.workqueue import WorkQueue, run_workers

log = logging.getLogger(__name__)
WATCH_SERVER_TIMEOUT_S = 300


def _key(namespace: str | None, name: str) -> str:
    return f"{namespace}/{name}"


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Configure kopf; start winning the leader Lease, after which the workers run (``_lead``)."""
    opts = memo.options
    settings.peering.standalone = True  # leadership comes from our Lease (leader.py)
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = opts.watch_timeout_s
    settings.watching.client_timeout = opts.watch_timeout_s + 30
    settings.networking.request_timeout = REQUEST_TIMEOUT_S
    settings.execution.max_workers = 4
    memo.api = await make_api_client()
    memo.queue = queue = WorkQueue()  # watches enqueue from now on; nothing is reconciled before leadership
    memo.cache = ClusterCache(
        memo.api,
        opts.namespaces,
        on_owner=lambda namespace, name: queue.touch(_key(namespace, name)),
        on_nodes=queue.touch_all,
        count_event=lambda cache: memo.metrics.watch_events.labels(cache=cache).inc(),
        watch_timeout_s=opts.watch_timeout_s,
    )
    memo.cache_task = asyncio.create_task(memo.cache.run())
    memo.stop = asyncio.Event()
    memo.lost = asyncio.Event()
    memo.elector = LeaderElector(memo.api, opts.lease_namespace) if opts.leader_election else None
    memo.metrics.is_leader.set(0)
    # Not awaited here: kopf serves /healthz only once startup handlers return, and a follower
    # waiting for the Lease must answer its liveness probe.
    memo.lead_task = asyncio.create_task(_lead(memo))


async def _lead(memo: kopf.Memo) -> None:
    """Win the Lease (when electing), then run the workers and the periodic resync."""
    opts = memo.options
    if memo.elector is not None:
        await memo.elector.acquire()
        memo.hold_task = asyncio.create_task(memo.elector.hold(memo.lost))
        memo.lost_task = asyncio.create_task(_stop_when_lost(memo))
    await memo.cache.wait_synced()
    memo.metrics.is_leader.set(1)
    metrics = memo.metrics

    def retried(code: int, wait: float, from_retry_after: bool) -> None:
        metrics.api_retries.labels(code=str(code)).inc()
        metrics.api_retry_wait.labels(source="retry-after" if from_retry_after else "backoff").observe(wait)

    def in_flight(count: int) -> None:
        metrics.api_in_flight.set(count)
        metrics.api_in_flight_peak.set(throttle.peak)

    throttle = Throttle(
        opts.limits,
        on_retry=retried,
        on_in_flight=in_flight,
    )
    memo.engines = EngineClient()
    ctx = Context(
        api=memo.api,
        applier=Applier(memo.api, metrics, throttle, memo.cache),
        metrics=metrics,
        cache=memo.cache,
        engines=memo.engines,
        operator=opts.operator,
    )

    async def work(key: str) -> float | None:
        namespace, name = key.split("/", 1)
        return await reconcile(ctx, namespace, name)

    memo.resync_task = asyncio.create_task(_resync(memo.queue, opts.resync_s))
    await run_workers(memo.queue, opts.workers, work, memo.stop)


async def _resync(queue: WorkQueue, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        queue.touch_all()


async def _stop_when_lost(memo: kopf.Memo) -> None:
    await memo.lost.wait()
    memo.metrics.is_leader.set(0)
    memo.options.stop_flag.set()


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    """Stop the workers, give the lease up, close the client."""
    if hasattr(memo, "stop"):
        memo.stop.set()
        memo.queue.shutdown()
    for name in ("lead_task", "resync_task", "hold_task", "lost_task", "cache_task"):
        task = getattr(memo, name, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if getattr(memo, "elector", None) is not None and not memo.lost.is_set() and memo.elector.last_renewed:
        await memo.elector.release()
    if getattr(memo, "api", None) is not None:
        await memo.api.close()
    if getattr(memo, "engines", None) is not None:
        await memo.engines.close()
    # kopf waits for a threading stop flag in an executor thread: release it so the process exits.
    memo.options.stop_flag.set()


@kopf.on.event(GROUP, VERSION, PLURAL)
def on_disaggreplicaset(event: kopf.RawEvent, namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    """Any change of a DisaggReplicaSet: reconcile it (or forget it when it is gone)."""
    if event.get("type") == "DELETED":
        memo.queue.forget(_key(namespace, name))
    else:
        memo.queue.add(_key(namespace, name))
