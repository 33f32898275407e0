"""Reading the engines from a DisaggReplicaSet status (pure)."""

from __future__ import annotations

from typing import Any

import pytest
from drs_sidecar.errors import FleetError
from drs_sidecar.fleet import Engine, engines_from_status


def engine(name: str, role: str, url: str | None, ready: bool) -> dict[str, Any]:
    return {"name": name, "role": role, "ordinal": 0, "width": 1, "url": url, "ready": ready}


def test_every_engine_of_every_replica_is_listed_with_its_readiness() -> None:
    status = {
        "replicaStatuses": [
            {"index": 0, "engines": [engine("r0-p0", "prefill", "http://a:1", True), engine("r0-d0", "decode", "http://b:1", True)]},
            {"index": 1, "engines": [engine("r1-p0", "prefill", "http://c:1", False), engine("r1-d0", "decode", None, True)]},
            {"index": 2, "placed": False, "engines": []},
        ],
        "futureField": {"ignored": True},
    }  # fmt: skip
    assert engines_from_status(status) == [
        Engine("r0-p0", "prefill", 0, "http://a:1", True),
        Engine("r0-d0", "decode", 0, "http://b:1", True),
        Engine("r1-p0", "prefill", 1, "http://c:1", False),
        Engine("r1-d0", "decode", 1, None, False),  # no URL yet: not callable, so not ready
    ]


def test_no_status_yet_means_no_engines() -> None:
    assert engines_from_status(None) == []


def test_a_status_that_breaks_the_schema_is_an_error_naming_the_field() -> None:
    with pytest.raises(FleetError, match="role"):
        engines_from_status({"replicaStatuses": [{"index": 0, "engines": [engine("x", "chef", "http://a:1", True)]}]})
