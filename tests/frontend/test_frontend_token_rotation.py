"""A serving token rotated under continuous turns loses none (``drs_protocol.token_source``,
``drs_operator.manifests.rotation``).

Real sim engines (prefill and decode: the decode engine's KV fetch presents the token too) and a
real frontend (raw and httpx upstream clients), each reading the token from a directory of its
own, as each pod has its own mounted copy that its kubelet updates at its own moment. Client
tasks send whole and streamed turns without pause while the test writes the operator's phases
(``next``, then ``previous``, then the new token alone) into the three directories in the worst
order for each phase, waiting each time until the process has read it (its source's generation,
re-read about once a second by the process itself). Every turn must answer 200.

The control: the same traffic with the token replaced in one step, the frontend's copy first
(a presenter ahead of its acceptors): turns fail (502), so the test above can fail.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from drs_devcluster.runner_volumes import write_files
from drs_engine.server.runner import start_engine
from drs_frontend.app import FrontendApp
from drs_frontend.server import start_frontend
from drs_protocol.token_source import TokenSource

from .conftest import frontend_config, sim_config

OLD, NEW = "a" * 64, "b" * 64
BODY = {"model": "sim", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
CLIENTS = 4


@dataclass
class Tally:
    ok: int = 0
    failed: list[str] = field(default_factory=list)


def write(directory: Path, **keys: str) -> None:
    write_files(directory, {k: v.encode() for k, v in keys.items()})


async def picked_up(source: TokenSource, reads: int) -> None:
    """Until the process's own refresh loop has read the directory after a write (two reads: the
    first may have begun before it; about a second each)."""
    async with asyncio.timeout(10):
        while source.reads < reads + 2:
            await asyncio.sleep(0.02)


async def phase(sources: dict[str, TokenSource], dirs: dict[str, Path], order: list[str], **keys: str) -> None:
    """Write one phase into each copy in ``order``, each after the one before was read."""
    for name in order:
        before = sources[name].reads
        write(dirs[name], **keys)
        await picked_up(sources[name], before)


async def turns(url: str, tally: Tally, stop: asyncio.Event, stream: bool) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        while not stop.is_set():
            resp = await client.post(url + "/v1/chat/completions", json={**BODY, "stream": stream})
            good = resp.status_code == 200 and (not stream or resp.text.rstrip().endswith("data: [DONE]"))
            if good:
                tally.ok += 1
            else:
                tally.failed.append(f"{resp.status_code} {resp.text[:200]}")


@contextlib.asynccontextmanager
async def fleet(tmp_path: Path, upstream: str) -> AsyncIterator[tuple[str, dict[str, TokenSource], dict[str, Path]]]:
    dirs = {name: tmp_path / name for name in ("prefill", "decode", "frontend")}
    for directory in dirs.values():
        write(directory, token=OLD)
    sources = {name: TokenSource(directory, what=f"{name} serving token") for name, directory in dirs.items()}
    async with (
        start_engine(sim_config("prefill"), serving_token=sources["prefill"]) as prefill,
        start_engine(sim_config("decode"), serving_token=sources["decode"]) as decode,
    ):
        config = frontend_config([prefill.url], [decode.url], upstream_client=upstream)
        app = FrontendApp(config, serving_token=sources["frontend"])
        async with start_frontend(config, app=app) as frontend, httpx.AsyncClient(timeout=10) as client:
            async with asyncio.timeout(10):
                while (await client.get(frontend.url + "/ready")).status_code != 200:
                    await asyncio.sleep(0.05)
            yield frontend.url, sources, dirs


@pytest.mark.parametrize("upstream", ["raw", "httpx"])
async def test_a_two_phase_rotation_under_continuous_turns_loses_none(tmp_path: Path, upstream: str) -> None:
    tally, stop = Tally(), asyncio.Event()
    async with fleet(tmp_path, upstream) as (url, sources, dirs):
        clients = [asyncio.create_task(turns(url, tally, stop, stream=i % 2 == 1)) for i in range(CLIENTS)]
        engines_first, frontend_first = ["prefill", "decode", "frontend"], ["frontend", "decode", "prefill"]
        # phase 1: acceptors learn NEW; the presenter reading it first does not switch
        await phase(sources, dirs, frontend_first, token=OLD, next=NEW)
        before = tally.ok
        # phase 2: the presenter switches first, acceptors still at phase 1 accept NEW through `next`
        await phase(sources, dirs, frontend_first, token=NEW, previous=OLD)
        assert sources["frontend"].current == NEW
        # done: acceptors drop OLD (held for the grace) once every presenter presents NEW
        await phase(sources, dirs, engines_first, token=NEW)
        stop.set()
        await asyncio.gather(*clients)
    print(f"rotation ({upstream}): {tally.ok} turns, {len(tally.failed)} failed")
    assert tally.failed == [], tally.failed[:3]
    assert tally.ok > before > 0  # turns ran during every phase
    assert all(s.current == NEW for s in sources.values())


async def test_the_control_a_one_step_swap_with_the_presenter_first_loses_turns(tmp_path: Path) -> None:
    tally, stop = Tally(), asyncio.Event()
    async with fleet(tmp_path, "httpx") as (url, sources, dirs):
        clients = [asyncio.create_task(turns(url, tally, stop, stream=False)) for _ in range(CLIENTS)]
        await phase(sources, dirs, ["frontend"], token=NEW)  # the frontend presents NEW at once
        failed_at = len(tally.failed)
        async with asyncio.timeout(10):
            while len(tally.failed) == failed_at:
                await asyncio.sleep(0.02)
        await phase(sources, dirs, ["prefill", "decode"], token=NEW)
        stop.set()
        await asyncio.gather(*clients)
    print(f"one-step swap, presenter first: {tally.ok} turns, {len(tally.failed)} failed")
    assert tally.failed and all(f.startswith("502") for f in tally.failed), tally.failed[:3]
