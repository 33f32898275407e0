"""The sidecar after a control-token rotation (``drs_sidecar.control``): an engine's 401 makes it
read the token again and repeat the call once; a token that did not change keeps the 401.

A real sim engine whose control token is read from a directory (``drs_protocol.token_source``)
that the test rotates to a new token alone (the old one dropped, the held grace 0)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from drs_devcluster.runner_volumes import write_files
from drs_engine.config import build_config
from drs_engine.server.runner import start_engine
from drs_protocol.token_source import TokenSource
from drs_sidecar.control import ControlClient

from .conftest import raw_engine

CONFIG = {"backend": "sim", "role": "prefill", "host": "127.0.0.1", "port": 0, "sim": {"speed": 0}}


async def test_a_refused_control_token_is_read_again_and_the_call_repeated(tmp_path: Path) -> None:
    write_files(tmp_path, {"token": b"old"})
    source = TokenSource(tmp_path, grace_s=0)
    reads: list[str] = []

    async def refresh() -> str:
        reads.append("read")
        return (tmp_path / "token").read_text()

    async with start_engine(build_config(CONFIG), control_token=source) as engine:
        fresh = ControlClient("old", call_s=5, load_s=5, refresh=refresh)
        stale = ControlClient("old", call_s=5, load_s=5)
        assert (await fresh.weights(engine.url)).ok
        write_files(tmp_path, {"token": b"new"})
        seen = source.reads
        async with asyncio.timeout(10):
            while source.reads < seen + 2:
                await asyncio.sleep(0.02)
        assert not source.matches("old")
        again = await fresh.weights(engine.url)
        refused = await stale.weights(engine.url)
        await fresh.close()
        await stale.close()
    assert again.ok and fresh.token == "new" and reads == ["read"]
    assert refused.status == 401 and not refused.ok


async def test_the_call_repeated_with_a_new_token_keeps_within_the_calls_timeout() -> None:
    """An engine that refuses the old token after 1 s, then never answers the repeated call: the
    call ends at its 2 s timeout, not 1 s plus another 2 s."""

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, nth: int) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if nth > 1:  # the repeated call on a new connection: no answer
            return
        await asyncio.sleep(1.0)
        writer.write(b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")  # the repeated call on the same connection: no answer

    async def refresh() -> str:
        return "new"

    control = ControlClient("old", call_s=2.0, load_s=5, refresh=refresh)
    async with raw_engine(engine) as port:
        started = time.perf_counter()
        try:
            result = await control.weights(f"http://127.0.0.1:{port}")
        finally:
            took = time.perf_counter() - started
            await control.close()
    assert control.token == "new"  # the token was read again and the call repeated
    assert result.timed_out and not result.ok, result
    assert 1.9 < took < 2.6, took
