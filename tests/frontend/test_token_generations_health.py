"""Each process reports the token Secret generation it read (never the token) in its ``/health``
answer's ``x-drs-token-generations`` header, and follows a new one written by the operator: a
sim engine (serving and control realms) and a frontend (serving), each on its own directory."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from drs_devcluster.runner_volumes import write_files
from drs_engine.server.runner import start_engine
from drs_frontend.app import FrontendApp
from drs_frontend.server import start_frontend
from drs_protocol.token_source import GENERATIONS_HEADER, TokenSource, parse_generations

from .conftest import frontend_config, sim_config


def write(directory: Path, **keys: str) -> None:
    write_files(directory, {k: v.encode() for k, v in keys.items()})


async def reported(client: httpx.AsyncClient, url: str, want: dict[str, int]) -> httpx.Response:
    """The first ``/health`` answer reporting ``want`` (the processes re-read about once a second)."""
    async with asyncio.timeout(10):
        while True:
            answer = await client.get(url + "/health")
            if parse_generations(answer.headers.get(GENERATIONS_HEADER)) == want:
                return answer
            await asyncio.sleep(0.1)


async def test_engines_and_frontends_report_the_generation_they_read_and_follow_a_new_one(tmp_path: Path) -> None:
    dirs = {name: tmp_path / name for name in ("serving", "control", "frontend")}
    write(dirs["serving"], token="serving-a", generation="4")
    write(dirs["control"], token="control-a", generation="9")
    write(dirs["frontend"], token="serving-a", generation="4")
    serving, control, front = (TokenSource(dirs[n], what=n) for n in ("serving", "control", "frontend"))
    async with start_engine(sim_config("prefill"), control_token=control, serving_token=serving) as engine:
        config = frontend_config([engine.url], [engine.url])
        app = FrontendApp(config, serving_token=front)
        async with start_frontend(config, app=app) as frontend, httpx.AsyncClient(timeout=10) as client:
            first = await reported(client, engine.url, {"serving": 4, "control": 9})
            await reported(client, frontend.url, {"serving": 4})
            write(dirs["serving"], token="serving-a", next="serving-b", generation="5")
            write(dirs["frontend"], token="serving-a", next="serving-b", generation="5")
            await reported(client, engine.url, {"serving": 5, "control": 9})
            last = await reported(client, frontend.url, {"serving": 5})
            for answer in (first, last):
                shown = str(answer.headers) + answer.text
                assert not [t for t in ("serving-a", "serving-b", "control-a") if t in shown]
