"""The trainer's view of a fleet, parsed from a DisaggReplicaSet with the operator's models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from drs_client import Fleet, FleetUnreadable
from drs_client.parse import view_of


def resource(status: dict[str, Any] | None = None, *, generation: int = 3, **model: Any) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "rl", "name": "pol", "generation": generation, "resourceVersion": "7"},
        "spec": {"model": {"path": "/models/qwen", **model}},
        "status": status or {},
    }


READY = {
    "observedGeneration": 3,
    "phase": "Ready",
    "replicas": 2,
    "readyReplicas": 2,
    "updatedReplicas": 2,
    "urls": ["http://a:8300", "http://b:8301"],
    "weights": {"version": "step-4"},
    "conditions": [
        {
            "type": "Ready",
            "status": "True",
            "reason": "AllReplicasReady",
            "message": "all children match the spec",
            "lastTransitionTime": "2026-12-01T00:00:00Z",
        }
    ],
    "replicaStatuses": [
        {
            "index": 0,
            "placed": True,
            "ready": True,
            "engines": [
                {
                    "name": "pol-r0-prefill-0",
                    "role": "prefill",
                    "ordinal": 0,
                    "width": 1,
                    "url": "http://e0:8000",
                    "ready": True,
                    "weightsVersion": "step-4",
                },
                {"name": "pol-r0-decode-0", "role": "decode", "ordinal": 0, "width": 1, "url": None, "ready": True},
            ],
            "frontends": [],
        },
    ],
}


def test_a_ready_fleet_serves_and_shows_its_urls_engines_and_weights() -> None:
    view = view_of(resource(READY, servedName="policy"))
    assert view.serves() and view.serves(min_ready_replicas=2) and not view.serves(min_ready_replicas=3)
    assert view.urls == ("http://a:8300", "http://b:8301")
    assert [(e.name, e.role, e.replica, e.ready) for e in view.engines] == [
        ("pol-r0-prefill-0", "prefill", 0, True),
        ("pol-r0-decode-0", "decode", 0, False),  # ready but without a URL: not callable
    ]
    assert view.engine_weights() == {"pol-r0-prefill-0": "step-4", "pol-r0-decode-0": None}
    assert (view.weights_version, view.model, view.message) == ("step-4", "policy", "all children match the spec")


def test_a_status_written_for_an_older_generation_does_not_serve() -> None:
    view = view_of(resource(READY, generation=4))
    assert not view.current and not view.serves() and not view.serves(min_ready_replicas=1)


def test_an_invalid_spec_is_invalid_with_the_valid_conditions_message() -> None:
    status = {
        "observedGeneration": 3,
        "phase": "Invalid",
        "conditions": [
            {
                "type": "Valid",
                "status": "False",
                "reason": "InvalidSpec",
                "message": "spec.replicas: bad",
                "lastTransitionTime": "2026-12-01T00:00:00Z",
            }
        ],
    }
    view = view_of(resource(status))
    assert view.invalid and view.message == "spec.replicas: bad" and not view.serves()


def test_equal_statuses_give_equal_views_and_a_change_does_not() -> None:
    assert view_of(resource(READY)) == view_of(resource(READY))
    assert view_of(resource(READY)) != view_of(resource({**READY, "urls": ["http://a:8300"]}))


def test_a_status_that_does_not_parse_names_the_fleet_and_the_field() -> None:
    with pytest.raises(
        FleetUnreadable,
        match=r"rl/pol: status does not parse: status.readyReplicas: Input should be greater than or equal to 0$",
    ):
        view_of(resource({"readyReplicas": -1}))


def test_no_credentials_is_a_fleet_error_naming_the_fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(FleetUnreadable, match=r"rl/pol: no Kubernetes credentials"):
        Fleet.connect("pol", "rl", kubeconfig=tmp_path / "no-such-kubeconfig")
