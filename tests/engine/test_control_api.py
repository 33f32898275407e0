"""The control API: bearer-token auth, weights loads that fail safely, serialisation, sleep/wake."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from drs_engine.server.runner import RunningEngine
from drs_protocol.weights_digest import digest_bytes

from .conftest import CONTROL_TOKEN, EngineFactory, auth

BODY: dict[str, Any] = {"model": "sim", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 6}


def weights_dir(root: Path, name: str, content: bytes) -> Path:
    path = root / name
    path.mkdir()
    (path / "model.safetensors").write_bytes(content)
    return path


async def tokens(client: httpx.AsyncClient, engine: RunningEngine) -> list[int]:
    response = await client.post(engine.url + "/v1/chat/completions", json=BODY)
    assert response.status_code == 200, response.text
    result: list[int] = response.json()["choices"][0]["token_ids"]
    return result


CONTROL_CALLS = [
    pytest.param("GET", "/control/weights", None, id="get-weights-version"),
    pytest.param("POST", "/control/weights/load", {"path": "/nonexistent", "version": "v"}, id="load-weights"),
    pytest.param("POST", "/control/prefix_cache/reset", None, id="reset-prefix-cache"),
    pytest.param("POST", "/control/memory/release", {"tags": ["kv_cache"]}, id="release-memory"),
    pytest.param("POST", "/control/profile/start", None, id="start-profile"),
]


@pytest.mark.parametrize(("method", "path", "body"), CONTROL_CALLS)
async def test_a_control_call_without_a_token_is_401(
    client: httpx.AsyncClient, prefill: RunningEngine, method: str, path: str, body: dict[str, Any] | None
) -> None:
    response = await client.request(method, prefill.url + path, json=body)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    assert response.headers.get("www-authenticate") == 'Bearer realm="drs-control"'


@pytest.mark.parametrize(("method", "path", "body"), CONTROL_CALLS)
async def test_a_control_call_with_a_wrong_token_is_401(
    client: httpx.AsyncClient, prefill: RunningEngine, method: str, path: str, body: dict[str, Any] | None
) -> None:
    response = await client.request(method, prefill.url + path, json=body, headers=auth("not-" + CONTROL_TOKEN))
    assert response.status_code == 401
    error = response.json()["error"]
    assert "control token" in error["message"] and "a wrong token" in error["message"]
    assert CONTROL_TOKEN not in response.text and error["realm"] == "control"
    assert (await client.get(prefill.url + "/server_info")).json()["asleep"] == []  # nothing happened


async def test_an_engine_without_a_token_refuses_the_whole_control_api(
    client: httpx.AsyncClient, engine_factory: EngineFactory
) -> None:
    async with engine_factory("prefill", control_token=None) as engine:
        response = await client.post(engine.url + "/control/prefix_cache/reset", headers=auth())
        served = await client.post(engine.url + "/v1/chat/completions", json=BODY)
    assert response.status_code == 403
    assert "control API is disabled" in response.json()["error"]["message"]
    assert served.status_code == 200


async def test_the_weights_version_can_be_read(client: httpx.AsyncClient, prefill: RunningEngine) -> None:
    response = await client.get(prefill.url + "/control/weights", headers=auth())
    digest = digest_bytes(prefill.config.model.path.encode())  # a sim engine starts at its model label's bytes
    assert response.json() == {"weights_version": "0", "weights_digest": digest, "backend": "sim", "test_double": True}


@pytest.mark.parametrize(
    "bad_path",
    [
        pytest.param("missing", id="a-path-that-does-not-exist"),
        pytest.param("empty-dir", id="an-empty-directory"),
        pytest.param("unreadable", id="a-file-whose-read-fails"),
    ],
)
async def test_a_failed_load_says_why_and_the_old_weights_keep_serving(
    client: httpx.AsyncClient, prefill: RunningEngine, tmp_path: Path, bad_path: str
) -> None:
    (tmp_path / "empty-dir").mkdir()
    # A file whose read fails for every user, root included (permissions do not stop root): the
    # process's own memory at address 0, which is never mapped, answers EIO.
    (tmp_path / "unreadable").symlink_to("/proc/self/mem")
    before = await tokens(client, prefill)

    response = await client.post(
        prefill.url + "/control/weights/load",
        headers=auth(),
        json={"path": str(tmp_path / bad_path), "version": "broken"},
    )

    assert response.status_code == 400
    error = response.json()["error"]
    assert str(tmp_path / bad_path) in error["message"]
    assert error["param"] == "path"
    assert await tokens(client, prefill) == before
    assert (await client.get(prefill.url + "/control/weights", headers=auth())).json()["weights_version"] == "0"


async def test_two_overlapping_loads_run_one_after_the_other_and_both_report(
    client: httpx.AsyncClient, engine_factory: EngineFactory, tmp_path: Path
) -> None:
    a = weights_dir(tmp_path, "a", b"a" * 100)
    b = weights_dir(tmp_path, "b", b"b" * 100)
    # speed 1 with a 0.3 s load: the second call must wait for the first.
    async with engine_factory("prefill", sim={"speed": 1.0, "weightsLoadSeconds": 0.3}) as engine:
        calls = [
            client.post(engine.url + "/control/weights/load", headers=auth(), json={"path": str(p), "version": v})
            for p, v in ((a, "v-a"), (b, "v-b"))
        ]
        first, second = await asyncio.gather(*calls)
        final = (await client.get(engine.url + "/control/weights", headers=auth())).json()["weights_version"]

    assert first.status_code == second.status_code == 200
    results = sorted((first.json(), second.json()), key=lambda r: r["waited_s"])
    earlier, later = results
    assert earlier["result"]["previous_version"] == "0"
    assert later["result"]["previous_version"] == earlier["result"]["version"]
    assert later["waited_s"] >= 0.2  # queued behind the first load
    assert final == later["result"]["version"]


async def test_released_memory_makes_serving_503_until_resumed(
    client: httpx.AsyncClient, prefill: RunningEngine
) -> None:
    released = await client.post(prefill.url + "/control/memory/release", headers=auth(), json={"tags": []})
    assert released.status_code == 200, released.text
    assert released.json()["result"]["released"] == ["model", "kv_cache"]
    asleep = await client.post(prefill.url + "/v1/chat/completions", json=BODY)
    assert asleep.status_code == 503
    assert "asleep" in asleep.json()["error"]["message"]
    assert (await client.get(prefill.url + "/health")).json()["asleep"] is True

    partial = await client.post(prefill.url + "/control/memory/resume", headers=auth(), json={"tags": ["model"]})
    assert partial.status_code == 200
    assert (await client.post(prefill.url + "/v1/chat/completions", json=BODY)).status_code == 503

    await client.post(prefill.url + "/control/memory/resume", headers=auth(), json={"tags": ["kv_cache"]})
    assert (await client.post(prefill.url + "/v1/chat/completions", json=BODY)).status_code == 200


async def test_releasing_the_kv_cache_drops_cached_blocks(client: httpx.AsyncClient, prefill: RunningEngine) -> None:
    long_body = {**BODY, "messages": [{"role": "user", "content": "ping " * 200}]}
    first = await client.post(prefill.url + "/v1/chat/completions", json=long_body)
    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    per_block = (await client.get(prefill.url + "/server_info")).json()["tokens_per_block"]
    released = await client.post(prefill.url + "/control/memory/release", headers=auth(), json={"tags": ["kv_cache"]})
    evicted = released.json()["result"]["prefix_cache_blocks_evicted"]
    assert evicted >= prompt_tokens // per_block > 0  # every full block of the prompt was cached
    await client.post(prefill.url + "/control/memory/resume", headers=auth(), json={})
    again = await client.post(prefill.url + "/v1/chat/completions", json=long_body)
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param("/control/collective/prepare", {"state_dict_info": {}}, id="prepare-refit"),
        pytest.param("/control/collective/update", {"version": "v9"}, id="collective-update"),
    ],
)
async def test_a_collective_step_before_init_on_the_sim_is_a_400_naming_init(
    client: httpx.AsyncClient, prefill: RunningEngine, path: str, body: dict[str, Any]
) -> None:
    response = await client.post(prefill.url + path, headers=auth(), json=body)
    assert response.status_code == 400
    assert "init_collective first" in response.json()["error"]["message"]


async def test_a_sim_engine_that_cannot_reach_the_trainers_store_says_so_within_its_timeout(
    client: httpx.AsyncClient, prefill: RunningEngine
) -> None:
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        port = closed.getsockname()[1]
        body = {"rank_prefix": 0, "ip": "127.0.0.1", "port": port, "world_size": 2, "train_world_size": 1}
        response = await client.post(
            prefill.url + "/control/collective/init", headers=auth(), json={**body, "timeout_s": 2}
        )
    # 400: the store refused within timeout_s; 502: torch's connect retries outran it
    assert response.status_code in (400, 502), response.text
    assert f"127.0.0.1:{port}" in response.json()["error"]["message"]


async def test_profiling_starts_and_stops_once(client: httpx.AsyncClient, prefill: RunningEngine) -> None:
    start = await client.post(prefill.url + "/control/profile/start", headers=auth())
    twice = await client.post(prefill.url + "/control/profile/start", headers=auth())
    stop = await client.post(prefill.url + "/control/profile/stop", headers=auth())
    assert start.status_code == 200 and start.json()["result"] == {"profiling": True}
    assert twice.status_code == 400
    assert stop.status_code == 200 and stop.json()["result"]["profiling"] is False


async def test_a_control_body_with_unknown_fields_is_refused(client: httpx.AsyncClient, prefill: RunningEngine) -> None:
    response = await client.post(
        prefill.url + "/control/weights/load", headers=auth(), json={"path": "/x", "version": "v", "force": True}
    )
    assert response.status_code == 400
    assert "force" in response.json()["error"]["message"]
