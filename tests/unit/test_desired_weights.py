"""The fleet's desired weights as operator state (pure): the weights ConfigMap every engine pod
reads at its start, status.weights.desired, and the rule that a new value rolls nothing."""

from __future__ import annotations

import datetime
from typing import Any

from drs_operator.api import names
from drs_operator.api.status import DisaggReplicaSetStatus
from drs_operator.conditions import status_dict, weights_status
from drs_operator.manifests import desired_children
from drs_operator.manifests.engines import WEIGHTS_VOLUME
from drs_operator.rollout import compute_actions
from drs_protocol import env
from drs_protocol.weights_digest import digest_bytes
from drs_protocol.weights_state import DesiredWeights, parse_desired_weights
from drs_protocol.weights_stream import WEIGHTS_MOUNT_PATH, WeightsPeers
from operator_fixtures import OWNER, as_live, build, spec

T0 = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.UTC)
STEP = DesiredWeights(version="step-7", path="/ckpt/step-7", digest=digest_bytes(b"step 7"))


def test_every_engine_pod_reads_the_desired_weights_from_the_weights_configmap() -> None:
    s = spec()
    p, placement, children = build(s)
    weights = children.all_of("ConfigMap")[names.weights_config_name(OWNER.name)]
    assert weights["data"] == {env.DESIRED_WEIGHTS_KEY: ""}, "a fleet that never had a refit: none"
    pods = children.all_of("Pod")
    assert pods
    for pod in pods.values():
        refs = [e for e in pod["spec"]["containers"][0]["env"] if e["name"] == env.DESIRED_WEIGHTS_JSON]
        assert refs == [
            {
                "name": env.DESIRED_WEIGHTS_JSON,
                "valueFrom": {
                    "configMapKeyRef": {
                        "name": names.weights_config_name(OWNER.name),
                        "key": env.DESIRED_WEIGHTS_KEY,
                        "optional": True,
                    }
                },
            }
        ]
    with_desired = desired_children(OWNER, s, p, placement, {}, STEP)
    stored = with_desired.all_of("ConfigMap")[names.weights_config_name(OWNER.name)]["data"][env.DESIRED_WEIGHTS_KEY]
    assert parse_desired_weights(stored) == STEP


def test_new_desired_weights_replace_the_configmap_and_roll_no_pod() -> None:
    s = spec()
    p, placement, before = build(s)
    live = as_live(before, ready=True)
    after = desired_children(OWNER, s, p, placement, {}, STEP)
    actions = compute_actions(after, live, set(), [r.index for r in p.replicas]).actions
    assert [(a.verb, a.kind, a.name) for a in actions] == [
        ("replace", "ConfigMap", names.weights_config_name(OWNER.name))
    ]


def test_status_shows_the_desired_weights_beside_the_served_version() -> None:
    shown = weights_status(None, None, STEP, T0)
    assert shown is not None and shown.version is None
    assert shown.desired is not None and (shown.desired.version, shown.desired.path, shown.desired.digest) == (
        STEP.version,
        STEP.path,
        STEP.digest,
    )
    served = weights_status(shown, "step-7", STEP, T0 + datetime.timedelta(seconds=3))
    assert served is not None and served.version == "step-7" and served.desired == shown.desired
    assert weights_status(served, "step-7", STEP, T0 + datetime.timedelta(seconds=9)) == served, "stable"
    assert weights_status(served, "step-7", None, T0) == served, "kept when the annotation is gone"


