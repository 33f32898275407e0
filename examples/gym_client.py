"""The demo's trainer-side client, run in a pod (`make demo` mounts it from a ConfigMap).

It does what NeMo-Gym's rollout client does against the fleet: read the frontends' URLs from the
DisaggReplicaSet's status (through the trainer's library ``drs_client``, with in-cluster
credentials: the pod's ServiceAccount), pick one per
conversation with ``sha256(session) % len(urls)``, and drive multi-turn chat completions through
it (the OpenAI wire format, sent with httpx, which the image has; the official ``openai`` client
is a test dependency, not an image one). For every turn it prints which prefill and decode
engines served it and how many prompt tokens the prefill engines' prefix cache held.

An engine's URL is its pod's DNS name under the fleet's headless Service; right after a rollout a
re-created pod is ready before every resolver has its record (the EndpointSlice, CoreDNS's watch,
and CoreDNS's cache of the answer "no such name" given while the pod was away). A read whose name
does not resolve is repeated for up to ``RESOLVE_S``, the allowance the trainer's sidecar makes
(``drs_sidecar.control.RESOLVE_S``); a refused connection is not repeated: the name resolved.

`make demo-kwok` drives its local fleet with the same ``drive`` (one client loop for both demos);
the pod gets only this file, and imports httpx and ``drs_client`` (both in the project's image).

    python gym_client.py --name pod-sim --namespace default
"""

from __future__ import annotations

import argparse
import hashlib
import socket
import sys
import time
from typing import Any

import httpx
from drs_client import Fleet, FleetView

TURNS = 3
CONVERSATIONS = 4
SYSTEM_PROMPT = (
    "You are a careful assistant inside a reinforcement-learning rollout. Answer briefly, keep the "
    "conversation's earlier turns in mind, never invent tool results, and when a question is "
    "ambiguous say what you assumed. Prefer short sentences. Use plain text without markdown. "
    "If the user asks for code, give the smallest example that runs."
)
#: Seconds an engine's name is looked up again while it does not resolve, and the back-off.
RESOLVE_S = 20.0
RESOLVE_FIRST_DELAY_S = 0.1
RESOLVE_MAX_DELAY_S = 2.0


def say(msg: str) -> None:
    print(f"[client] {msg}", flush=True)


def name_unresolved(exc: httpx.ConnectError) -> bool:
    """True when the connection failed at the name lookup (nothing was sent)."""
    cause: BaseException | None = exc
    seen: set[int] = set()
    while cause is not None and id(cause) not in seen:  # a chain may loop back on itself
        if isinstance(cause, socket.gaierror):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def get_resolving(http: httpx.Client, url: str, timeout: float) -> httpx.Response:
    """``GET url``, looking its name up again for up to ``RESOLVE_S`` while it does not resolve."""
    give_up = time.monotonic() + RESOLVE_S
    delay = RESOLVE_FIRST_DELAY_S
    while True:
        try:
            return http.get(url, timeout=timeout)
        except httpx.ConnectError as exc:
            if not name_unresolved(exc) or time.monotonic() + delay > give_up:
                raise
            say(f"{url}: its name does not resolve yet ({exc}); looking it up again in {delay:.1f}s")
        time.sleep(delay)  # back-off between lookups: a resolver offers no event to wait on
        delay = min(delay * 2, RESOLVE_MAX_DELAY_S)


def prefix_cache_hits(http: httpx.Client, engine_urls: list[str]) -> tuple[float, float]:
    query = hit = 0.0
    for url in engine_urls:
        for line in get_resolving(http, f"{url}/metrics", timeout=5).text.splitlines():
            if line.startswith("drs_engine_prefix_cache_query_tokens_total"):
                query += float(line.split()[-1])
            elif line.startswith("drs_engine_prefix_cache_hit_tokens_total"):
                hit += float(line.split()[-1])
    return query, hit


def drive(view: FleetView) -> None:
    urls = list(view.urls)
    prefills = [e.url for e in view.engines if e.role == "prefill" and e.url]
    say(f"status.urls ({len(urls)} frontends, replica-major): {urls}")
    with httpx.Client(timeout=60) as http:
        for c in range(CONVERSATIONS):
            session = f"demo-session-{c}"
            url = urls[int.from_bytes(hashlib.sha256(session.encode()).digest()[:8], "big") % len(urls)]
            messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
            for turn in range(TURNS):
                messages.append({"role": "user", "content": f"Turn {turn} of conversation {c}: say something."})
                q0, h0 = prefix_cache_hits(http, prefills)
                resp = http.post(
                    f"{url}/v1/chat/completions",
                    json={
                        "model": "sim-qwen3",
                        "messages": messages,
                        "max_tokens": 12,
                        "conversation_params": {"conversation_id": session},
                    },
                )
                resp.raise_for_status()
                reply = resp.json()
                q1, h1 = prefix_cache_hits(http, prefills)
                text = reply["choices"][0]["message"]["content"] or ""
                messages.append({"role": "assistant", "content": text})
                say(
                    f"{session} turn {turn} via {url}: prefill={resp.headers.get('x-drs-prefill')} "
                    f"decode={resp.headers.get('x-drs-decode')} prompt={reply['usage']['prompt_tokens']} "
                    f"tokens, prefix-cache hits {h1 - h0:.0f}/{q1 - q0:.0f}"
                )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--namespace", required=True)
    args = parser.parse_args()
    with Fleet.connect(args.name, args.namespace) as fleet:
        view = fleet.get()
    if not view.serves():
        say(f"{args.name} is not Ready (phase {view.phase}, urls {list(view.urls)})")
        return 1
    drive(view)
    say(f"done: {CONVERSATIONS} conversations x {TURNS} turns through Service URLs from the status")
    return 0


if __name__ == "__main__":
    sys.exit(main())
