"""A Gym-shaped load client for the real-node cluster, run in a pod (mounted from a ConfigMap).

``--sessions`` concurrent conversations, each on ``status.urls[sha256(session) % len(urls)]`` (the
URLs read with in-cluster credentials), each turn re-sending the growing conversation, for
``--seconds``. A turn is retried as the official OpenAI Python SDK retries by default: at most
``--max-retries`` (2) more attempts, after ``min(0.5 * 2**n, 8) * (1 - 0.25 * random())`` seconds,
on a connection error, a timeout (connect 5 s, as the SDK's default) or an answer 408, 409, 429 or
>= 500. A turn that fails its last attempt is *lost*. The image has httpx and not ``openai``, so
the policy is spelled out here rather than imported.

Prints ``[load] started`` once the first turn is answered, and at the end one JSON line: ``turns``
(answered), ``lost``, ``retried`` (turns that needed a retry), their errors, p50/p99/max latency,
``versions`` (answered turns per weights version, ``x-drs-weights-version``) and ``boundary`` (turns
marked ``weights_boundary``). With ``--answers``, also ``answers``: per answered turn ``[stamp,
version, boundary]``, the stamp the fleet put on it when it received it (``x-drs-turn-started``,
wall-clock seconds; null without one), so off-policy turns can be judged against the desired
weights at that instant (``bench/chaos_realnodes.py``).

    python load_client.py --name pod-sim --namespace default --seconds 40 --sessions 8
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import statistics
import sys
import time
from typing import Any

import httpx
from drs_protocol import fields, lifecycle
from drs_protocol.cutover import BadTurnStamp, parse_stamp
from kubernetes import client, config

TURNS_PER_SESSION = 6
RETRY_STATUSES = frozenset({408, 409, 429})
INITIAL_RETRY_DELAY_S = 0.5
MAX_RETRY_DELAY_S = 8.0
CONNECT_TIMEOUT_S = 5.0
TURN_TIMEOUT_S = 60.0


def read_urls(name: str, namespace: str) -> list[str]:
    config.load_incluster_config()
    body = client.CustomObjectsApi().get_namespaced_custom_object(
        "disagg.dev", "v1alpha1", namespace, "disaggreplicasets", name
    )
    if not isinstance(body, dict):
        raise SystemExit(f"{namespace}/{name}: the API answered {type(body).__name__}, not an object")
    urls: list[str] = (body.get("status") or {}).get("urls") or []
    if not urls or not all(urls):
        raise SystemExit(f"{namespace}/{name}: no full status.urls yet: {urls}")
    return urls


class Stats:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.lost = 0
        self.retried = 0
        self.errors: dict[str, int] = {}
        #: per answered turn: the fleet's stamp (None without one), its weights version, boundary-marked
        self.answers: list[tuple[float | None, str | None, bool]] = []
        self.started = asyncio.Event()

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    def answer(self, headers: httpx.Headers, data: dict[str, Any]) -> None:
        """Record the weights an answered turn was served at, and when the fleet received it."""
        version = headers.get(fields.HEADER_WEIGHTS_VERSION) or data.get(lifecycle.FIELD_WEIGHTS_VERSION)
        raw = headers.get(fields.HEADER_TURN_STARTED)
        try:
            stamp = None if raw is None else parse_stamp(raw)
        except BadTurnStamp:
            stamp = None
        self.answers.append((stamp, version, data.get(lifecycle.FIELD_WEIGHTS_BOUNDARY) is not None))


def retry_delay(retry: int) -> float:
    delay: float = min(INITIAL_RETRY_DELAY_S * 2.0**retry, MAX_RETRY_DELAY_S)
    return delay * (1 - 0.25 * random.random())


async def turn(http: httpx.AsyncClient, url: str, body: dict[str, Any], stats: Stats, max_retries: int) -> str | None:
    """One turn with the SDK's retries; its reply text, or None when lost."""
    for attempt in range(max_retries + 1):
        if attempt:
            await asyncio.sleep(retry_delay(attempt - 1))
        try:
            resp = await http.post(f"{url}/v1/chat/completions", json=body)
        except httpx.HTTPError as exc:
            stats.error(type(exc).__name__)
            continue
        if resp.status_code == 200:
            if attempt:
                stats.retried += 1
            data = resp.json()
            stats.answer(resp.headers, data)
            text: str = data["choices"][0]["message"]["content"] or ""
            return text
        stats.error(f"HTTP {resp.status_code}")
        if resp.status_code not in RETRY_STATUSES and resp.status_code < 500:
            break
    stats.lost += 1
    return None


async def session(
    http: httpx.AsyncClient, urls: list[str], index: int, stop: float, stats: Stats, max_retries: int
) -> None:
    conversation = 0
    while time.monotonic() < stop:
        name = f"load-{index}-{conversation}"
        url = urls[int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % len(urls)]
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a terse assistant."}]
        for t in range(TURNS_PER_SESSION):
            if time.monotonic() >= stop:
                return
            messages.append({"role": "user", "content": f"Turn {t} of {name}: go on."})
            body = {
                "model": "sim",
                "messages": messages,
                "max_tokens": 8,
                "conversation_params": {"conversation_id": name},
            }
            began = time.monotonic()
            text = await turn(http, url, body, stats, max_retries)
            if text is None:
                break
            stats.latencies.append(time.monotonic() - began)
            stats.started.set()
            messages.append({"role": "assistant", "content": text})
        conversation += 1


async def run(urls: list[str], seconds: float, sessions: int, max_retries: int, answers: bool) -> dict[str, Any]:
    stats = Stats()
    timeout = httpx.Timeout(TURN_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    limits = httpx.Limits(max_connections=sessions * 2, max_keepalive_connections=sessions * 2)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        stop = time.monotonic() + seconds
        tasks = [asyncio.create_task(session(http, urls, i, stop, stats, max_retries)) for i in range(sessions)]
        await asyncio.wait_for(stats.started.wait(), timeout=seconds)
        print("[load] started", flush=True)
        await asyncio.gather(*tasks)
    lat = sorted(stats.latencies) or [0.0]
    versions: dict[str, int] = {}
    for _, version, _ in stats.answers:
        versions[str(version)] = versions.get(str(version), 0) + 1
    return {
        "turns": len(stats.latencies),
        "lost": stats.lost,
        "retried": stats.retried,
        "errors": stats.errors,
        "p50_ms": round(statistics.median(lat) * 1000, 1),
        "p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000, 1),
        "max_ms": round(lat[-1] * 1000, 1),
        "sessions": sessions,
        "max_retries": max_retries,
        "versions": versions,
        "boundary": sum(b for _, _, b in stats.answers),
        **({"answers": [list(a) for a in stats.answers]} if answers else {}),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--max-retries", type=int, default=2)
    parser.add_argument("--answers", action="store_true", help="print every answered turn's stamp and weights")
    args = parser.parse_args()
    urls = read_urls(args.name, args.namespace)
    result = asyncio.run(run(urls, args.seconds, args.sessions, args.max_retries, args.answers))
    print(json.dumps({"load": result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
