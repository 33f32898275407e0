"""A gang rank polls its leader's ``/v1/gang`` (serving realm) with the serving token of the
moment: after the token in its mounted directory changes, the same client presents the new one.
Its ``/health`` answer reports the serving token Secret's generation it read (never the token)."""

from __future__ import annotations

from pathlib import Path

import httpx
from drs_engine.gang.spec import GangSpec
from drs_engine.gang.worker import GangMember, leader_client, worker_app
from drs_protocol import routes
from drs_protocol.token_source import GENERATIONS_HEADER, TokenSource, parse_generations

from .conftest import EngineFactory

NEW = "serving-token-after-the-rotation"


async def test_the_rank_presents_the_rotated_serving_token_without_a_new_client(
    tmp_path: Path, engine_factory: EngineFactory
) -> None:
    (tmp_path / "token").write_text("serving-token-before-the-rotation")
    source = TokenSource(tmp_path, what="serving token")
    async with engine_factory("prefill", serving_token=NEW) as leader, leader_client(source) as client:
        before = await client.get(leader.url + routes.GANG)
        assert before.status_code == 401  # the leader accepts only the new token
        (tmp_path / "token").write_text(NEW)
        assert source.refresh()
        after = await client.get(leader.url + routes.GANG)
        assert after.status_code != 401, after.text


async def test_a_rank_reports_the_serving_token_generation_it_read_in_its_health_answer(tmp_path: Path) -> None:
    (tmp_path / "token").write_text(NEW)
    (tmp_path / "generation").write_text("6")
    source = TokenSource(tmp_path, what="serving token")
    member = GangMember(GangSpec(1, 2, "127.0.0.1", 6379, 1), "127.0.0.1", "http://127.0.0.1:1")
    transport = httpx.ASGITransport(app=worker_app(member, source))
    async with httpx.AsyncClient(transport=transport, base_url="http://rank") as client:
        answer = await client.get(routes.HEALTH)
    assert answer.status_code == 503  # not joined: still reports what it read
    assert parse_generations(answer.headers.get(GENERATIONS_HEADER)) == {"serving": 6}
    assert NEW not in str(answer.headers) + answer.text
