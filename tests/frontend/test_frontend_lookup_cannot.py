"""An engine whose backend cannot say what it holds (501, as ``trtllm`` answers the prefix-held route)
is not asked again for a while: with the lookup on by default, a fleet of such engines pays one round
trip per engine, not one per new conversation.

The engines are a double of the prefix-held route (``Answering``: a status per engine, the requests
counted); the lookup is the frontend's own (``PrefixLookup.ask``), its clock advanced by hand."""

from __future__ import annotations

import time
from typing import Any, cast

import pytest
from drs_frontend.lookup import PrefixLookup
from drs_frontend.metrics import FrontendMetrics
from drs_frontend.routing import RouteRequest
from drs_frontend.routing.groups import opening_of
from drs_frontend.upstream import UpstreamClient
from drs_frontend.upstream.base import UpstreamResponse
from drs_protocol import routes
from drs_protocol.prefix_lookup import CANNOT_ANSWER_S, PrefixHeld

from .groups import BLOCK, group


class Answering:
    """A double of the engines' prefix-held route: each engine answers its ``status`` (200: nothing held)."""

    def __init__(self, status: dict[str, int]) -> None:
        self.status = status
        self.asked: list[str] = []

    async def post_json(self, url: str, body: bytes, timeout: float, headers: Any = None) -> UpstreamResponse:
        engine = url.removesuffix(routes.PREFIX_HELD)
        self.asked.append(engine)
        if self.status[engine] != 200:
            return UpstreamResponse(self.status[engine], "application/json", b'{"error": {"code": "not_implemented"}}')
        answer = PrefixHeld(tokens=64, blocks=64 // BLOCK, held_blocks=0, tokens_per_block=BLOCK, recent_work=0)
        return UpstreamResponse(200, "application/json", answer.model_dump_json().encode())


def _turn(g: int) -> RouteRequest:
    messages, ids = group(g, 64)
    return RouteRequest(f"c{g}", ids, messages, opening=opening_of(messages))


async def test_an_engine_that_answered_501_is_not_asked_again_until_its_time_is_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    engines = Answering({"http://sim": 200, "http://trt": 501, "http://busy": 503})
    lookup = PrefixLookup(cast(UpstreamClient, engines), FrontendMetrics(), timeout=1.0)
    urls = list(engines.status)

    first = await lookup.ask(urls, _turn(1))
    assert set(first) == {"http://sim"} and sorted(engines.asked) == sorted(urls)

    engines.asked.clear()
    second = await lookup.ask(urls, _turn(2))  # a new conversation: the 501 engine is not asked
    assert set(second) == {"http://sim"}
    assert sorted(engines.asked) == ["http://busy", "http://sim"]  # a 503 is a passing state: asked again

    engines.asked.clear()
    now[0] += CANNOT_ANSWER_S + 1  # its time is up (an upgraded engine may answer now)
    engines.status["http://trt"] = 200
    third = await lookup.ask(urls, _turn(3))
    assert set(third) == {"http://sim", "http://trt"} and sorted(engines.asked) == sorted(urls)


async def test_a_lookup_whose_engines_all_answered_501_costs_no_round_trip_and_no_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    engines = Answering({"http://trt-0": 501, "http://trt-1": 501})
    metrics = FrontendMetrics()
    lookup = PrefixLookup(cast(UpstreamClient, engines), metrics, timeout=1.0)
    urls = list(engines.status)
    assert await lookup.ask(urls, _turn(1)) == {}
    assert sorted(engines.asked) == urls

    engines.asked.clear()
    built: list[bytes] = []
    body = PrefixLookup._body

    def counted(*args: Any, **kwargs: Any) -> bytes:
        built.append(body(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(PrefixLookup, "_body", staticmethod(counted))
    assert await lookup.ask(urls, _turn(2)) == {}
    assert engines.asked == [] and built == []  # none asked, no request body built (a turn's ids encoded)
    unanswered = metrics.registry.get_sample_value("drs_frontend_group_lookups_total", {"outcome": "unanswered"})
    assert unanswered == 2  # each lookup counted, asked or not
