"""The trainer's library (``drs_client``) against a real ``drs sidecar`` process over real sim engines:
every call's answer is the protocol's model, every failure a typed error naming the engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from drs_client import EnginesFailed, NoSidecar, RefitIncomplete, Sidecar, SidecarRejected, SidecarUnreachable
from drs_client.sidecar import AsyncSidecar, sidecar_url
from drs_protocol.routes import ControlOp

from .conftest import completion, served_version, sim_engine
from .test_sidecar_cli import SHORT_COLLECTIVE, free_port, refused_port, sidecar, token_file

__all__ = ["token_file"]


async def test_refit_sleep_wake_reset_and_the_served_weights(checkpoint: Path, token_file: Path) -> None:
    async with sim_engine() as a, sim_engine("decode") as b, sidecar(a.url, b.url, token_file=token_file) as url:
        client = AsyncSidecar(url)
        try:
            before = await completion(a.url)
            report = await client.refit(str(checkpoint), "step-9")
            assert (report.op, report.complete, report.ok, report.engines) == (ControlOp.LOAD_WEIGHTS, True, 2, 2)
            assert await served_version(b.url) == "step-9" and await completion(a.url) != before
            fleet = await client.fleet()
            assert [e.weights_version for e in fleet.engines] == ["step-9", "step-9"]
            assert fleet.desired is not None and fleet.desired.version == "step-9"
            assert (await client.reset_prefix_cache()).op == ControlOp.RESET_PREFIX_CACHE
            assert (await client.sleep()).complete
            async with httpx.AsyncClient() as http:
                asleep = await http.post(a.url + "/v1/completions", json={"model": "m", "prompt": "x"})
            assert asleep.status_code == 503
            assert (await client.wake(["model", "kv_cache"])).complete
            assert await client.healthy()
        finally:
            await client.close()


async def test_a_refit_that_misses_an_engine_raises_naming_it(checkpoint: Path, token_file: Path) -> None:
    async with sim_engine() as gone:
        gone_url = gone.url
    async with sim_engine() as a, sidecar(a.url, gone_url, token_file=token_file) as url:
        client = AsyncSidecar(url)
        try:
            with pytest.raises(RefitIncomplete) as caught:
                await client.refit(str(checkpoint), "step-3")
            assert caught.value.engines == [gone_url]
            assert gone_url in str(caught.value) and "1/2 engines ok" in str(caught.value)
            with pytest.raises(EnginesFailed) as reset:
                await client.reset_prefix_cache()
            assert not isinstance(reset.value, RefitIncomplete) and reset.value.engines == [gone_url]
        finally:
            await client.close()


async def test_a_refusal_is_the_sidecars_status_and_message(token_file: Path) -> None:
    async with sim_engine() as a, sidecar(a.url, token_file=token_file) as url:
        client = AsyncSidecar(url)
        try:
            with pytest.raises(SidecarRejected) as caught:
                await client.collective_update("step-1")  # no group formed
            assert caught.value.status == 409 and "collective/init first" in caught.value.message
        finally:
            await client.close()


async def test_no_sidecar_and_a_sidecar_that_does_not_answer_are_told_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DRS_SIDECAR_URL", raising=False)
    with pytest.raises(NoSidecar, match="DRS_SIDECAR_URL"):
        sidecar_url(None)
    monkeypatch.setenv("DRS_SIDECAR_URL", "http://127.0.0.1:9/")
    assert sidecar_url(None) == "http://127.0.0.1:9"
    client = AsyncSidecar(f"http://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(SidecarUnreachable, match="/v1/refit: no answer"):
            await client.refit("/x", "v")
    finally:
        await client.close()


async def test_the_blocking_sidecar_serves_several_threads_at_once(checkpoint: Path, token_file: Path) -> None:
    async with (
        sim_engine() as a,
        sim_engine("decode") as b,
        sidecar(a.url, b.url, token_file=token_file, extra=SHORT_COLLECTIVE) as url,
    ):
        with Sidecar(url) as blocking, refused_port() as port:
            # the engines run on this test's loop: the blocking calls go to other threads
            refit, fleet = await asyncio.gather(
                asyncio.to_thread(blocking.refit, str(checkpoint), "step-11"),
                asyncio.to_thread(blocking.fleet),
            )
            assert refit.complete and refit.ok == 2
            assert len(fleet.engines) == 2
            after = await asyncio.to_thread(blocking.fleet)
            assert [e.weights_version for e in after.engines] == ["step-11", "step-11"]
            with pytest.raises(EnginesFailed) as caught:  # no trainer's store at that port: each engine says so
                await asyncio.to_thread(blocking.collective_init, "127.0.0.1", port, 1)
            assert sorted(caught.value.engines) == sorted([a.url, b.url])
            assert all(f.detail[:3] in ("400", "502") and f"127.0.0.1:{port}" in f.detail for f in caught.value.failed)
