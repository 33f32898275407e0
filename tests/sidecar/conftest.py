"""Fixtures for the sidecar tests: real sim engines (the GPU engine's test double) with a
control token, and a Refitter over them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from drs_engine.config import build_config
from drs_engine.server.runner import RunningEngine, start_engine
from drs_protocol.weights_state import DesiredWeights, HeldWeights
from drs_sidecar.control import ControlClient
from drs_sidecar.fleet import Engine
from drs_sidecar.metrics import SidecarMetrics
from drs_sidecar.refit import Refitter

TOKEN = "sidecar-test-token"
CHAT = "/v1/chat/completions"


def sim_engine(role: str = "prefill", **sim: Any) -> contextlib.AbstractAsyncContextManager[RunningEngine]:
    config = build_config(
        {
            "backend": "sim",
            "role": role,
            "host": "127.0.0.1",
            "port": 0,
            "sim": {"speed": 0, "eosProbability": 0.0, **sim},
        }
    )
    return start_engine(config, control_token=TOKEN)


class ListFleet:
    """The engines of a test, editable between calls (the Fleet protocol, over real engines)."""

    def __init__(self, engines: list[Engine]) -> None:
        self.list = engines
        self.published: list[str] = []
        self.engine_weights: list[dict[str, HeldWeights]] = []
        #: every value the desired-weights annotation took, in order (the resource holds the last)
        self.desires: list[DesiredWeights | None] = []

    async def engines(self) -> list[Engine]:
        return list(self.list)

    async def publish(self, version: str) -> None:
        self.published.append(version)

    async def publish_engines(self, held: Mapping[str, HeldWeights]) -> None:
        self.engine_weights.append(dict(held))

    @property
    def engine_versions(self) -> list[dict[str, str]]:
        """The versions of each record (what the operator shows as ``weightsVersion``)."""
        return [{k: v.version for k, v in record.items()} for record in self.engine_weights]

    async def desire(self, weights: DesiredWeights | None) -> None:
        self.desires.append(weights)

    async def desired(self) -> DesiredWeights | None:
        return self.desires[-1] if self.desires else None

    async def close(self) -> None:
        return None


def as_engine(engine: RunningEngine, replica: int = 0, *, ready: bool = True) -> Engine:
    return Engine(name=engine.url, role="prefill", replica=replica, url=engine.url, ready=ready)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "step-100"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"weights of step 100")
    return path


@contextlib.asynccontextmanager
async def refitter_over(engines: list[Engine]) -> AsyncIterator[tuple[Refitter, ListFleet]]:
    fleet = ListFleet(engines)
    control = ControlClient(TOKEN, call_s=5.0, load_s=30.0)
    try:
        yield Refitter(fleet, control, SidecarMetrics(), concurrency=4), fleet
    finally:
        await control.close()


async def served_version(url: str) -> str:
    async with httpx.AsyncClient() as client:
        response = await client.get(url + "/control/weights", headers={"authorization": f"Bearer {TOKEN}"})
        response.raise_for_status()
        return str(response.json()["weights_version"])


async def completion(url: str) -> list[int]:
    """The token ids one fixed request generates (the sim's output depends on the weights)."""
    body = {"model": "sim-qwen3", "messages": [{"role": "user", "content": "same prompt"}], "max_tokens": 8}
    async with httpx.AsyncClient() as client:
        response = await client.post(url + CHAT, json=body)
        response.raise_for_status()
        return list(response.json()["choices"][0]["token_ids"])


@contextlib.asynccontextmanager
async def raw_engine(
    answer: Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]],
) -> AsyncIterator[int]:
    """A double of an engine at the byte level (a hung or odd one): a loopback server whose every
    connection runs ``answer(reader, writer, nth connection)``; yields its port, and on the way
    out closes every connection it held."""
    held: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await answer(reader, writer, len(held))

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()
