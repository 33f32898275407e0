"""Fixtures for the frontend tests: real sim engine servers and real frontends on 127.0.0.1.

Engines run the ``sim`` backend (the project's test double for a GPU engine) at speed 0 and
never emit EOS unless asked, so no test sleeps and every generation runs to ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from drs_engine.config import EngineConfig, build_config
from drs_engine.server.runner import RunningEngine, start_engine
from drs_frontend.app import FrontendApp
from drs_frontend.config import FrontendConfig
from drs_frontend.server import RunningFrontend, start_frontend
from drs_frontend.tokenization import ChatTokenizer
from drs_protocol.chat import load_tokenizer


def sim_config(role: str, **overrides: Any) -> EngineConfig:
    sim = {"speed": 0, "eosProbability": 0.0, **overrides.pop("sim", {})}
    data: dict[str, Any] = {"backend": "sim", "role": role, "host": "127.0.0.1", "port": 0, "sim": sim}
    data.update(overrides)
    return build_config(data)


def frontend_config(prefill: list[str], decode: list[str], **overrides: Any) -> FrontendConfig:
    data: dict[str, Any] = {
        "prefill": prefill,
        "decode": decode,
        "host": "127.0.0.1",
        "port": 0,
        "health_interval": 0.2,
    }
    data.update(overrides)
    return FrontendConfig.model_validate(data)


@dataclass
class Replica:
    prefill: list[RunningEngine]
    decode: list[RunningEngine]
    frontends: list[RunningFrontend] = field(default_factory=list)
    stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    _frontend_stacks: list[contextlib.AsyncExitStack] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.frontends[0].url

    def config(self, **overrides: Any) -> FrontendConfig:
        return frontend_config([e.url for e in self.prefill], [e.url for e in self.decode], **overrides)

    async def add_frontend(self, **overrides: Any) -> RunningFrontend:
        config = self.config(**overrides)
        stack = await self.stack.enter_async_context(contextlib.AsyncExitStack())
        running = await stack.enter_async_context(start_frontend(config, app=FrontendApp(config)))
        await first_probe_round(running)
        self.frontends.append(running)
        self._frontend_stacks.append(stack)
        return running

    async def restart_frontend(self, index: int) -> RunningFrontend:
        """Stop frontend ``index`` (its router and tokenizer state die with it) and start a fresh
        one with the same config at the same port, as a restarted pod would come back."""
        old = self.frontends[index]
        await self._frontend_stacks[index].aclose()
        config = old.app.config
        stack = await self.stack.enter_async_context(contextlib.AsyncExitStack())
        running = await stack.enter_async_context(start_frontend(config, app=FrontendApp(config)))
        await first_probe_round(running)
        self.frontends[index] = running
        self._frontend_stacks[index] = stack
        return running


async def first_probe_round(running: RunningFrontend) -> None:
    """Wait for the frontend's first health-probe round, so a test that stops an engine next
    does so after that round has seen it up (else the result depends on which came first)."""
    async with asyncio.timeout(10):
        while running.app.prober.rounds < 1:
            await asyncio.sleep(0.01)


ReplicaFactory = Callable[..., contextlib.AbstractAsyncContextManager[Replica]]


@contextlib.asynccontextmanager
async def running_replica(
    prefill: int = 1, decode: int = 1, frontends: int = 1, engine: dict[str, Any] | None = None, **frontend: Any
) -> AsyncIterator[Replica]:
    async with contextlib.AsyncExitStack() as stack:
        p = [
            await stack.enter_async_context(start_engine(sim_config("prefill", **(engine or {}))))
            for _ in range(prefill)
        ]
        d = [
            await stack.enter_async_context(start_engine(sim_config("decode", **(engine or {})))) for _ in range(decode)
        ]
        replica = Replica(p, d, stack=stack)
        for node in range(frontends):
            await replica.add_frontend(node_id=node, **frontend)
        yield replica


@pytest.fixture
def replica_factory() -> ReplicaFactory:
    """``async with replica_factory(prefill=2, decode=1, tokenize=True) as replica:``."""
    return running_replica


@pytest.fixture
async def replica() -> AsyncIterator[Replica]:
    async with running_replica() as r:
        yield r


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as c:
        yield c


def metric_value(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text (``labels`` as rendered, e.g. ``{leg="x"}``)."""
    prefix = f"{name}{labels} "
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return 0.0


async def wait_for_status(client: httpx.AsyncClient, url: str, status: int, deadline: float = 10.0) -> httpx.Response:
    """GET ``url`` until it answers ``status`` (the health prober runs in the background)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    while True:
        resp = await client.get(url)
        if resp.status_code == status or loop.time() > end:
            return resp
        await asyncio.sleep(0.05)


async def stop_engine(engine: RunningEngine) -> None:
    """Stop a running engine server: its port refuses connections from now on."""
    engine.server.should_exit = True
    await engine.task


def chat_body(content: str = "Hello there", **extra: Any) -> dict[str, Any]:
    return {"model": "sim-qwen3", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The bundled Qwen3 tokenizer (loaded once per module)."""
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def chat(tokenizer: Any) -> ChatTokenizer:
    """A ChatTokenizer over it, probed as a frontend's is."""
    return ChatTokenizer(tokenizer)
