"""Prometheus metrics of one engine server, in a registry of its own (several servers can share a
process, as in the tests).

=================================================  =======  ==========================================
name                                               type     meaning
=================================================  =======  ==========================================
drs_engine_info{backend,role,kind}                 gauge    1; ``kind`` is "test double" for sim
drs_engine_requests_total{leg,status}              counter  serving requests by leg and outcome (ok, error, disconnected)
drs_engine_requests_in_flight                      gauge    admitted requests running now
drs_engine_queue_depth                             gauge    requests waiting for a batch slot
drs_engine_prompt_tokens_total{leg}                counter  prompt tokens of finished legs
drs_engine_generation_tokens_total{leg}            counter  tokens generated
drs_engine_prefix_cache_query_tokens_total         counter  prompt tokens looked up in the prefix cache
drs_engine_prefix_cache_hit_tokens_total           counter  of those, tokens found cached
drs_engine_weights_version{version}                gauge    loads so far (0 = initial); one series, the current version
drs_engine_kv_exports_total{status}                counter  context states handed to decode engines
drs_engine_asleep                                  gauge    1 while memory is released (requests get 503)
drs_engine_control_ops_total{op,status}            counter  control API calls
drs_engine_token_prefix_total{outcome}             counter  token prefixes spliced into rendered prompts: spliced / divergent
=================================================  =======  ==========================================
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "CONTROL_ERROR", "CONTROL_OK", "EngineMetrics"]

#: ``drs_engine_control_ops_total``'s ``status`` label values.
CONTROL_OK: Final = "ok"
CONTROL_ERROR: Final = "error"


class EngineMetrics:
    def __init__(self, *, backend: str, role: str, test_double: bool) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        info = Gauge(
            "drs_engine_info", "This engine: backend, role, and kind.", ["backend", "role", "kind"], registry=r
        )
        info.labels(backend=backend, role=role, kind="test double" if test_double else "gpu engine").set(1)
        self.requests = Counter(
            "drs_engine_requests", "Serving requests by leg and outcome.", ["leg", "status"], registry=r
        )
        self.in_flight = Gauge("drs_engine_requests_in_flight", "Admitted requests running now.", registry=r)
        self.queue_depth = Gauge("drs_engine_queue_depth", "Requests waiting for a batch slot.", registry=r)
        self.prompt_tokens = Counter("drs_engine_prompt_tokens", "Prompt tokens of finished legs.", ["leg"], registry=r)
        self.generation_tokens = Counter("drs_engine_generation_tokens", "Tokens generated.", ["leg"], registry=r)
        self.prefix_query_tokens = Counter(
            "drs_engine_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache.", registry=r
        )
        self.prefix_hit_tokens = Counter(
            "drs_engine_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.", registry=r
        )
        self._weights = Gauge(
            "drs_engine_weights_version",
            "Weights loads so far (0 = initial); label: the version served.",
            ["version"],
            registry=r,
        )
        self._weights_loads = 0
        self._weights_label: str | None = None
        #: the gauge's child of ``_weights_label``, bound when the label changes
        self._weights_child: Gauge | None = None
        self.kv_exports = Counter(
            "drs_engine_kv_exports", "Context states handed to decode engines.", ["status"], registry=r
        )
        self.asleep = Gauge("drs_engine_asleep", "1 while memory is released.", registry=r)
        self.control_ops = Counter("drs_engine_control_ops", "Control API calls.", ["op", "status"], registry=r)
        #: ``control_ops``'s children by (op, status), each bound on its first call (:meth:`count_control_op`)
        self._control_ops: dict[tuple[str, str], Counter] = {}
        self.token_prefix = Counter("drs_engine_token_prefix", "Token prefixes spliced.", ["outcome"], registry=r)
        self.late_target_legs = Counter(
            "drs_engine_late_target_legs",
            "Legs of turns started at or after an announced target's cut-over answered at other weights "
            "(the announce reached this engine after its cut-over).",
            registry=r,
        )

    def set_weights_version(self, version: str, *, loaded: bool) -> None:
        """Point the weights gauge at ``version`` (``loaded``: a load happened, bump the count)."""
        if loaded:
            self._weights_loads += 1
        child = self._weights_child
        if child is None or self._weights_label != version:
            if self._weights_label is not None and self._weights_label != version:
                self._weights.remove(self._weights_label)
            self._weights_label = version
            child = self._weights_child = self._weights.labels(version=version)
        child.set(self._weights_loads)

    def count_control_op(self, op: str, status: str) -> None:
        """One control call of ``op`` answered with ``status`` (``ok``/``error``). The labelled
        child is looked up once per pair: ``labels()`` per call validated and hashed the label
        values every time, and 256 engines in one process count a refit's calls together."""
        child = self._control_ops.get((op, status))
        if child is None:
            child = self._control_ops[op, status] = self.control_ops.labels(op=op, status=status)
        child.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
