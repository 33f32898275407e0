"""A gang rank polls its leader's ``/v1/gang`` (serving realm) with the serving token of the
moment: after the token in its mounted directory changes, the same client presents the new one."""

from __future__ import annotations

from pathlib import Path

from drs_engine.gang.worker import leader_client
from drs_protocol import routes
from drs_protocol.token_source import TokenSource

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
