"""Client-side limits on the operator's requests, and retries of the answers that ask for one.

Every write of a reconcile goes through one :class:`Throttle` (``kube/apply.py``):

* **in flight**: at most ``max_in_flight`` requests at once (a semaphore);
* **rate**: a token bucket of ``burst`` tokens refilled at ``qps`` per second, kept as a
  "theoretical arrival time" (GCRA, as golang.org/x/time/rate reserves): each request reserves the
  next token and sleeps until it is due, so waiters are served in the order they asked;
* **retries**: an answer of 429 (the apiserver's priority-and-fairness rejecting, or a webhook
  overloaded) or 500/502/503/504 is retried up to ``retries`` more times. The wait is the answer's
  ``Retry-After`` seconds when it has one (capped at ``retry_after_cap_s``), else an exponential
  back-off from ``backoff_s`` doubling to ``backoff_cap_s`` with full jitter. A retry releases its
  in-flight slot while it waits and takes a fresh rate token, so a rejected burst slows itself
  down instead of holding slots. Every other error (4xx) is raised at once: the level-based
  reconcile decides again on its next pass. ``on_retry(code, wait, from_retry_after)`` reports
  each retry (the operator exports the waits by source and the in-flight high-water mark).

Retrying is safe for every verb the operator sends: a create that did land answers 409
(AlreadyExists, success for the caller), a delete that did land answers 404 (success), and a
replace carries the resourceVersion it was computed from, so a second one that would overwrite
a newer object answers 409 Conflict instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, TypeVar

from kubernetes_asyncio.client.exceptions import ApiException

T = TypeVar("T")

#: Status codes that ask the client to come back later.
RETRIABLE_STATUS: Final = frozenset({429, 500, 502, 503, 504})


@dataclasses.dataclass(frozen=True)
class Limits:
    """Defaults suit a production apiserver: 16 mutating requests in flight is a small share of
    its default 200 (``--max-mutating-requests-inflight``), and priority-and-fairness answers 429
    with ``Retry-After`` when the operator's flow is over its share, which is retried."""

    max_in_flight: int = 16
    qps: float = 100.0  #: 0 or less: no rate limit
    burst: int = 200
    retries: int = 6
    backoff_s: float = 0.2
    backoff_cap_s: float = 10.0
    retry_after_cap_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {self.max_in_flight}")
        if self.burst < 1:
            raise ValueError(f"burst must be at least 1, got {self.burst}")
        if self.retries < 0:
            raise ValueError(f"retries must not be negative, got {self.retries}")


def retry_after_s(headers: Mapping[str, str] | None, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks for (delta-seconds or an HTTP date), or None."""
    if not headers:
        return None
    value = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class Throttle:
    """See the module docstring. ``clock`` and ``sleep`` are the event loop's unless a test
    gives its own."""

    def __init__(
        self,
        limits: Limits,
        *,
        on_retry: Callable[[int, float, bool], None] | None = None,
        on_in_flight: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.limits = limits
        self._slots = asyncio.Semaphore(limits.max_in_flight)
        self._in_flight = 0
        self._peak = 0
        self._tat = float("-inf")  # when the bucket is next full-minus-one ("theoretical arrival time")
        self._on_retry = on_retry
        self._on_in_flight = on_in_flight
        self._clock = clock
        self._sleep = sleep
        self._jitter = jitter

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def peak(self) -> int:
        """The most requests that were ever in flight at once (never above ``max_in_flight``)."""
        return self._peak

    def _reserve(self) -> float:
        """Take the next token; return how long to wait until it is due."""
        if self.limits.qps <= 0:
            return 0.0
        now = self._clock()
        interval = 1.0 / self.limits.qps
        tat = max(self._tat, now)
        self._tat = tat + interval
        wait = tat - now - (self.limits.burst - 1) * interval
        return wait if wait > 1e-6 else 0.0  # below a microsecond is float rounding, not a wait

    def retry_delay(self, exc: BaseException, attempt: int) -> float | None:
        """How long to wait before attempt ``attempt + 1`` after ``exc``; None: do not retry."""
        if not isinstance(exc, ApiException) or exc.status not in RETRIABLE_STATUS:
            return None
        if attempt >= self.limits.retries:
            return None
        asked = retry_after_s(exc.headers)
        if asked is not None:
            return min(asked, self.limits.retry_after_cap_s)
        return float(self._jitter() * min(self.limits.backoff_cap_s, self.limits.backoff_s * 2**attempt))

    async def call(self, request: Callable[[], Awaitable[T]]) -> T:
        """Run ``request()`` within the limits, retrying as the module docstring says."""
        attempt = 0
        while True:
            wait = self._reserve()
            if wait > 0:
                await self._sleep(wait)
            async with self._slots:
                self._enter(1)
                try:
                    return await request()
                except ApiException as exc:
                    delay = self.retry_delay(exc, attempt)
                    if delay is None:
                        raise
                    if self._on_retry is not None:
                        self._on_retry(int(exc.status), delay, retry_after_s(exc.headers) is not None)
                finally:
                    self._enter(-1)
            attempt += 1
            await self._sleep(delay)

    def _enter(self, step: int) -> None:
        self._in_flight += step
        self._peak = max(self._peak, self._in_flight)
        if self._on_in_flight is not None:
            self._on_in_flight(self._in_flight)
