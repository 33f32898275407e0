"""The Gym-shaped load of ``bench/chaos.py`` and what its turns are counted as (lost, off-policy,
latency): each client runs sessions of :data:`TURNS_PER_SESSION` turns over one status URL,
re-sending the growing conversation, retrying a 5xx or a lost connection as NeMo-Gym's client does.

A turn is judged by the instant the fleet received it: the stamp its answer carries
(``x-drs-turn-started``, set by the frontend that took the attempt that was answered), against the
version desired then (the last refit whose cut-over, ``effective_at``, is not after it). A turn
answered without a stamp (an older frontend) falls back to the client's wall clock when it sent the
attempt, and is counted (``unstamped``)."""

from __future__ import annotations

import asyncio
import hashlib
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from drs_protocol import fields, lifecycle, routes
from drs_protocol.cutover import BadTurnStamp, parse_stamp

TURNS_PER_SESSION = 6
ATTEMPTS = 5
BACKOFF_S = 0.5
TURN_TIMEOUT_S = 120.0


@dataclass
class Turn:
    ok: bool
    latency_s: float
    attempts: int
    status: int | None
    started: float
    version: str | None = None  #: the weights version that answered it
    boundary: bool = False  #: marked ``weights_boundary`` (re-prefilled across a refit)
    #: the fleet's stamp of the answered attempt (wall clock), None when none came back
    stamp: float | None = None
    #: the client's wall clock when it sent the answered attempt (the fallback for no stamp)
    sent_wall: float = 0.0

    @property
    def judged_at(self) -> float:
        """The instant the turn is judged at: the fleet's stamp, else the client's clock."""
        return self.sent_wall if self.stamp is None else self.stamp


@dataclass
class Load:
    """``clients`` Gym-shaped sessions in a thread of their own, until :meth:`stop`."""

    urls: list[str]
    clients: int
    max_tokens: int = 16
    turns: list[Turn] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Load:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="chaos-load", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[Turn]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(TURN_TIMEOUT_S * ATTEMPTS)
        return list(self.turns)

    async def _run(self) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=TURN_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await asyncio.gather(*(self._worker(http, w) for w in range(self.clients)))

    async def _worker(self, http: Any, worker: int) -> None:
        session = 0
        while not self._stop.is_set():
            sid = f"chaos-{worker}-{session}-{time.monotonic_ns()}"
            url = self.urls[int.from_bytes(hashlib.sha256(sid.encode()).digest()[:8], "big") % len(self.urls)]
            messages: list[dict[str, str]] = [{"role": "system", "content": "You are a careful assistant."}]
            for turn in range(TURNS_PER_SESSION):
                if self._stop.is_set():
                    return
                messages.append({"role": "user", "content": f"Turn {turn} of session {sid}: go on."})
                result, text = await self._turn(http, url, sid, messages)
                self.turns.append(result)
                if not result.ok:
                    break  # the trajectory is lost; Gym would start another
                messages.append({"role": "assistant", "content": text})
            session += 1

    async def _turn(self, http: Any, url: str, sid: str, messages: list[dict[str, str]]) -> tuple[Turn, str]:
        import aiohttp

        body = {"model": "sim-qwen3", "messages": messages, "max_tokens": self.max_tokens}
        headers = {fields.SESSION_HEADER: sid}
        started = time.monotonic()
        status: int | None = None
        for attempt in range(1, ATTEMPTS + 1):
            sent_wall = time.time()
            try:
                async with http.post(f"{url}{routes.Endpoint.CHAT}", json=body, headers=headers) as resp:
                    status = resp.status
                    version = resp.headers.get(fields.HEADER_WEIGHTS_VERSION)
                    stamp = _stamp(resp.headers.get(fields.HEADER_TURN_STARTED))
                    data = await resp.json(content_type=None)
                if status == 200:
                    text = data["choices"][0]["message"]["content"] or ""
                    boundary = data.get(lifecycle.FIELD_WEIGHTS_BOUNDARY) is not None
                    version = version or data.get(lifecycle.FIELD_WEIGHTS_VERSION)
                    turn = Turn(
                        True, time.monotonic() - started, attempt, status, started, version, boundary, stamp, sent_wall
                    )
                    return turn, text
                if status < 500:
                    break  # a 4xx is the client's fault: not retried
            except (aiohttp.ClientError, TimeoutError, ValueError):
                status = None
            await asyncio.sleep(BACKOFF_S * 2 ** (attempt - 1))
        return Turn(False, time.monotonic() - started, ATTEMPTS, status, started), ""


def _stamp(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return parse_stamp(value)
    except BadTurnStamp:
        return None


def off_policy(turns: list[Turn], desired_at: Callable[[float], str | None]) -> int:
    """Answered turns at another version than the one desired when the fleet received them (their
    stamp; boundary-marked turns excepted; no desired version: none counted)."""
    return sum(
        1
        for t in turns
        if t.ok and not t.boundary and (want := desired_at(t.judged_at)) is not None and t.version != want
    )


def off_policy_delays(turns: list[Turn], refits: list[tuple[float, str]]) -> list[float]:
    """For each off-policy turn, how long after its refit's cut-over it started (ms, sorted, by its
    stamp; ``refits``: (wall-clock instant a refit's weights became desired, its version), in
    order)."""
    delays = []
    for t in turns:
        began = next(((at, v) for at, v in reversed(refits) if at <= t.judged_at), None)
        if t.ok and not t.boundary and began is not None and t.version != began[1]:
            delays.append(round(1000 * (t.judged_at - began[0]), 1))
    return sorted(delays)


def summarize(turns: list[Turn], desired_at: Callable[[float], str | None] = lambda _: None) -> dict[str, Any]:
    latencies = sorted(t.latency_s for t in turns if t.ok)

    def pct(q: float) -> float | None:
        if not latencies:
            return None
        return round(1000 * latencies[min(len(latencies) - 1, int(q * len(latencies)))], 1)

    return {
        "turns": len(turns),
        "failed": sum(not t.ok for t in turns),
        #: the failed turns by their last attempt's status ("none": no connection or no answer)
        "failed_by_status": dict(sorted(Counter(str(t.status or "none") for t in turns if not t.ok).items())),
        "retried": sum(t.ok and t.attempts > 1 for t in turns),
        "off_policy": off_policy(turns, desired_at),
        "unstamped": sum(t.ok and t.stamp is None for t in turns),
        "boundary": sum(t.boundary for t in turns),
        "p50_ms": round(1000 * statistics.median(latencies), 1) if latencies else None,
        "p99_ms": pct(0.99),
        "max_ms": round(1000 * latencies[-1], 1) if latencies else None,
    }
