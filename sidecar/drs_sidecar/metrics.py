"""Prometheus metrics of the sidecar (``GET /metrics``).

========================================  =========  ==============================================
drs_sidecar_refits_total{result}          counter    refits: complete (every engine) / incomplete
drs_sidecar_refit_seconds                 histogram  one refit, request to last engine's answer
drs_sidecar_engine_calls_total{op,result} counter    control calls to engines: ok / failed
drs_sidecar_engines_behind                gauge      engines not (known to be) at the desired weights
========================================  =========  ==============================================
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REFIT_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class SidecarMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.refits = Counter("drs_sidecar_refits", "Refits by result.", ["result"], registry=r)
        self.refit_seconds = Histogram("drs_sidecar_refit_seconds", "One refit.", buckets=REFIT_BUCKETS, registry=r)
        self.engine_calls = Counter(
            "drs_sidecar_engine_calls", "Control calls to engines.", ["op", "result"], registry=r
        )
        self.engines_behind = Gauge("drs_sidecar_engines_behind", "Engines not at the desired weights.", registry=r)
        #: ``engine_calls``'s children by (op, ok), each bound on its first call (:meth:`count_engine_call`)
        self._engine_calls: dict[tuple[str, bool], Counter] = {}

    def count_engine_call(self, op: str, ok: bool) -> None:
        """One control call of ``op`` to an engine, answered (``ok``) or failed. The labelled
        child is looked up once per pair: a refit counts two calls per engine, 512 at 256 engines,
        and ``labels()`` validated and hashed the label values every time."""
        child = self._engine_calls.get((op, ok))
        if child is None:
            child = self._engine_calls[op, ok] = self.engine_calls.labels(op=op, result="ok" if ok else "failed")
        child.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
