"""The control calls are answered ahead of the app's router (``drs_engine.server.control.ControlDispatch``):
a refit's calls never walk the routes, everything else still does, and the answers are the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from drs_engine.server.app import EngineApp
from drs_engine.server.runner import RunningEngine
from drs_engine.server.state import EngineState
from drs_protocol import routes
from drs_protocol.routes import CONTROL_ROUTES, ControlOp
from starlette.routing import BaseRoute, Match, NoMatchFound
from starlette.types import Receive, Scope, Send

from .conftest import auth

LOAD = CONTROL_ROUTES[ControlOp.LOAD_WEIGHTS]
TARGET = CONTROL_ROUTES[ControlOp.ANNOUNCE_WEIGHTS_TARGET]


class RouterProbe(BaseRoute):
    """A route put first in the app's router: it matches nothing and records every path the router
    walks (a request the router never saw is not in :attr:`walked`)."""

    def __init__(self) -> None:
        self.walked: list[str] = []

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        self.walked.append(scope["path"])
        return Match.NONE, {}

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("the probe matches nothing")

    def url_path_for(self, name: str, /, **path_params: Any) -> Any:
        raise NoMatchFound(name, path_params)


def engine_app(engine: RunningEngine) -> EngineApp:
    app = engine.server.config.app
    assert isinstance(app, EngineApp)
    return app


def probe(engine: RunningEngine) -> RouterProbe:
    route = RouterProbe()
    engine_app(engine).router.routes.insert(0, route)
    return route


async def test_a_refits_control_calls_never_walk_the_router(
    client: httpx.AsyncClient, prefill: RunningEngine, tmp_path: Path
) -> None:
    walked = probe(prefill)
    (tmp_path / "model.safetensors").write_bytes(b"step-1")
    url = prefill.url
    announce = await client.post(url + TARGET, headers=auth(), json={"version": "1", "lease_s": 5})
    load = await client.post(url + LOAD, headers=auth(), json={"path": str(tmp_path), "version": "1"})
    held = await client.get(url + routes.CONTROL_WEIGHTS, headers=auth())
    assert [announce.status_code, load.status_code, held.status_code] == [200, 200, 200], load.text
    assert load.json()["weights_version"] == held.json()["weights_version"] == "1"
    assert walked.walked == []
    # everything else goes through the router, which answers it as before
    wrong_method = await client.get(url + LOAD, headers=auth())
    trailing_slash = await client.post(url + LOAD + "/", headers=auth(), json={})
    unknown = await client.post(url + "/control/nothing", headers=auth())
    models = await client.get(url + routes.MODELS)
    assert [wrong_method.status_code, unknown.status_code, models.status_code] == [405, 404, 200]
    assert wrong_method.json()["error"]["message"] and unknown.json()["error"]["message"]
    assert trailing_slash.status_code in (307, 404)
    assert {LOAD, LOAD + "/", "/control/nothing", routes.MODELS} <= set(walked.walked)  # (and redirect tries)


async def test_a_control_call_that_hits_a_bug_answers_the_apps_500_body(
    client: httpx.AsyncClient, prefill: RunningEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    state: EngineState = engine_app(prefill).state.engine

    def broken() -> Any:
        raise RuntimeError("a bug in the backend's lookup")  # fault injection: no real path raises it

    monkeypatch.setattr(state, "require_backend", broken)
    answer = await client.get(prefill.url + routes.CONTROL_WEIGHTS, headers=auth())
    assert answer.status_code == 500
    assert answer.json()["error"]["message"] == "internal error: RuntimeError: a bug in the backend's lookup"
