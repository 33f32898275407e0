"""Later turns of GRPO siblings find their engine after both frontend processes of a replica are
killed and started again: real ``drs frontend`` processes (F = 2) over real sim engines.

Nothing survives the kill: each process's pins, groups and prefix index are gone, so every later
turn is placed again from its request alone (its opening), and the engines' own cache counters
say whether it landed where its prompt is.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from drs_engine.server.runner import RunningEngine, start_engine

from .conftest import sim_config
from .test_frontend_cli import free_port, poll

DRS = str(Path(sys.executable).parent / "drs")
GROUPS = 2
SIBLINGS = 6
BLOCK = 32
ENGINE = {"sim": {"speed": 1.0, "prefillSecondsPerToken": 2e-4, "decodeSecondsPerToken": 0.002}}
SYSTEM = "You are a careful agent. Solve the task step by step. " * 12


def start(prefill: list[str], decode: list[str], port: int, node: int) -> subprocess.Popen[bytes]:
    config = {"prefill": prefill, "decode": decode, "host": "127.0.0.1", "port": port, "nodeId": node}
    config |= {"healthInterval": 0.2, "tokenize": False}
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([DRS, "frontend", "--config-json", json.dumps(config)], env=env, stderr=subprocess.DEVNULL)


@contextlib.asynccontextmanager
async def engines(role: str, count: int) -> AsyncIterator[list[RunningEngine]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(start_engine(sim_config(role, **ENGINE))) for _ in range(count)]


async def ready(client: httpx.AsyncClient, port: int) -> None:
    await poll(client, f"http://127.0.0.1:{port}/ready", want=200)


def url_of(session: str, urls: list[str]) -> str:
    return urls[int.from_bytes(hashlib.sha256(session.encode()).digest()[:8], "big") % len(urls)]


async def turn(
    client: httpx.AsyncClient, urls: list[str], session: str, messages: list[dict[str, Any]]
) -> httpx.Response:
    body = {"model": "m", "messages": messages, "max_tokens": 4, "conversation_params": {"conversation_id": session}}
    resp = await client.post(url_of(session, urls) + "/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp


async def test_later_turns_land_where_their_group_is_after_every_frontend_process_is_killed() -> None:
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    async with engines("prefill", 4) as prefill, engines("decode", 1) as decode:
        p, d = [e.url for e in prefill], [e.url for e in decode]
        procs = [start(p, d, port, node) for node, port in enumerate(ports)]
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
                for port in ports:
                    await ready(client, port)
                conversations: dict[str, list[dict[str, Any]]] = {}
                engine_of: dict[str, str] = {}
                for g in range(GROUPS):  # one step's groups, one burst each
                    opening = [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"Task {g}: " + " ".join(f"w{g}-{i}" for i in range(150))},
                    ]
                    names = [f"g{g}-s{i}" for i in range(SIBLINGS)]
                    answers = await asyncio.gather(*(turn(client, urls, n, opening) for n in names))
                    assert len({a.headers["x-drs-prefill"] for a in answers}) == 1  # over both frontends
                    for name, answer in zip(names, answers, strict=True):
                        content = answer.json()["choices"][0]["message"]["content"]
                        conversations[name] = [*opening, {"role": "assistant", "content": content}]
                        engine_of[name] = answer.headers["x-drs-prefill"]
                prompt = answers[0].json()["usage"]["prompt_tokens"]

                for proc in procs:  # a crash: nothing is written anywhere
                    proc.send_signal(signal.SIGKILL)
                    proc.wait(timeout=30)
                procs = [start(p, d, port, node) for node, port in enumerate(ports)]
                for port in ports:
                    await ready(client, port)

                later = {
                    name: turn(client, urls, name, [*messages, {"role": "user", "content": "Observation: 42."}])
                    for name, messages in conversations.items()
                }
                for name, answer in zip(later, await asyncio.gather(*later.values()), strict=True):
                    assert answer.headers["x-drs-prefill"] == engine_of[name], name
                    cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                    assert cached >= (prompt // BLOCK) * BLOCK, name
        finally:
            for proc in procs:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=30)
