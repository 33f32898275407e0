"""A running engine follows the stored desired weights (``drs_engine.weights.follow``), with real sim
engines on loopback: the mounted desired file changes while an engine serves v1, no sidecar target
binds it, so it refuses new legs (503 ``weights_pending``, ``/health`` not ready), catches up (from
the path, else from a serving peer) and serves at the new weights; while an announced target's
lease binds it, it leaves them to the sidecar until the lease lapses."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from drs_engine.server.runner import RunningEngine, start_engine
from drs_engine.weights.catchup import CatchUp
from drs_engine.weights.follow import Action
from drs_protocol import env
from drs_protocol.lifecycle import WEIGHTS_PENDING_ERROR_TYPE
from drs_protocol.routes import CONTROL_WEIGHTS
from drs_protocol.weights_digest import digest_files
from drs_protocol.weights_state import DesiredWeights

from .conftest import CONTROL_TOKEN, auth, sim_config
from .test_peer_catchup import CATCH_UP_WAIT_S, checkpoint, failed_once, peer_at, tokens

CHAT = "/v1/chat/completions"
TURN = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


@contextlib.asynccontextmanager
async def following(tmp_path: Path, peers: list[str] | None = None) -> AsyncIterator[tuple[RunningEngine, Path]]:
    """A serving sim engine (at its start weights, no desired weights) that follows the desired file
    of its mounted weights directory (empty: a fleet that never had a refit)."""
    mounted = tmp_path / "weights"
    mounted.mkdir()
    desired_file = mounted / env.DESIRED_WEIGHTS_KEY
    desired_file.write_text("")
    async with start_engine(
        sim_config(), control_token=CONTROL_TOKEN, weights_peers=peers or [], desired_file=desired_file
    ) as engine:
        assert engine.server.state.follower is not None and engine.server.state.catch_up is None
        yield engine, desired_file


async def reached(catch_up: CatchUp) -> None:
    async with asyncio.timeout(CATCH_UP_WAIT_S):
        await catch_up.done.wait()


async def refused_while_pending(client: httpx.AsyncClient, engine: RunningEngine, *, says: str) -> None:
    health = await client.get(engine.url + "/health")
    assert health.status_code == 503 and health.json()["error"]["type"] == WEIGHTS_PENDING_ERROR_TYPE
    assert says in health.json()["error"]["message"]
    turn = await client.post(engine.url + CHAT, json=TURN)
    assert turn.status_code == 503 and turn.json()["error"]["type"] == WEIGHTS_PENDING_ERROR_TYPE
    held = (await client.get(engine.url + CONTROL_WEIGHTS, headers=auth())).json()
    assert held["catch_up"]["phase"] == "pending" and held["catch_up"]["desired_version"] == says


async def test_a_running_engine_catches_up_to_new_desired_weights_from_their_path(tmp_path: Path) -> None:
    path = checkpoint(tmp_path, "step-2", {"model.safetensors": b"the weights of step 2"})
    wanted = DesiredWeights(version="step-2", path=str(path), digest=digest_files(path), effective_at=time.time())
    async with following(tmp_path) as (engine, desired_file), httpx.AsyncClient(timeout=30) as client:
        state = engine.server.state
        before = (await client.get(engine.url + CONTROL_WEIGHTS, headers=auth())).json()
        assert (await client.post(engine.url + CHAT, json=TURN)).status_code == 200
        desired_file.write_text('{"version": "step-2", "pa')  # the file caught half written: ignored
        assert state.follower is not None and state.follower.tick() is Action.NONE
        assert (await client.post(engine.url + CHAT, json=TURN)).status_code == 200
        async with state.control_lock:  # the catch-up's attempt waits behind it: the gate is observable
            desired_file.write_text(wanted.dump())  # the kubelet updates the mounted ConfigMap
            assert state.follower.tick() in (Action.CATCH_UP, Action.FOLLOWING)  # (its own poll may be first)
            await refused_while_pending(client, engine, says="step-2")
        assert state.catch_up is not None
        await reached(state.catch_up)
        held = (await client.get(engine.url + CONTROL_WEIGHTS, headers=auth())).json()
        assert (await client.get(engine.url + "/health")).status_code == 200
        answer = await client.post(engine.url + CHAT, json=TURN)
        assert answer.status_code == 200
        assert (
            held["weights_version"] == "step-2" and held["weights_digest"] == wanted.digest != before["weights_digest"]
        )
        assert held["catch_up"]["reached_from"] == str(path)
        assert state.follower.tick() is Action.HOLDS


async def test_a_running_engine_catches_up_to_pathless_desired_weights_from_a_peer(tmp_path: Path) -> None:
    async with peer_at(tmp_path) as (peer, wanted), httpx.AsyncClient(timeout=30) as client:
        wanted = wanted.model_copy(update={"effective_at": time.time()})  # as a broadcast leaves them: no path
        async with following(tmp_path, peers=[peer.url]) as (engine, desired_file):
            state = engine.server.state
            assert await tokens(client, engine.url) != await tokens(client, peer.url)
            async with state.control_lock:
                desired_file.write_text(wanted.dump())
                assert state.follower is not None
                assert state.follower.tick() in (Action.CATCH_UP, Action.FOLLOWING)
                await refused_while_pending(client, engine, says="step-3")
            assert state.catch_up is not None
            await reached(state.catch_up)
            held = (await client.get(engine.url + CONTROL_WEIGHTS, headers=auth())).json()
            assert held["weights_digest"] == wanted.digest and held["catch_up"]["reached_from"] == peer.url
            assert await tokens(client, engine.url) == await tokens(client, peer.url), "the peer's weights"


async def test_a_binding_target_defers_the_catch_up_until_its_lease_lapses(tmp_path: Path) -> None:
    """The sidecar announced the target (lease 1.5 s) and died before loading this engine: the
    engine leaves it to the sidecar while the lease binds, then its own poll catches it up."""
    path = checkpoint(tmp_path, "step-2", {"model.safetensors": b"the weights of step 2"})
    wanted = DesiredWeights(version="step-2", path=str(path), digest=digest_files(path), effective_at=time.time())
    async with following(tmp_path) as (engine, desired_file), httpx.AsyncClient(timeout=30) as client:
        state = engine.server.state
        assert state.follower is not None
        state.follower.interval = 0.1  # its own poll, not a tick of this test, catches it up after the lease
        announce = {"version": "step-2", "digest": wanted.digest, "lease_s": 1.5}
        told = await client.post(engine.url + "/control/weights/target", json=announce, headers=auth())
        assert told.status_code == 200
        desired_file.write_text(wanted.dump())
        assert state.follower.tick() is Action.DEFER
        assert state.catch_up is None and state.target.current() is not None
        async with asyncio.timeout(CATCH_UP_WAIT_S):
            while state.catch_up is None:  # the lease running out (a time), then the poll that follows
                await asyncio.sleep(0.02)
        assert state.target.current() is None, "nothing happened while the target bound the engine"
        await reached(state.catch_up)
        held = (await client.get(engine.url + CONTROL_WEIGHTS, headers=auth())).json()
        assert held["weights_version"] == "step-2" and held["weights_digest"] == wanted.digest
        assert (await client.post(engine.url + CHAT, json=TURN)).status_code == 200


async def test_desired_weights_older_than_the_sidecars_load_are_not_followed(tmp_path: Path) -> None:
    """The file lags the API server: it still names step-2 after the sidecar loaded step-3 (whose
    cut-over came later); the engine keeps serving step-3."""
    two = checkpoint(tmp_path, "step-2", {"w": b"two"})
    three = checkpoint(tmp_path, "step-3", {"w": b"three"})
    wanted = DesiredWeights(version="step-2", path=str(two), digest=digest_files(two), effective_at=time.time() - 60)
    async with following(tmp_path) as (engine, desired_file), httpx.AsyncClient(timeout=30) as client:
        load = await client.post(
            engine.url + "/control/weights/load", json={"path": str(three), "version": "step-3"}, headers=auth()
        )
        assert load.status_code == 200
        desired_file.write_text(wanted.dump())
        assert engine.server.state.follower is not None
        assert engine.server.state.follower.tick() is Action.STALE
        assert engine.server.state.catch_up is None
        assert (await client.post(engine.url + CHAT, json=TURN)).status_code == 200


async def test_pathless_desired_weights_no_peer_holds_keep_a_running_engine_refusing(tmp_path: Path) -> None:
    """The start-time rule on a running engine: nothing gives the desired weights (no path, no
    peer holds them), so it refuses every leg, saying why, and stays up trying again."""
    async with (
        start_engine(sim_config(), control_token=CONTROL_TOKEN) as behind,
        following(tmp_path, peers=[behind.url]) as (engine, desired_file),
        httpx.AsyncClient(timeout=30) as client,
    ):
        wanted = DesiredWeights(version="step-9", digest=digest_files(checkpoint(tmp_path, "x", {"w": b"9"})))
        desired_file.write_text(wanted.model_copy(update={"effective_at": time.time()}).dump())
        state = engine.server.state
        assert state.follower is not None and state.follower.tick() in (Action.CATCH_UP, Action.FOLLOWING)
        catch_up = state.catch_up
        assert catch_up is not None
        await failed_once(engine)
        await refused_while_pending(client, engine, says="step-9")
        assert catch_up.pending and catch_up.last_error is not None and behind.url in catch_up.last_error
        assert state.follower.tick() is Action.FOLLOWING  # the next poll leaves the catch-up running


async def test_a_target_that_lapsed_unreached_keeps_refusing_until_the_stored_weights_decide(tmp_path: Path) -> None:
    """The sidecar announced step-2 (cut-over passed, lease 1 s) and died before loading this
    engine; the kubelet has not updated the mounted file yet when the lease lapses. The engine
    keeps refusing the legs the target refused (it does not answer them at its old weights) until
    the file names step-2; then it catches up and serves them."""
    path = checkpoint(tmp_path, "step-2", {"model.safetensors": b"the weights of step 2"})
    cut = time.time() - 0.1
    wanted = DesiredWeights(version="step-2", path=str(path), digest=digest_files(path), effective_at=cut)
    async with following(tmp_path) as (engine, desired_file), httpx.AsyncClient(timeout=30) as client:
        state = engine.server.state
        assert state.follower is not None
        announce = {"version": "step-2", "digest": wanted.digest, "lease_s": 1.0, "effective_at": cut}
        assert (
            await client.post(engine.url + "/control/weights/target", json=announce, headers=auth())
        ).status_code == 200
        async with asyncio.timeout(CATCH_UP_WAIT_S):
            while state.target.current() is not None:  # the lease running out (a time)
                await asyncio.sleep(0.02)
        assert state.follower.tick() is Action.NONE  # the file still empty: the kubelet is behind
        refused = await client.post(engine.url + CHAT, json=TURN)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == WEIGHTS_PENDING_ERROR_TYPE
        assert "lapsed" in refused.json()["error"]["message"]
        assert state.catch_up is None and state.target.lapsed() is not None
        desired_file.write_text(wanted.dump())  # the kubelet catches up
        assert state.follower.tick() in (Action.CATCH_UP, Action.FOLLOWING)
        assert state.target.lapsed() is None  # the stored weights decide now
        assert state.catch_up is not None
        await reached(state.catch_up)
        answer = await client.post(engine.url + CHAT, json=TURN)
        assert answer.status_code == 200
        held = (await client.get(engine.url + CONTROL_WEIGHTS, headers=auth())).json()
        assert held["weights_version"] == "step-2" and held["weights_digest"] == wanted.digest
