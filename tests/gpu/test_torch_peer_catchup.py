"""The ``torch`` backend catches up from a serving peer (on the CPU: ``random:tiny`` in float32):
an engine started under path-less desired weights takes a peer's packed weights over HTTP and
generates the peer's tokens; a stream with other bytes leaves its own weights untouched."""

from __future__ import annotations

from pathlib import Path

import httpx
from drs_engine.server.runner import start_engine
from drs_protocol.routes import CONTROL_WEIGHTS, CONTROL_WEIGHTS_STREAM
from drs_protocol.weights_state import DesiredWeights
from engine.test_peer_catchup import (  # type: ignore[import-not-found]  # tests/ is on sys.path here
    caught_up,
    failed_once,
    flip_last_byte,
    replaying,
)

from .conftest import COMPLETIONS, CONTROL_TOKEN, auth, completion_body, prompt_ids, torch_config


async def tokens(client: httpx.AsyncClient, url: str, ids: list[int]) -> list[int]:
    answer = await client.post(url + COMPLETIONS, json=completion_body(ids))
    assert answer.status_code == 200, answer.text
    return list(answer.json()["choices"][0]["token_ids"])


async def test_a_torch_engine_catches_up_from_a_peer_and_refuses_other_bytes(tmp_path: Path) -> None:
    ids = prompt_ids(40)
    async with (
        start_engine(torch_config(model="random:tiny@5"), control_token=CONTROL_TOKEN) as peer,
        httpx.AsyncClient(timeout=60) as client,
    ):
        held = (await client.get(peer.url + CONTROL_WEIGHTS, headers=auth())).json()
        desired = DesiredWeights(version="v5", digest=held["weights_digest"])
        real = (await client.get(peer.url + CONTROL_WEIGHTS_STREAM, headers=auth())).content
        async with (
            replaying(real, flip_last_byte) as lying,
            start_engine(
                torch_config(), control_token=CONTROL_TOKEN, desired_weights=desired, weights_peers=[lying]
            ) as stale,
        ):
            own = stale.server.state.weights_digest
            await failed_once(stale)
            error = stale.server.state.catch_up.last_error  # type: ignore[union-attr]
            assert error is not None and lying in error and "digest" in error
            assert await stale.server.state.require_backend().measure_digest() == own, "its own weights, untouched"
        async with start_engine(
            torch_config(), control_token=CONTROL_TOKEN, desired_weights=desired, weights_peers=[peer.url]
        ) as late:
            await caught_up(late)
            after = (await client.get(late.url + CONTROL_WEIGHTS, headers=auth())).json()
            assert after["weights_digest"] == desired.digest and after["weights_version"] == "v5"
            assert await tokens(client, late.url, ids) == await tokens(client, peer.url, ids)
