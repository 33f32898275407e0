"""The operator's write throttle (kube/throttle.py): in-flight bound, token-bucket rate, retries."""

from __future__ import annotations

import asyncio
import email.utils

import pytest
from drs_operator.kube.throttle import Limits, Throttle, retry_after_s
from kubernetes_asyncio.client.exceptions import ApiException


class FakeTime:
    """A clock that moves only when the throttle sleeps, recording every sleep."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def answer(status: int, retry_after: str | None = None) -> ApiException:
    exc = ApiException(status=status, reason="test")
    exc.headers = {"Retry-After": retry_after} if retry_after is not None else {}  # type: ignore[assignment]  # a dict is what the client reads
    return exc


def failing(*errors: ApiException) -> tuple[list[int], object]:
    """A request that raises ``errors`` in turn, then answers "ok"; and its call counter."""
    calls: list[int] = []

    async def request() -> str:
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return "ok"

    return calls, request


async def test_never_more_requests_in_flight_than_the_limit() -> None:
    throttle = Throttle(Limits(max_in_flight=3, qps=0))
    now, peak = 0, 0

    async def request() -> None:
        nonlocal now, peak
        now += 1
        peak = max(peak, now)
        await asyncio.sleep(0.005)
        now -= 1

    await asyncio.gather(*(throttle.call(request) for _ in range(40)))
    assert peak == 3
    assert throttle.in_flight == 0
    assert throttle.peak == 3  # the high-water mark the operator exports


async def test_the_rate_lets_a_burst_through_then_spaces_requests_at_one_over_qps() -> None:
    t = FakeTime()
    throttle = Throttle(Limits(qps=10, burst=5), clock=t.clock, sleep=t.sleep)

    async def request() -> None:
        return None

    start = t.now
    for _ in range(15):
        await throttle.call(request)
    assert t.sleeps == pytest.approx([0.1] * 10)
    assert t.now - start == pytest.approx(1.0)  # 15 requests = 5 burst + 10 at 10/s


async def test_concurrent_waiters_are_spaced_in_the_order_they_asked() -> None:
    t = FakeTime()
    throttle = Throttle(Limits(qps=4, burst=1), clock=t.clock, sleep=t.sleep)
    waits = [throttle._reserve() for _ in range(4)]  # what four concurrent callers reserve
    assert waits == pytest.approx([0.0, 0.25, 0.5, 0.75])


async def test_429_is_retried_after_the_seconds_retry_after_asks() -> None:
    t = FakeTime()
    retried: list[tuple[int, float, bool]] = []
    throttle = Throttle(Limits(qps=0), clock=t.clock, sleep=t.sleep, on_retry=lambda *args: retried.append(args))
    calls, request = failing(answer(429, "2"), answer(429, "3"), answer(503))
    assert await throttle.call(request) == "ok"  # type: ignore[arg-type]
    assert len(calls) == 4
    assert t.sleeps[:2] == [2.0, 3.0]
    assert retried[:2] == [(429, 2.0, True), (429, 3.0, True)]
    assert retried[2][0] == 503 and retried[2][2] is False  # no Retry-After: back-off


async def test_5xx_without_retry_after_backs_off_exponentially() -> None:
    t = FakeTime()
    limits = Limits(qps=0, backoff_s=0.2, backoff_cap_s=0.5)
    throttle = Throttle(limits, clock=t.clock, sleep=t.sleep, jitter=lambda: 1.0)
    calls, request = failing(answer(503), answer(500), answer(504), answer(502))
    assert await throttle.call(request) == "ok"  # type: ignore[arg-type]
    assert len(calls) == 5
    assert t.sleeps == pytest.approx([0.2, 0.4, 0.5, 0.5])


@pytest.mark.parametrize("status", [400, 403, 404, 409, 422])
async def test_other_errors_are_raised_at_once(status: int) -> None:
    t = FakeTime()
    throttle = Throttle(Limits(qps=0), clock=t.clock, sleep=t.sleep)
    calls, request = failing(answer(status, "1"))
    with pytest.raises(ApiException) as caught:
        await throttle.call(request)  # type: ignore[arg-type]
    assert caught.value.status == status
    assert len(calls) == 1 and t.sleeps == []


async def test_retries_end_after_the_limit_with_the_last_answer() -> None:
    t = FakeTime()
    throttle = Throttle(Limits(qps=0, retries=2), clock=t.clock, sleep=t.sleep)
    calls, request = failing(*(answer(429, "1") for _ in range(5)))
    with pytest.raises(ApiException) as caught:
        await throttle.call(request)  # type: ignore[arg-type]
    assert caught.value.status == 429
    assert len(calls) == 3 and t.sleeps == [1.0, 1.0]


async def test_a_long_retry_after_is_capped() -> None:
    t = FakeTime()
    throttle = Throttle(Limits(qps=0, retry_after_cap_s=5), clock=t.clock, sleep=t.sleep)
    _, request = failing(answer(429, "3600"))
    await throttle.call(request)  # type: ignore[arg-type]
    assert t.sleeps == [5.0]


async def test_a_request_waiting_to_retry_gives_its_slot_to_others() -> None:
    throttle = Throttle(Limits(max_in_flight=1, qps=0))
    order: list[str] = []
    first = asyncio.Event()

    async def rejected_once() -> None:
        order.append("a")
        if order.count("a") == 1:
            first.set()
            raise answer(429, "0")
        order.append("a done")

    async def other() -> None:
        await first.wait()
        order.append("b")

    await asyncio.gather(throttle.call(rejected_once), throttle.call(other))
    assert order.index("b") < order.index("a done")


def test_retry_after_reads_seconds_and_http_dates() -> None:
    assert retry_after_s({"Retry-After": "7"}) == 7.0
    assert retry_after_s({"retry-after": "0"}) == 0.0
    when = email.utils.formatdate(1_000_030.0, usegmt=True)
    assert retry_after_s({"Retry-After": when}, now=1_000_000.0) == pytest.approx(30.0)
    assert retry_after_s({"Retry-After": "soon"}) is None
    assert retry_after_s({}) is None and retry_after_s(None) is None


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [("max_in_flight", 0, "max_in_flight must be at least 1"), ("burst", 0, "burst must be at least 1")],
)
def test_limits_refuse_values_that_would_stop_every_request(field: str, value: int, rule: str) -> None:
    with pytest.raises(ValueError, match=rule):
        Limits(**{field: value})
