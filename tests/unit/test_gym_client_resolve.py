"""The demo's trainer-side client (``examples/gym_client.py``) reads engine URLs whose DNS record
can follow the pod's readiness after a rollout (CI saw EAI_AGAIN there): a read whose name does
not resolve is repeated within ``RESOLVE_S``; a refused connection is not.

The resolver is a double (``LateRecords``, an httpx transport): it fails the first lookups of a
name as glibc does when CoreDNS has no record yet (``socket.gaierror`` EAI_AGAIN under httpx's
``ConnectError``), then sends the request to a real sim engine on loopback."""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import httpx
import pytest
from drs_engine.config import build_config
from drs_engine.server.runner import start_engine

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gym_client.py"
NAME = "pod-sim-r0-prefill-0.pod-sim-engines.fleet.svc"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gym_client_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class LateRecords(httpx.BaseTransport):
    """A resolver double: ``NAME`` fails its first ``failures`` lookups, then is 127.0.0.1."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.lookups: Counter[str] = Counter()
        self.inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host == NAME:
            self.lookups[host] += 1
            if self.lookups[host] <= self.failures:
                try:
                    raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
                except socket.gaierror as exc:
                    raise httpx.ConnectError(f"[Errno {exc.errno}] {exc.strerror}", request=request) from exc
            request.url = request.url.copy_with(host="127.0.0.1")
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def gym_client() -> ModuleType:
    return load_example()


async def _with_engine(check: Callable[[str], None]) -> None:
    """``check(port)`` in a thread (the example's client is synchronous) beside a real sim engine."""
    config = build_config({"backend": "sim", "role": "prefill", "host": "127.0.0.1", "port": 0, "sim": {"speed": 0}})
    async with start_engine(config, control_token="t") as engine:
        await asyncio.to_thread(check, engine.url.rsplit(":", 1)[1])


async def test_a_name_that_resolves_late_is_looked_up_again(
    gym_client: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    late = LateRecords(failures=3)

    def check(port: str) -> None:
        with httpx.Client(transport=late) as http:
            query, hit = gym_client.prefix_cache_hits(http, [f"http://{NAME}:{port}"])
        assert query >= 0.0 and hit >= 0.0

    await _with_engine(check)
    assert late.lookups[NAME] == 4  # three failed lookups, then the read
    assert capsys.readouterr().out.count("does not resolve yet") == 3


async def test_a_name_that_never_resolves_fails_after_resolve_s(
    gym_client: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gym_client, "RESOLVE_S", 0.5)
    late = LateRecords(failures=1_000)

    def check(port: str) -> None:
        with httpx.Client(transport=late) as http, pytest.raises(httpx.ConnectError) as failed:
            gym_client.prefix_cache_hits(http, [f"http://{NAME}:{port}"])
        assert gym_client.name_unresolved(failed.value)

    await _with_engine(check)
    assert 2 <= late.lookups[NAME] < 10  # looked up again with back-off, then gave up


def test_a_refused_connection_is_not_repeated(gym_client: ModuleType) -> None:
    with socket.socket() as held:  # a port nothing listens on: bound, never listening
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        late = LateRecords(failures=0)
        with httpx.Client(transport=late) as http, pytest.raises(httpx.ConnectError) as failed:
            gym_client.prefix_cache_hits(http, [f"http://{NAME}:{port}"])
    assert not gym_client.name_unresolved(failed.value)
    assert late.lookups[NAME] == 1


def test_a_cause_chain_that_loops_back_on_itself_ends(gym_client: ModuleType) -> None:
    inner, outer = OSError("inner"), httpx.ConnectError("outer")
    outer.__cause__, inner.__context__ = inner, outer  # a loop: outer → inner → outer
    assert not gym_client.name_unresolved(outer)
    inner.__cause__ = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    assert gym_client.name_unresolved(outer)
