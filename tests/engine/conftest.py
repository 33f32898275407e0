"""Fixtures for the engine server tests: real servers on 127.0.0.1 ephemeral ports.

Engines run the ``sim`` backend (the project's test double for a GPU engine) at speed 0, so no
test sleeps; each test gets fresh engines, so no state leaks between tests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx
import pytest
from drs_engine.config import EngineConfig, build_config
from drs_engine.server.runner import RunningEngine, start_engine
from drs_protocol.token_source import TokenSource

CONTROL_TOKEN = "test-control-token"

EngineFactory = Callable[..., AbstractAsyncContextManager[RunningEngine]]


def sim_config(role: str = "prefill", **overrides: Any) -> EngineConfig:
    """A sim engine config on a free loopback port, speed 0, never emitting EOS unless asked, with
    ``overrides`` (camelCase keys)."""
    sim = {"speed": 0, "eosProbability": 0.0, **overrides.pop("sim", {})}
    data: dict[str, Any] = {"backend": "sim", "role": role, "host": "127.0.0.1", "port": 0, "sim": sim}
    data.update(overrides)
    return build_config(data)


@pytest.fixture
def engine_factory() -> EngineFactory:
    """``async with engine_factory("decode", sim={...}) as engine:`` — a running sim engine."""

    def make(
        role: str = "prefill",
        *,
        control_token: str | TokenSource | None = CONTROL_TOKEN,
        serving_token: str | TokenSource | None = None,
        **overrides: Any,
    ) -> Any:
        config = sim_config(role, **overrides)
        return start_engine(config, control_token=control_token, serving_token=serving_token)

    return make


@pytest.fixture
async def prefill(engine_factory: EngineFactory) -> AsyncIterator[RunningEngine]:
    async with engine_factory("prefill") as engine:
        yield engine


@pytest.fixture
async def decode(engine_factory: EngineFactory) -> AsyncIterator[RunningEngine]:
    async with engine_factory("decode") as engine:
        yield engine


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as c:
        yield c


def auth(token: str = CONTROL_TOKEN) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def metric_value(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text (``labels`` as rendered, e.g. ``{leg="x"}``)."""
    prefix = f"{name}{labels} "
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    raise AssertionError(f"no sample {prefix!r} in /metrics")
