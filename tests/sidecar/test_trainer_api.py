"""The sidecar's answers are exactly the :mod:`drs_protocol.trainer_api` models: each answer parses
and dumps back to itself (a field the sidecar adds without a model field fails here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from drs_protocol.control import Refit
from drs_protocol.trainer_api import CollectiveInitReport, FanOutReport, FleetReport
from pydantic import BaseModel, ValidationError

from .conftest import sim_engine
from .test_sidecar_cli import SHORT_COLLECTIVE, refused_port, sidecar, token_file

__all__ = ["token_file"]  # the fixture, used by name


def exactly(model: type[BaseModel], answer: dict[str, Any]) -> None:
    assert model.model_validate(answer).model_dump(mode="json") == answer


async def test_every_route_answers_exactly_its_model(checkpoint: Path, token_file: Path) -> None:
    async with (
        sim_engine() as a,
        sim_engine("decode") as b,
        sidecar(a.url, b.url, token_file=token_file, extra=SHORT_COLLECTIVE) as url,
        httpx.AsyncClient(timeout=30) as client,
    ):
        # first: no weights are desired yet, so the sidecar's catch-up loop holds no lock
        with refused_port() as port:
            init = await client.post(
                url + "/v1/collective/init", json={"ip": "127.0.0.1", "port": port, "train_world_size": 1}
            )
        exactly(CollectiveInitReport, init.json())
        refit = await client.post(url + "/v1/refit", json={"path": str(checkpoint), "version": "step-1"})
        exactly(FanOutReport, refit.json())
        exactly(FleetReport, (await client.get(url + "/v1/fleet")).json())
        bodies: list[tuple[str, dict[str, Any]]] = [
            ("/v1/prefix_cache/reset", {}),
            ("/v1/sleep", {"tags": []}),
            ("/v1/wake", {"tags": []}),
        ]
        for route, body in bodies:
            exactly(FanOutReport, (await client.post(url + route, json=body)).json())
        missing = await client.post(url + "/v1/refit", json={"path": str(checkpoint / "none"), "version": "step-2"})
        assert missing.status_code == 502
        exactly(FanOutReport, missing.json())
        assert FanOutReport.model_validate(missing.json()).failed[0].engine == a.url


def test_the_round_trip_check_catches_a_field_without_a_model_field() -> None:
    answer: dict[str, Any] = {
        "desired": None,
        "published": None,
        "refitting": False,
        "collective_group": None,
        "engines": [],
        "new": 1,
    }
    with pytest.raises(AssertionError):
        exactly(FleetReport, answer)


def test_a_request_field_out_of_bounds_is_refused_naming_it() -> None:
    with pytest.raises(ValidationError, match="version"):
        Refit(path="/x", version="v" * 257)
    with pytest.raises(ValidationError, match="force"):
        Refit.model_validate({"path": "/x", "version": "v", "force": True})
