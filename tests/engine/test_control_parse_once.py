"""A control call's per-call work done once (``drs_engine.server.control``, issue 22's refit at
scale): its body parsed and validated in one pass of pydantic's JSON validator, the token checked
once (by ``EngineAuth``, which marks the scope for ``check_control``), the metrics' labelled
children bound once. None of it may change an answer: a body the one pass refuses is answered
exactly as ``json`` then the model refused it, naming the field."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from drs_engine.errors import EngineError, UnauthorizedError
from drs_engine.metrics import CONTROL_ERROR, CONTROL_OK, EngineMetrics
from drs_engine.server.app import EngineApp
from drs_engine.server.auth import CHECKED_REALM, check_control
from drs_engine.server.body import validate
from drs_engine.server.control import _JsonAnswer
from drs_engine.server.runner import RunningEngine
from drs_protocol.auth import Realm
from drs_protocol.body import parse_json_object
from drs_protocol.control import LoadWeights, WeightsTarget
from drs_protocol.limits import MAX_CONTROL_BODY_BYTES
from drs_protocol.routes import CONTROL_ROUTES, ControlOp
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message

from .conftest import CONTROL_TOKEN, auth, metric_value

TARGET = CONTROL_ROUTES[ControlOp.ANNOUNCE_WEIGHTS_TARGET]
LOAD = CONTROL_ROUTES[ControlOp.LOAD_WEIGHTS]


def reference(model: type[BaseModel], raw: bytes) -> tuple[int, dict[str, Any] | None]:
    """What the engine answered before the one-pass parse: ``json`` first, then the model (status,
    and the error body when it refused)."""
    try:
        validate(model, parse_json_object(raw) if raw.strip() else {})
    except EngineError as exc:
        return exc.status, exc.to_body()
    return 200, None


BODIES = [
    pytest.param(TARGET, b'{"version": "2", "lease_s": ', id="malformed-json"),
    pytest.param(TARGET, b'["version", "2"]', id="a-json-array-instead-of-an-object"),
    pytest.param(TARGET, b"  ", id="a-blank-body-names-the-missing-fields"),
    pytest.param(TARGET, b'{"version": "2", "lease_s": 0}', id="a-lease-of-zero-names-lease_s"),
    pytest.param(TARGET, b'{"version": "2", "lease_s": NaN}', id="a-nan-lease"),
    pytest.param(TARGET, b'{"version": "2", "lease_s": 5, "extra": 1}', id="an-unknown-field"),
    pytest.param(TARGET, b'{"version": "", "lease_s": 5}', id="an-empty-version"),
    pytest.param(TARGET, b'{"version": "2\\u0007", "lease_s": 5}', id="an-unprintable-version"),
    pytest.param(TARGET, b'{"version": "2", "lease_s": 5, "digest": "md5:x"}', id="a-digest-of-another-form"),
    pytest.param(
        TARGET, b'{"version": "\\ud800", "lease_s": 5}', id="a-lone-surrogate-json-takes-and-pydantic-refuses"
    ),
    pytest.param(TARGET, '{"version": "2", "lease_s": 5}'.encode("utf-16"), id="utf-16-which-only-json-reads"),
    pytest.param(TARGET, b'{"version": "1", "lease_s": 5, "version": "2"}', id="a-repeated-key-the-last-wins"),
    pytest.param(LOAD, b'{"version": "2"}', id="a-load-without-its-path"),
    pytest.param(LOAD, b'{"path": "/x", "version": "2", "effective_at": -1}', id="a-load-cut-over-before-1970"),
    pytest.param(
        LOAD, b'{"path": "/x", "version": "2", "announce": {"lease_s": -1}}', id="a-folded-announce-bad-lease"
    ),
]


@pytest.mark.parametrize(("route", "raw"), BODIES)
async def test_a_control_body_is_answered_as_json_then_the_model_answered_it(
    client: httpx.AsyncClient, prefill: RunningEngine, route: str, raw: bytes
) -> None:
    model = WeightsTarget if route == TARGET else LoadWeights
    status, body = reference(model, raw)
    headers = {**auth(), "content-type": "application/json"}
    answer = await client.post(prefill.url + route, headers=headers, content=raw)
    if status != 200:
        assert (answer.status_code, answer.json()) == (status, body)
        return
    assert answer.status_code == 200, answer.text
    if route == TARGET:  # the one pass read the same target: the last of a repeated key, UTF-16 decoded
        expected = json.loads(raw)["version"]
        assert answer.json()["result"]["target"]["version"] == expected


def a_request(scope_extra: dict[str, Any], token: str) -> Request:
    headers = [(b"authorization", f"Bearer {token}".encode())]
    return Request({"type": "http", "method": "GET", "path": "/control/weights", "headers": headers, **scope_extra})


@pytest.mark.parametrize(
    ("marked", "refused"),
    [
        pytest.param({}, True, id="a-route-outside-the-middleware-still-compares-the-token"),
        pytest.param({CHECKED_REALM: Realm.SERVING}, True, id="a-serving-tokens-mark-does-not-open-the-control-api"),
        pytest.param({CHECKED_REALM: "control"}, True, id="only-the-realm-itself-counts-as-the-mark"),
        pytest.param({CHECKED_REALM: Realm.CONTROL}, False, id="the-control-mark-of-engine-auth-is-trusted"),
    ],
)
def test_check_control_compares_the_token_unless_engine_auth_accepted_it_for_the_control_realm(
    prefill: RunningEngine, marked: dict[str, Any], refused: bool
) -> None:
    app = prefill.server.config.app
    assert isinstance(app, EngineApp)
    request = a_request(marked, "not-the-token")
    if refused:
        with pytest.raises(UnauthorizedError):
            check_control(app.state.engine, request)
    else:
        check_control(app.state.engine, request)


async def test_a_wrong_token_on_a_control_call_is_refused_by_the_middleware_with_the_realms_401(
    client: httpx.AsyncClient, prefill: RunningEngine
) -> None:
    body = {"version": "2", "lease_s": 5}
    refused = await client.post(prefill.url + TARGET, headers=auth("not-the-token"), json=body)
    missing = await client.post(prefill.url + TARGET, json=body)
    for answer in (refused, missing):
        assert answer.status_code == 401, answer.text
        assert answer.headers["www-authenticate"] == 'Bearer realm="drs-control"'
        assert answer.json()["error"]["param"] == "authorization"
    assert "wrong token" in refused.json()["error"]["message"]


def test_the_bound_metric_children_count_as_labels_did() -> None:
    metrics = EngineMetrics(backend="sim", role="prefill", test_double=True)
    for version in ("a", "b", "a"):  # back to an earlier version: its series comes back, the others go
        metrics.set_weights_version(version, loaded=True)
    metrics.set_weights_version("a", loaded=False)
    for status in (CONTROL_OK, CONTROL_OK, CONTROL_ERROR):
        metrics.count_control_op("load_weights", status)
    text = metrics.render().decode()
    assert metric_value(text, "drs_engine_weights_version", '{version="a"}') == 3
    assert 'drs_engine_weights_version{version="b"}' not in text
    assert metric_value(text, "drs_engine_control_ops_total", '{op="load_weights",status="ok"}') == 2
    assert metric_value(text, "drs_engine_control_ops_total", '{op="load_weights",status="error"}') == 1


async def test_a_load_counts_in_the_metrics_as_before(
    client: httpx.AsyncClient, prefill: RunningEngine, tmp_path: Path
) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"step-1")
    for version in ("1", "2"):
        load = await client.post(prefill.url + LOAD, headers=auth(), json={"path": str(tmp_path), "version": version})
        assert load.status_code == 200, load.text
    bad = await client.post(prefill.url + LOAD, headers=auth(), json={"path": str(tmp_path / "none"), "version": "3"})
    assert bad.status_code >= 400
    text = (await client.get(prefill.url + "/metrics")).text
    assert metric_value(text, "drs_engine_weights_version", '{version="2"}') == 2
    assert metric_value(text, "drs_engine_control_ops_total", '{op="load_weights",status="ok"}') == 2
    assert metric_value(text, "drs_engine_control_ops_total", '{op="load_weights",status="error"}') == 1


async def over_the_cap(pieces: int) -> AsyncIterator[bytes]:
    for _ in range(pieces):
        yield b"y" * (MAX_CONTROL_BODY_BYTES // 4)


@pytest.mark.parametrize(
    "chunked",
    [pytest.param(False, id="in-one-piece-with-its-length"), pytest.param(True, id="chunked-without-a-length")],
)
async def test_a_control_body_over_the_cap_is_still_refused_with_413_and_the_engine_keeps_answering(
    client: httpx.AsyncClient, prefill: RunningEngine, chunked: bool
) -> None:
    content: bytes | AsyncIterator[bytes] = over_the_cap(5) if chunked else b"y" * (MAX_CONTROL_BODY_BYTES + 1)
    refused = await client.post(prefill.url + TARGET, headers=auth(), content=content)
    assert refused.status_code == 413, refused.text
    assert str(MAX_CONTROL_BODY_BYTES) in refused.json()["error"]["message"]
    within = await client.post(prefill.url + TARGET, headers=auth(), content=over_the_cap(1))  # chunked, a 400
    assert within.status_code == 400 and "malformed JSON" in within.json()["error"]["message"], within.text
    good = await client.post(prefill.url + TARGET, headers=auth(), json={"version": "2", "lease_s": 5})
    assert good.status_code == 200, good.text


def test_a_control_answers_headers_are_starlettes_for_the_same_json() -> None:
    body = b'{"op": "announce_weights_target"}'
    assert _JsonAnswer(body).raw_headers == Response(body, media_type="application/json").raw_headers


async def test_a_body_over_the_cap_in_one_message_without_a_length_is_refused_with_413(prefill: RunningEngine) -> None:
    app = prefill.server.config.app
    assert isinstance(app, EngineApp)
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"y" * (MAX_CONTROL_BODY_BYTES + 1), "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    headers = [(b"authorization", b"Bearer " + CONTROL_TOKEN.encode())]
    scope = {"type": "http", "method": "POST", "path": TARGET, "root_path": "", "headers": headers, "query_string": b""}
    await app(scope, receive, send)
    assert sent[0]["status"] == 413
    assert str(MAX_CONTROL_BODY_BYTES) in json.loads(sent[1]["body"])["error"]["message"]
