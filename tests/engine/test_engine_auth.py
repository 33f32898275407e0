"""Engine authentication (``drs_protocol.auth``): every route but the probes needs a bearer token.

Real sim engines on loopback: the serving realm (turn legs, model list, server info, gang report,
the KV fetch, unknown paths) refuses a caller without the serving token or with a wrong one (401
naming the realm, the token never echoed), serves one with it; ``/health`` and ``/metrics`` stay
open; a decode engine's KV fetch presents its serving token to the prefill engine.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from drs_devcluster.runner_volumes import write_files
from drs_protocol import auth, routes
from drs_protocol.routes import kv_export_path
from drs_protocol.token_source import TokenSource
from fastapi import FastAPI
from starlette.routing import Route

from .conftest import CONTROL_TOKEN, EngineFactory
from .test_protocol import CHAT_BODY, context_leg, generation_leg

SERVING_TOKEN = "test-serving-token"

SERVING_CALLS = [
    pytest.param("POST", "/v1/chat/completions", CHAT_BODY, 200, id="chat-turn"),
    pytest.param("POST", "/v1/completions", {"model": "sim", "prompt": "hi", "max_tokens": 3}, 200, id="completion"),
    pytest.param("GET", "/v1/models", None, 200, id="model-list"),
    pytest.param("GET", "/server_info", None, 200, id="server-info"),
    pytest.param("GET", "/v1/gang", None, 404, id="gang-report-of-a-one-pod-engine"),
    pytest.param("GET", kv_export_path(424242), None, 404, id="kv-fetch-of-an-unknown-context"),
    pytest.param(
        "POST",
        routes.PREFIX_HELD,
        {"prompt_token_ids": [1, 2, 3, 4], "claim": {"tokens": 4}},
        200,
        id="prefix-lookup-and-claim",
    ),
    pytest.param("GET", "/no/such/route", None, 404, id="unknown-path"),
]


@pytest.mark.parametrize(("method", "path", "body", "served"), SERVING_CALLS)
async def test_a_serving_route_refuses_a_caller_without_the_serving_token_and_serves_one_with_it(
    client: httpx.AsyncClient, engine_factory: EngineFactory, method: str, path: str, body: Any, served: int
) -> None:
    async with engine_factory("prefill", serving_token=SERVING_TOKEN) as engine:
        missing = await client.request(method, engine.url + path, json=body)
        wrong = await client.request(method, engine.url + path, json=body, headers=auth.bearer("x" + SERVING_TOKEN))
        control = await client.request(method, engine.url + path, json=body, headers=auth.bearer(CONTROL_TOKEN))
        right = await client.request(method, engine.url + path, json=body, headers=auth.bearer(SERVING_TOKEN))
    for refused, presented in ((missing, False), (wrong, True), (control, True)):
        assert refused.status_code == 401, refused.text
        assert refused.headers["www-authenticate"] == 'Bearer realm="drs-serving"'
        answer = auth.Unauthorized.model_validate(refused.json())
        assert answer.error.realm is auth.Realm.SERVING and answer.error.param == "authorization"
        assert ("a wrong token" if presented else "no token") in answer.error.message
        assert SERVING_TOKEN not in refused.text
    assert right.status_code == served, right.text


async def test_the_probes_stay_open_and_the_control_api_keeps_its_own_token(
    client: httpx.AsyncClient, engine_factory: EngineFactory
) -> None:
    async with engine_factory("decode", serving_token=SERVING_TOKEN) as engine:
        health = await client.get(engine.url + "/health")
        metrics = await client.get(engine.url + "/metrics")
        serving_on_control = await client.get(engine.url + "/control/weights", headers=auth.bearer(SERVING_TOKEN))
        control = await client.get(engine.url + "/control/weights", headers=auth.bearer(CONTROL_TOKEN))
    assert health.status_code == 200 and metrics.status_code == 200
    assert serving_on_control.status_code == 401
    assert serving_on_control.headers["www-authenticate"] == 'Bearer realm="drs-control"'
    assert control.status_code == 200, control.text


async def test_an_engine_without_a_serving_token_serves_anyone(
    client: httpx.AsyncClient, engine_factory: EngineFactory
) -> None:
    async with engine_factory("prefill") as engine:
        response = await client.post(engine.url + "/v1/chat/completions", json=CHAT_BODY)
    assert response.status_code == 200, response.text


async def test_a_decode_engine_presents_the_serving_token_when_it_fetches_the_context(
    client: httpx.AsyncClient, engine_factory: EngineFactory
) -> None:
    """The generation leg needs the KV fetch to pass the prefill engine's check: with the fleet's
    token it does; a decode engine holding no token is refused there, and says so."""
    headers = auth.bearer(SERVING_TOKEN)
    async with (
        engine_factory("prefill", serving_token=SERVING_TOKEN) as prefill,
        engine_factory("decode", serving_token=SERVING_TOKEN) as decode,
        engine_factory("decode") as tokenless,
    ):
        ctx = await client.post(prefill.url + "/v1/chat/completions", json=context_leg(CHAT_BODY, 7), headers=headers)
        assert ctx.status_code == 200, ctx.text
        gen = await client.post(
            decode.url + "/v1/chat/completions", json=generation_leg(CHAT_BODY, ctx.json()), headers=headers
        )
        ctx2 = await client.post(prefill.url + "/v1/chat/completions", json=context_leg(CHAT_BODY, 8), headers=headers)
        refused = await client.post(tokenless.url + "/v1/chat/completions", json=generation_leg(CHAT_BODY, ctx2.json()))
    assert gen.status_code == 200, gen.text
    assert gen.json()["choices"][0]["token_ids"]
    assert refused.status_code >= 400 and "401" in refused.text, refused.text


@pytest.mark.parametrize(
    "header",
    ["Basic dXNlcjpwYXNz", "Bearer", "token-without-scheme"],
    ids=["basic", "bearer-without-token", "no-scheme"],
)
async def test_a_malformed_authorization_header_is_401_naming_the_bearer_scheme(
    client: httpx.AsyncClient, engine_factory: EngineFactory, header: str
) -> None:
    async with engine_factory("prefill", serving_token=SERVING_TOKEN) as engine:
        serving = await client.get(engine.url + "/v1/models", headers={"authorization": header})
        control = await client.get(engine.url + "/control/weights", headers={"authorization": header})
    for refused, realm in ((serving, "drs-serving"), (control, "drs-control")):
        assert refused.status_code == 401, refused.text
        assert refused.headers["www-authenticate"] == f'Bearer realm="{realm}"'
        message = refused.json()["error"]["message"]
        assert "the authorization header given is not in the Bearer scheme" in message, message


async def test_during_a_rotation_the_engine_accepts_both_tokens_then_refuses_the_dropped_one(
    client: httpx.AsyncClient, engine_factory: EngineFactory, tmp_path: Path
) -> None:
    """Both realms read their Secret's directory (``drs_protocol.token_source``) while the engine
    runs: ``next`` and ``previous`` are accepted beside ``token``; a token two rotations old is 401."""
    serving_dir, control_dir = tmp_path / "serving", tmp_path / "control"
    write_files(serving_dir, {"token": b"s1"})
    write_files(control_dir, {"token": b"c1"})
    serving, control = TokenSource(serving_dir), TokenSource(control_dir)
    async with engine_factory("prefill", serving_token=serving, control_token=control) as engine:

        async def status(path: str, token: str) -> int:
            return (await client.get(engine.url + path, headers=auth.bearer(token))).status_code

        write_files(serving_dir, {"token": b"s1", "next": b"s2"})
        write_files(control_dir, {"token": b"c1", "next": b"c2"})
        await _read_by_the_engine(serving, control)
        assert [await status("/v1/models", t) for t in ("s1", "s2", "c2")] == [200, 200, 401]
        assert [await status("/control/weights", t) for t in ("c1", "c2", "s2")] == [200, 200, 401]
        for step in (
            {"token": "2", "previous": "1"},
            {"token": "2"},
            {"token": "2", "next": "3"},
            {"token": "3", "previous": "2"},
        ):
            write_files(serving_dir, {k: f"s{v}".encode() for k, v in step.items()})  # a second rotation
            write_files(control_dir, {k: f"c{v}".encode() for k, v in step.items()})
            await _read_by_the_engine(serving, control)
        assert [await status("/v1/models", t) for t in ("s1", "s2", "s3")] == [401, 200, 200]
        assert [await status("/control/weights", t) for t in ("c1", "c2", "c3")] == [401, 200, 200]


async def test_every_route_of_the_engine_app_but_the_probes_refuses_a_caller_without_a_token(
    client: httpx.AsyncClient, engine_factory: EngineFactory
) -> None:
    """Walks the routes the engine app really registers (not a list kept beside them), each method:
    without a token every one but ``/health`` and ``/metrics`` is 401 naming its realm, before the
    route runs; so a route added later is covered, and the families the issue names must be there."""
    async with engine_factory("prefill", serving_token=SERVING_TOKEN) as engine:
        app = engine.server.config.app
        assert isinstance(app, FastAPI)
        calls = [
            (method, route.path.replace("{ctx_request_id}", "1"))
            for route in app.routes
            if isinstance(route, Route)  # FastAPI's APIRoute and the plain control routes
            for method in sorted(route.methods or ())
        ]
        answers = {call: await client.request(call[0], engine.url + call[1]) for call in calls}
    paths = {path for _, path in calls}
    families = {
        routes.Endpoint.CHAT,
        routes.Endpoint.COMPLETIONS,
        routes.MODELS,
        routes.SERVER_INFO,
        routes.GANG,
        kv_export_path(1),
        routes.PREFIX_HELD,
        routes.CONTROL_WEIGHTS,
        routes.CONTROL_WEIGHTS_STREAM,
        *routes.CONTROL_ROUTES.values(),
        *auth.OPEN_PATHS,
    }
    assert families <= paths, f"routes missing from the app: {sorted(families - paths)}"
    for (method, path), answer in answers.items():
        realm = auth.realm_of(path)
        if realm is auth.Realm.OPEN:
            assert answer.status_code == 200, (method, path, answer.status_code)
            continue
        assert answer.status_code == 401, (method, path, answer.status_code, answer.text)
        assert answer.headers["www-authenticate"] == f'Bearer realm="{auth.REALM_NAMES[realm]}"', (method, path)
        if method != "HEAD":  # a plain route answers HEAD beside GET, with no body
            assert auth.Unauthorized.model_validate(answer.json()).error.realm is realm


async def _read_by_the_engine(*sources: TokenSource) -> None:
    """Until the engine's own refresh loop has read every source's directory after the write
    (two reads: the first may have begun before it)."""
    seen = [s.reads for s in sources]
    async with asyncio.timeout(10):
        while any(s.reads < r + 2 for s, r in zip(sources, seen, strict=True)):
            await asyncio.sleep(0.02)
