"""The operator's Prometheus metrics, on a registry of its own (served by ``drs operator``)."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclasses.dataclass(frozen=True)
class OperatorMetrics:
    registry: CollectorRegistry
    reconciles: Counter
    reconcile_errors: Counter
    reconcile_seconds: Histogram
    api_writes: Counter
    api_retries: Counter
    api_in_flight: Gauge
    api_in_flight_peak: Gauge
    api_retry_wait: Histogram
    watch_events: Counter
    replicas_desired: Gauge
    replicas_ready: Gauge
    placement_failures: Counter
    is_leader: Gauge
    engine_observations: Counter

    @classmethod
    def create(cls) -> OperatorMetrics:
        r = CollectorRegistry()
        labels = ("namespace", "name")
        return cls(
            registry=r,
            reconciles=Counter("drs_operator_reconciles", "Reconciles run", ["result"], registry=r),
            reconcile_errors=Counter("drs_operator_reconcile_errors", "Reconciles that failed", ["kind"], registry=r),
            reconcile_seconds=Histogram(
                "drs_operator_reconcile_duration_seconds",
                "Time to reconcile one DisaggReplicaSet",
                buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                registry=r,
            ),
            api_writes=Counter(
                "drs_operator_api_writes", "Write requests sent to the apiserver", ["verb", "kind"], registry=r
            ),
            api_retries=Counter(
                "drs_operator_api_retries",
                "Write requests sent again after a 429 or 5xx answer",
                ["code"],
                registry=r,
            ),
            api_in_flight=Gauge("drs_operator_api_in_flight", "Write requests in flight now", registry=r),
            api_in_flight_peak=Gauge(
                "drs_operator_api_in_flight_peak", "The most write requests ever in flight at once", registry=r
            ),
            api_retry_wait=Histogram(
                "drs_operator_api_retry_wait_seconds",
                "Waits before a retry, by what set them (the answer's Retry-After, or back-off)",
                ["source"],
                buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
                registry=r,
            ),
            watch_events=Counter(
                "drs_operator_watch_events", "Watch events received by the caches", ["cache"], registry=r
            ),
            replicas_desired=Gauge("drs_operator_replicas_desired", "Replicas asked for", labels, registry=r),
            replicas_ready=Gauge("drs_operator_replicas_ready", "Replicas ready", labels, registry=r),
            placement_failures=Counter(
                "drs_operator_placement_failures", "Reconciles that could not place every replica", labels, registry=r
            ),
            is_leader=Gauge("drs_operator_leader", "1 while this process holds the leader lease", registry=r),
            engine_observations=Counter(
                "drs_operator_engine_observations",
                "Engines asked what weights they hold, by result (answered, unknown)",
                ["result"],
                registry=r,
            ),
        )
