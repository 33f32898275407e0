"""A path-less refit of a sim fleet: real sim engines join the trainer's ``torch.distributed``
group over gloo through the sidecar's collective steps and receive its broadcast, the digest of
what they hold is the trainer's, and an engine started later under those path-less desired weights
catches up from one of them (a peer) and generates its tokens."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

import httpx
import pytest
from drs_engine.config import build_config
from drs_engine.server.runner import start_engine
from drs_protocol.control import TrainerCollectiveUpdate
from drs_protocol.nemo_rl_refit import parse_state_dict_info
from drs_protocol.routes import CONTROL_WEIGHTS
from drs_protocol.weights_digest import digest_bytes
from drs_protocol.weights_pack import STORE_KEY_BACKEND, STORE_KEY_TARGET_BYTES, batch_ranges
from drs_protocol.weights_state import DesiredWeights

from .conftest import CHAT, TOKEN, as_engine, refitter_over, sim_engine

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

#: The trainer's tensors (NeMo RL's ``[shape, dtype]``), more than one batch at a 4,096-byte target.
INFO: dict[str, Any] = {
    "embed.weight": [[32, 48], "bfloat16"],
    "layer.0.w": [[16, 64], "float32"],
    "norm": [[48], "bfloat16"],
}
TARGET_BYTES = 4096
TIMEOUT = timedelta(seconds=30)


def trainer_bytes() -> bytes:
    nbytes = sum(s.nbytes for s in parse_state_dict_info(INFO))
    return bytes(
        torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)).tolist()
    )


def broadcast_all(group: Any, flat: bytes) -> int:
    """The trainer's side of the update: every batch from rank 0; how many batches."""
    from drs_engine.backends.torch.weights.refit import broadcast_within

    ranges = batch_ranges(parse_state_dict_info(INFO), TARGET_BYTES)
    until = time.monotonic() + TIMEOUT.total_seconds()
    for start, end, _ in ranges:
        broadcast_within(group, torch.frombuffer(bytearray(flat[start:end]), dtype=torch.uint8), until)
    return len(ranges)


async def tokens(client: httpx.AsyncClient, url: str) -> list[int]:
    body = {"model": "m", "messages": [{"role": "user", "content": "same prompt"}], "max_tokens": 6}
    response = await client.post(url + CHAT, json=body)
    response.raise_for_status()
    return list(response.json()["choices"][0]["token_ids"])


async def test_sim_engines_receive_a_gloo_broadcast_and_a_late_engine_catches_up_from_them() -> None:
    from drs_engine.backends.torch.weights.refit import make_group

    flat = trainer_bytes()
    digest = digest_bytes(flat)
    auth = {"authorization": f"Bearer {TOKEN}"}
    async with (
        sim_engine() as a,
        sim_engine("decode") as b,
        refitter_over([as_engine(a), as_engine(b, 1)]) as (refitter, _),
        httpx.AsyncClient(timeout=30) as client,
    ):
        before = await tokens(client, a.url)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
        store.set(STORE_KEY_BACKEND, "gloo")
        store.set(STORE_KEY_TARGET_BYTES, str(TARGET_BYTES))
        cpu = torch.device("cpu")
        group, (layout, joined) = await asyncio.gather(
            asyncio.to_thread(make_group, store, "gloo", 0, 3, cpu, TIMEOUT),
            refitter.collective_init("127.0.0.1", store.port, train_world_size=1),
        )
        assert joined.complete and layout.world_size == 3, joined.as_dict()
        assert (await refitter.collective_prepare(INFO)).complete
        report, batches = await asyncio.gather(
            refitter.collective_update(TrainerCollectiveUpdate(version="step-9", digest=digest)),
            asyncio.to_thread(broadcast_all, group, flat),
        )
        assert batches > 1, "more than one batch"
        assert report.complete, report.as_dict()
        for engine in (a, b):
            held = (await client.get(engine.url + CONTROL_WEIGHTS, headers=auth)).json()
            assert (held["weights_version"], held["weights_digest"]) == ("step-9", digest), held
        after = await tokens(client, a.url)
        assert after != before, "new weights, new tokens"
        assert await tokens(client, b.url) == after
        group.abort()

        # an engine started later under these path-less desired weights gets them from a peer
        desired = DesiredWeights(version="step-9", digest=digest)
        config = build_config(
            {"backend": "sim", "role": "prefill", "host": "127.0.0.1", "port": 0, "sim": {"speed": 0}}
        )
        async with start_engine(config, control_token=TOKEN, desired_weights=desired, weights_peers=[a.url]) as late:
            catch_up = late.server.state.catch_up
            assert catch_up is not None
            async with asyncio.timeout(20):
                await catch_up.done.wait()
            held = (await client.get(late.url + CONTROL_WEIGHTS, headers=auth)).json()
            assert held["weights_digest"] == digest and held["catch_up"]["reached_from"] == a.url, held
            assert await tokens(client, late.url) == after


async def test_a_sim_engine_refuses_an_update_before_it_joined_a_group_or_learned_the_tensors() -> None:
    async with sim_engine() as a, httpx.AsyncClient(timeout=30) as client:
        auth = {"authorization": f"Bearer {TOKEN}"}
        update = await client.post(
            a.url + "/control/collective/update", json={"version": "step-2", "timeout_s": 5}, headers=auth
        )
        assert update.status_code == 400 and "init_collective first" in update.text, update.text
