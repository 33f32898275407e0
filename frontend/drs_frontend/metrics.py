"""Prometheus metrics of one frontend, in a registry of its own (several frontends can share a
process, as in the tests).

==============================================  =========  ============================================
name                                            type       meaning
==============================================  =========  ============================================
drs_frontend_requests_total{endpoint,status}    counter    client requests by endpoint and answer status
drs_frontend_request_seconds{endpoint}          histogram  whole turn, as the client sees it (to headers)
drs_frontend_leg_seconds{leg}                   histogram  one engine call: ``context`` / ``generation``
drs_frontend_engine_in_flight{role,engine}      gauge      calls in flight to one engine from here
drs_frontend_engine_up{role,engine}             gauge      1 if the last /health probe answered 200
drs_frontend_routes_total{role,reason}          counter    routing decisions by reason (sticky, rendezvous…)
drs_frontend_affinity_total{outcome}            counter    turns with a conversation id: hit (its engine) or miss
drs_frontend_upstream_errors_total{role,kind}   counter    failed engine calls: connect, timeout, protocol, status_4xx, status_5xx, weights_pending
drs_frontend_retries_total{role}                counter    legs retried on another engine
drs_frontend_tokenize_seconds{path}             histogram  render + tokenize of one turn (full, incremental, shared…)
drs_frontend_tokenize_new_tokens_total{path}    counter    ids tokenized afresh (the rest came from the cache)
drs_frontend_tokenize_shadow_total{result}      counter    shadow comparisons: match / mismatch
drs_frontend_tokenize_errors_total              counter    turns left to the engine because tokenizing failed
drs_frontend_ids_left_to_engine_total           counter    turns left to the engine because our ids would pass its body
                                                           limit (a prompt longer than it serves: its own 400 answers)
drs_frontend_token_prefix_total{outcome}        counter    token prefixes spliced: spliced / divergent (see token_prefix)
drs_frontend_token_prefix_read_total{how}       counter    how a prefix was read: after_last_turn (only the text after last
                                                           turn's), whole_text, parsed (a body parsed in full)
drs_frontend_client_disconnects_total           counter    turns cancelled because the client went away
drs_frontend_prefill_tokens_total{engine,kind}  counter    prompt tokens of context legs answered by a prefill engine:
                                                           computed there, or reused from its prefix cache
drs_frontend_group_siblings_total{placed}       counter    new conversations placed by their opening: first (placed its
                                                           group on its first engine), moved (placed it further along
                                                           by the load bound), found (where a lookup found it held),
                                                           with_group (its engine), apart (the pool changed since);
                                                           co-location ratio = with_group / (with_group + apart)
drs_frontend_group_lookups_total{outcome}       counter    prefix-held lookups on a routing miss: found (an engine
                                                           holds a prefix), none (nothing held), unanswered
drs_frontend_group_claims_total{outcome}        counter    new groups' placements counted on their engine at once:
                                                           claimed, refused (over the bound there by now: the walk
                                                           goes on), unanswered (the placement stands unclaimed),
                                                           taken_back (sent with the lookup, it did not stand)
drs_frontend_group_placement_seconds            histogram  a routing miss's lookup and claims before its context leg
drs_frontend_group_round_trip_seconds{phase}    histogram  one round trip of it: lookup (the engines asked at once),
                                                           claim, reask (every engine's live work after a refusal),
                                                           lookup_claim (the lookup with the claim: one round trip)
drs_frontend_group_holds_total{outcome}         counter    first turns held for their group's first context leg:
                                                           released (it ended), timed_out (groupHoldSeconds)
drs_frontend_group_hold_seconds                 histogram  how long one such first turn was held
drs_frontend_group_completion_seconds           histogram  a group's burst of first turns here: first dispatch to the
                                                           last answer (bursts of two or more)
==============================================  =========  ============================================

The request path reaches labelled series through :class:`Children` (``metrics.requests_of(endpoint,
status)``), which looks each label tuple up in prometheus_client once: its ``.labels()`` validates
and takes a lock on every call, several per turn.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE_LATEST", "FrontendMetrics"]

#: Seconds: from sub-millisecond relay overhead to long generations.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
TOKENIZE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


M = TypeVar("M", bound=MetricWrapperBase)


class Children(Generic[M]):
    """``children(*values)`` is ``metric.labels(*values)``, looked up once per label tuple (label
    values here come from small sets: endpoints, statuses, roles, reasons, legs, paths)."""

    __slots__ = ("_cache", "_metric")

    def __init__(self, metric: M) -> None:
        self._metric = metric
        self._cache: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._cache.get(values)
        if child is None:
            child = self._cache[values] = self._metric.labels(*values)
        return child


class FrontendMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("drs_frontend_requests", "Client requests.", ["endpoint", "status"], registry=r)
        self.request_seconds = Histogram(
            "drs_frontend_request_seconds", "Whole turn.", ["endpoint"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.leg_seconds = Histogram(
            "drs_frontend_leg_seconds", "One engine call.", ["leg"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.engine_up = Gauge("drs_frontend_engine_up", "Last /health probe answered.", ["role", "engine"], registry=r)
        self.routes = Counter("drs_frontend_routes", "Routing decisions.", ["role", "reason"], registry=r)
        self.affinity = Counter("drs_frontend_affinity", "Turns with a conversation id.", ["outcome"], registry=r)
        self.upstream_errors = Counter(
            "drs_frontend_upstream_errors", "Failed engine calls.", ["role", "kind"], registry=r
        )
        self.retries = Counter("drs_frontend_retries", "Legs retried on another engine.", ["role"], registry=r)
        self.tokenize_seconds = Histogram(
            "drs_frontend_tokenize_seconds", "Render + tokenize.", ["path"], buckets=TOKENIZE_BUCKETS, registry=r
        )
        self.tokenize_new_tokens = Counter(
            "drs_frontend_tokenize_new_tokens", "Ids tokenized afresh.", ["path"], registry=r
        )
        self.tokenize_shadow = Counter("drs_frontend_tokenize_shadow", "Shadow comparisons.", ["result"], registry=r)
        self.tokenize_errors = Counter("drs_frontend_tokenize_errors", "Tokenization failures.", registry=r)
        self.ids_left_to_engine = Counter(
            "drs_frontend_ids_left_to_engine", "Turns left to the engine: our ids would pass its limit.", registry=r
        )
        self.token_prefix = Counter("drs_frontend_token_prefix", "Token prefixes spliced.", ["outcome"], registry=r)
        self.token_prefix_read = Counter(
            "drs_frontend_token_prefix_read", "How token prefixes were read.", ["how"], registry=r
        )
        self.prefill_tokens = Counter(
            "drs_frontend_prefill_tokens", "Prompt tokens of context legs.", ["engine", "kind"], registry=r
        )
        self.group_siblings = Counter(
            "drs_frontend_group_siblings", "New conversations placed by opening.", ["placed"], registry=r
        )
        self.group_lookups = Counter(
            "drs_frontend_group_lookups", "Prefix-held lookups on a routing miss.", ["outcome"], registry=r
        )
        self.group_claims = Counter(
            "drs_frontend_group_claims", "New groups' placements claimed on their engine.", ["outcome"], registry=r
        )
        self.group_placement_seconds = Histogram(
            "drs_frontend_group_placement_seconds", "Lookup and claims.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.group_round_trip_seconds = Histogram(
            "drs_frontend_group_round_trip_seconds",
            "One round trip of a placement.",
            ["phase"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.group_holds = Counter("drs_frontend_group_holds", "First turns held.", ["outcome"], registry=r)
        self.group_hold_seconds = Histogram(
            "drs_frontend_group_hold_seconds", "Hold of one first turn.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.group_completion_seconds = Histogram(
            "drs_frontend_group_completion_seconds", "A group's burst.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.disconnects = Counter("drs_frontend_client_disconnects", "Turns cancelled by the client.", registry=r)
        # the same series, looked up once per label tuple, for the request path
        self.requests_of = Children(self.requests)  # (endpoint, status)
        self.request_seconds_of = Children(self.request_seconds)  # (endpoint,)
        self.leg_seconds_of = Children(self.leg_seconds)  # (leg,)
        self.routes_of = Children(self.routes)  # (role, reason)
        self.affinity_of = Children(self.affinity)  # (outcome,)
        self.retries_of = Children(self.retries)  # (role,)
        self.tokenize_seconds_of = Children(self.tokenize_seconds)  # (path,)
        self.tokenize_new_tokens_of = Children(self.tokenize_new_tokens)  # (path,)
        self.token_prefix_of = Children(self.token_prefix)  # (outcome,)
        self.token_prefix_read_of = Children(self.token_prefix_read)  # (how,)
        self.prefill_tokens_of = Children(self.prefill_tokens)  # (engine, kind)
        self.group_siblings_of = Children(self.group_siblings)  # (placed,)
        self.group_holds_of = Children(self.group_holds)  # (outcome,)
        self.group_lookups_of = Children(self.group_lookups)  # (outcome,)
        self.group_claims_of = Children(self.group_claims)  # (outcome,)

    def watch_in_flight(self, read: Callable[[], Iterable[tuple[str, str, int]]]) -> None:
        """Export ``drs_frontend_engine_in_flight`` from ``read()`` -> (role, engine, count) at
        scrape time, so the hot path only bumps a plain integer."""
        self.registry.register(_InFlight(read))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _InFlight(Collector):
    def __init__(self, read: Callable[[], Iterable[tuple[str, str, int]]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "drs_frontend_engine_in_flight", "Calls in flight to one engine.", labels=["role", "engine"]
        )
        for role, engine, count in self._read():
            family.add_metric([role, engine], count)
        yield family

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "drs_frontend_engine_in_flight", "Calls in flight to one engine.", labels=["role", "engine"]
        )
