"""Steps 4 and 6's engine choice, written once for a posted and a streamed leg.

:meth:`LegAttempts.run` picks an engine of the role (the router's decision, counted), calls the
leg's ``attempt`` on it and decides what an outcome means: an engine that is unreachable or
answers 503 (asleep, draining) cools down and the next one is tried, never one twice and at most
``maxAttempts`` engines; a 401 (this frontend's serving token refused) is a 502 naming the engine
(:class:`EngineRefusedCredential`); any other refusal passes through verbatim (:class:`EngineRejected`);
with no engine left the leg holds up to ``holdSeconds`` for one to come up (the prober's event),
then fails with :class:`NoEngineAvailable` naming the role.

A 503 ``weights_pending`` (the engine does not hold the fleet's announced target weights yet: a
refit is loading them, ``drs_engine.weights.target``) skips that engine for
``weightsPendingRetrySeconds`` only, since it will hold them within a load; once every engine of the
role has said so, the leg holds up to ``weightsPendingHoldSeconds`` (from the first such answer),
looking again every ``weightsPendingRetrySeconds``, so it runs on the first engine that holds them.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Final, TypeVar

from drs_protocol.lifecycle import WEIGHTS_PENDING_ERROR_TYPE

from drs_frontend.config import FrontendConfig
from drs_frontend.engines import EnginePool
from drs_frontend.errors import EngineRefusedCredential, EngineRejected, NoEngineAvailable, UpstreamUnavailable
from drs_frontend.metrics import FrontendMetrics
from drs_frontend.routing import Candidate, Decision, Reason
from drs_frontend.upstream import UpstreamResponse

log = logging.getLogger("drs_frontend.relay")  # the relay's log lines, as before the split

AFFINITY_OUTCOME: Final = {
    Reason.STICKY: "hit",
    Reason.REPINNED: "miss",
    Reason.RENDEZVOUS: "new",
    Reason.GROUP: "new",
    Reason.LOOKUP: "new",
}
#: A held leg looks again at least this often (cool-downs end without a probe event).
HOLD_RECHECK_S: Final = 0.5

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Refused:
    """An engine's answer other than 200 to one attempt of a leg (503: try another engine)."""

    response: UpstreamResponse


class LegAttempts:
    """The engine choice and retry rules of one frontend's legs (state: none but the pools')."""

    def __init__(self, config: FrontendConfig, metrics: FrontendMetrics) -> None:
        self.config = config
        self.metrics = metrics

    def pick(
        self,
        pool: EnginePool,
        pick: Callable[[list[Candidate]], Decision],
        exclude: frozenset[str],
        tried: list[str],
        *,
        affinity: bool = False,
    ) -> Decision | None:
        if len(tried) >= self.config.max_attempts:
            return None
        candidates = pool.candidates(exclude.union(tried))
        if not candidates:
            return None
        decision = pick(candidates)
        self.metrics.routes_of(pool.role, decision.reason.value).inc()
        if affinity and decision.reason in AFFINITY_OUTCOME:
            self.metrics.affinity_of(AFFINITY_OUTCOME[decision.reason]).inc()
        if decision.sibling is not None:
            self.metrics.group_siblings_of(decision.sibling.value).inc()
        if tried:
            self.metrics.retries_of(pool.role).inc()
        tried.append(decision.url)
        return decision

    async def pick_or_hold(
        self,
        pool: EnginePool,
        pick: Callable[[list[Candidate]], Decision],
        exclude: frozenset[str],
        tried: list[str],
        hold_until: float,
        *,
        affinity: bool = False,
        recheck_s: float = HOLD_RECHECK_S,
    ) -> Decision | None:
        """:meth:`pick`; when no engine of the role is left (own or fallback), hold the leg until a
        probe finds one answering (or an engine's cool-down ends), at most until ``hold_until``;
        then every engine may be tried again. None: nothing answered in time (the caller's 503)."""
        while (decision := self.pick(pool, pick, exclude, tried, affinity=affinity)) is None:
            left = hold_until - time.monotonic()
            if left <= 0:
                return None
            self.metrics.retries_of(f"{pool.role}_hold").inc()
            await pool.wait_for_engine(min(left, recheck_s))
            tried.clear()
        return decision

    def failed(self, pool: EnginePool, url: str, exc: UpstreamUnavailable) -> None:
        pool.mark_down(url)
        self.metrics.upstream_errors.labels(role=pool.role, kind=exc.kind).inc()
        log.warning("%s engine %s unavailable (%s); cooling down %gs", pool.role, url, exc, pool.cooldown)

    def rejected(
        self, pool: EnginePool, url: str, response: UpstreamResponse
    ) -> EngineRejected | EngineRefusedCredential:
        if response.status == HTTPStatus.UNAUTHORIZED:  # every engine of the fleet holds one token
            self.metrics.upstream_errors.labels(role=pool.role, kind=EngineRefusedCredential.kind).inc()
            log.error("%s engine %s refused this frontend's serving token (401)", pool.role, url)
            return EngineRefusedCredential(pool.role, url)
        kind = "status_4xx" if response.status < 500 else "status_5xx"
        self.metrics.upstream_errors.labels(role=pool.role, kind=kind).inc()
        return EngineRejected(pool.role, url, response.status, response.body, response.content_type)

    async def run(
        self,
        pool: EnginePool,
        pick: Callable[[list[Candidate]], Decision],
        attempt: Callable[[Decision], Awaitable[_T | Refused]],
        *,
        exclude: frozenset[str] = frozenset(),
        affinity: bool = False,
    ) -> tuple[str, _T]:
        """One leg's engine choice, written once for both kinds of call: pick (or hold for) an
        engine, ``attempt`` the call; an engine unreachable or answering 503 (asleep, draining)
        cools down and the next one is tried; any other refusal passes through
        (:class:`EngineRejected`); none left: :class:`NoEngineAvailable` naming the role."""
        tried: list[str] = []
        hold_until = time.monotonic() + self.config.hold_seconds
        recheck_s = HOLD_RECHECK_S
        pending_since: float | None = None
        while (
            decision := await self.pick_or_hold(
                pool, pick, exclude, tried, hold_until, affinity=affinity, recheck_s=recheck_s
            )
        ) is not None:
            url = decision.url
            try:
                outcome = await attempt(decision)
            except UpstreamUnavailable as exc:
                self.failed(pool, url, exc)
                continue
            if not isinstance(outcome, Refused):
                return url, outcome
            if weights_pending(outcome.response):
                if pending_since is None:  # the refit's loads will free an engine: hold for one
                    pending_since = time.monotonic()
                    hold_until = max(hold_until, pending_since + self.config.weights_pending_hold_seconds)
                recheck_s = max(self.config.weights_pending_retry_seconds, 0.001)
                pool.mark_down(url, self.config.weights_pending_retry_seconds)
                self.metrics.upstream_errors.labels(role=pool.role, kind=WEIGHTS_PENDING_ERROR_TYPE).inc()
                log.debug("%s engine %s does not hold the target weights yet; trying another", pool.role, url)
                continue
            if outcome.response.status == 503:
                self.failed(pool, url, UpstreamUnavailable(f"{url} answered 503"))
                continue
            raise self.rejected(pool, url, outcome.response)
        raise NoEngineAvailable(pool.role, tried)


def weights_pending(response: UpstreamResponse) -> bool:
    """Whether an engine's answer is the 503 ``weights_pending`` (its error body's ``type``)."""
    if response.status != 503:
        return False
    try:
        body = json.loads(response.body)
    except ValueError:
        return False
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and error.get("type") == WEIGHTS_PENDING_ERROR_TYPE