def test_status_shows_the_refits_cut_over_as_a_utc_time_to_the_microsecond() -> None:
    at = T0.timestamp() + 0.123456
    cut_over = STEP.model_copy(update={"effective_at": at})
    shown = weights_status(None, None, cut_over, T0)
    assert shown is not None and shown.desired is not None
    assert shown.desired.effective_at == datetime.datetime(2026, 12, 1, 12, 0, 0, 123456, tzinfo=datetime.UTC)
    stored = status_dict(DisaggReplicaSetStatus(weights=shown))["weights"]["desired"]
    assert stored["effectiveAt"] == "2026-12-01T12:00:00.123456Z", stored
    assert datetime.datetime.fromisoformat(stored["effectiveAt"]).timestamp() == at
    assert (
        "effectiveAt"
        not in status_dict(DisaggReplicaSetStatus(weights=weights_status(None, None, STEP, T0)))["weights"]["desired"]
    ), "an older sidecar's desired weights have no cut-over"
    later = weights_status(shown, None, STEP.model_copy(update={"effective_at": at + 7}), T0)
    assert later is not None and later.desired is not None
    assert later.desired.effective_at == shown.desired.effective_at + datetime.timedelta(seconds=7), "a new refit's"
    edited = weights_status(None, None, STEP.model_copy(update={"effective_at": 1e300}), T0)
    assert edited is not None and edited.desired is not None and edited.desired.effective_at is None, (
        "a cut-over no clock reaches (a hand-edited annotation) is left out, the status still written"
    )


def test_unreadable_desired_weights_are_none() -> None:
    assert parse_desired_weights(None) is None
    assert parse_desired_weights("") is None
    assert parse_desired_weights("{not json") is None
    assert parse_desired_weights('{"version": " padded "}') is None
    assert parse_desired_weights('{"version": "v", "digest": "sha256:0"}') is None
    assert parse_desired_weights(STEP.dump()) == STEP


def test_pathless_desired_weights_give_the_engines_the_fleets_engines_to_catch_up_from() -> None:
    """After a broadcast or CUDA IPC refit (no path) the weights ConfigMap lists every placed
    engine's URL under ``peers`` (the engine pods read it as ``DRS_WEIGHTS_PEERS_JSON``); with a
    path, or none desired, it lists none."""
    pathless = DesiredWeights(version="step-2", digest="wd1:" + "a" * 64)
    s = spec()
    p, placement, _ = build(s)

    def _children(desired: DesiredWeights) -> Any:
        return desired_children(OWNER, s, p, placement, {}, desired)

    data = _children(pathless).all_of("ConfigMap")[names.weights_config_name(OWNER.name)]["data"]
    peers = WeightsPeers.model_validate_json(data[env.WEIGHTS_PEERS_KEY]).root
    pods = _children(pathless).all_of("Pod")
    assert len(peers) == len(pods) > 1 and all(url.startswith("http://") for url in peers)
    with_path = DesiredWeights(version="step-2", path="/ckpt/step-2")
    assert (
        env.WEIGHTS_PEERS_KEY
        not in _children(with_path).all_of("ConfigMap")[names.weights_config_name(OWNER.name)]["data"]
    )
    pod = next(iter(pods.values()))
    refs = {e["name"]: e.get("valueFrom", {}).get("configMapKeyRef") for e in pod["spec"]["containers"][0]["env"]}
    assert refs[env.WEIGHTS_PEERS_JSON] == {
        "name": names.weights_config_name(OWNER.name),
        "key": env.WEIGHTS_PEERS_KEY,
        "optional": True,
    }


def test_every_engine_pod_mounts_the_weights_configmap_where_its_env_says() -> None:
    """The peers' file is re-read on every catch-up attempt (peers placed after the pod started)."""
    _, _, children = build(spec())
    pods = children.all_of("Pod")
    assert pods
    for pod in pods.values():
        container = pod["spec"]["containers"][0]
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        values = {e["name"]: e.get("value") for e in container["env"]}
        assert volumes[WEIGHTS_VOLUME] == {
            "name": WEIGHTS_VOLUME,
            "configMap": {"name": names.weights_config_name(OWNER.name), "optional": True},
        }
        assert mounts[WEIGHTS_VOLUME] == {"name": WEIGHTS_VOLUME, "mountPath": WEIGHTS_MOUNT_PATH, "readOnly": True}
        assert values[env.WEIGHTS_DIR] == WEIGHTS_MOUNT_PATH
