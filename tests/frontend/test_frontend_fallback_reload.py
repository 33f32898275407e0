"""A running frontend learns a changed fallback pool from its mounted config file (``configWatch``),
without a restart: real sim engines and a real frontend; the file rewritten as the kubelet would."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from drs_engine.server.runner import start_engine

from .conftest import ReplicaFactory, chat_body, sim_config, stop_engine

CHAT = "/v1/chat/completions"


def write(path: Path, config: dict[str, Any] | str) -> None:
    """Replace the file in one rename, as the kubelet swaps a ConfigMap volume's contents."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(config if isinstance(config, str) else json.dumps(config))
    os.replace(tmp, path)


async def turn_status(client: httpx.AsyncClient, url: str) -> tuple[int, str | None]:
    resp = await client.post(url + CHAT, json=chat_body())
    return resp.status_code, resp.headers.get("x-drs-prefill")


async def until(client: httpx.AsyncClient, url: str, want: int, timeout: float = 10.0) -> str | None:
    async with asyncio.timeout(timeout):
        while True:
            status, prefill = await turn_status(client, url)
            if status == want:
                return prefill
            await asyncio.sleep(0.1)


async def test_a_fallback_pool_written_into_the_watched_file_is_used_without_a_restart(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "config.json"
    async with contextlib.AsyncExitStack() as stack:
        other = await stack.enter_async_context(start_engine(sim_config("prefill")))
        replica = await stack.enter_async_context(replica_factory(frontends=0))
        rendered = {"prefill": [e.url for e in replica.prefill], "decode": [e.url for e in replica.decode]}
        write(path, rendered)
        frontend = await replica.add_frontend(config_watch=str(path), hold_seconds=0, health_interval=0.2)
        started = id(frontend.app)
        await stop_engine(replica.prefill[0])
        await until(client, frontend.url, 503)  # no other replica's engine known yet

        write(path, {**rendered, "fallbackPrefill": [other.url]})  # another replica was placed
        assert await until(client, frontend.url, 200) == other.url

        caplog.set_level(logging.WARNING, logger="drs_frontend.reload")
        write(path, "{not json")
        await asyncio.sleep(0.6)
        assert any(str(path) in r.getMessage() and "not applied" in r.getMessage() for r in caplog.records)
        assert (await turn_status(client, frontend.url)) == (200, other.url)  # the pools stay as they were

        write(path, rendered)  # that replica was scaled away again
        await until(client, frontend.url, 503)
        assert id(replica.frontends[0].app) == started  # the same process all along
