"""The fleet's two token Secrets and the pods that read them (``drs_operator.manifests.secrets``).

Pure: the Secrets are owned by the fleet and hold a fresh random token each; only the missing
ones are created; every engine pod mounts both token Secrets and every frontend pod the serving
one (never a literal value, and no ConfigMap holds a token); the operator's one reader of a live
Secret reads either.
"""

from __future__ import annotations

import base64
import datetime
import json
from typing import Any

from drs_operator.api import names
from drs_operator.api.constants import EventReason, EventType
from drs_operator.kube.engines import control_token, secret_token, serving_token
from drs_operator.manifests.secrets import build_serving_secret, missing_secrets, reader_urls, secret_notes
from drs_protocol import auth, env
from operator_fixtures import OWNER, build, spec

NOW = datetime.datetime(2026, 12, 5, 16, 0, tzinfo=datetime.UTC)


def missing(live: dict[str, Any], pods: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return missing_secrets(OWNER, live, pods or {}, None, NOW)


def _env(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    pod_spec = manifest["spec"]["template"]["spec"] if manifest["kind"] == "Deployment" else manifest["spec"]
    return list(pod_spec["containers"][0]["env"])


def test_both_secrets_are_owned_by_the_fleet_and_hold_distinct_random_tokens() -> None:
    control, serving = missing({})
    assert [control["metadata"]["name"], serving["metadata"]["name"]] == ["fleet-control", "fleet-serving"]
    for secret in (control, serving):
        (ref,) = secret["metadata"]["ownerReferences"]
        assert ref["uid"] == OWNER.uid and ref["kind"] == "DisaggReplicaSet"
        assert len(secret["stringData"][env.TOKEN_SECRET_KEY]) == 64
    assert control["stringData"] != serving["stringData"]
    again = missing({})
    assert again[1]["stringData"] != serving["stringData"]  # fresh each time: never derived


def test_only_the_missing_secret_is_created_so_an_upgraded_fleet_keeps_its_control_token() -> None:
    live = {"fleet-control": {"data": {"token": base64.b64encode(b"kept").decode()}}}
    (created,) = missing(live)
    assert created["metadata"]["name"] == names.serving_secret_name("fleet")
    both = {**live, "fleet-serving": build_serving_secret(OWNER, "s")}
    assert missing(both) == []


def _pod_spec(manifest: dict[str, Any]) -> dict[str, Any]:
    return dict(manifest["spec"]["template"]["spec"] if manifest["kind"] == "Deployment" else manifest["spec"])


def test_every_engine_pod_mounts_both_token_secrets_and_every_frontend_the_serving_one() -> None:
    _, _, children = build(spec(frontend={"standby": True}))
    pods, deployments = children.all_of("Pod"), children.all_of("Deployment")
    assert pods and deployments
    dirs = {env.CONTROL_TOKEN_DIR: auth.CONTROL_TOKEN_DIR, env.SERVING_TOKEN_DIR: auth.SERVING_TOKEN_DIR}
    secret_of = {auth.CONTROL_TOKEN_DIR: "fleet-control", auth.SERVING_TOKEN_DIR: "fleet-serving"}
    for manifest, wanted in [
        *((p, dirs) for p in pods.values()),
        *((d, {env.SERVING_TOKEN_DIR: auth.SERVING_TOKEN_DIR}) for d in deployments.values()),
    ]:
        pod_spec = _pod_spec(manifest)
        by_name = {e["name"]: e for e in _env(manifest)}
        volumes = {v["name"]: v for v in pod_spec["volumes"]}
        mounts = {m["mountPath"]: m for m in pod_spec["containers"][0]["volumeMounts"]}
        for variable, path in wanted.items():
            assert by_name[variable] == {"name": variable, "value": path}
            assert mounts[path]["readOnly"] is True
            assert volumes[mounts[path]["name"]] == {
                "name": mounts[path]["name"],
                "secret": {"secretName": secret_of[path]},
            }
        assert env.SERVING_TOKEN not in by_name and env.CONTROL_TOKEN not in by_name  # no token in env
        if manifest["kind"] == "Deployment":
            assert env.CONTROL_TOKEN_DIR not in by_name  # a frontend never calls the control API


def test_no_configmap_holds_a_token() -> None:
    _, _, children = build(spec())
    token = build_serving_secret(OWNER)["stringData"]["token"]
    rendered = json.dumps(children.all_of("ConfigMap"))
    assert token not in rendered and "stringData" not in rendered


def test_the_one_reader_reads_either_token_from_the_live_secrets() -> None:
    live = {
        "fleet-control": {"data": {"token": base64.b64encode(b"c-token").decode()}},
        "fleet-serving": {"data": {"token": base64.b64encode(b"s-token").decode()}},
        "broken-serving": {"data": {"token": "%%%"}},
    }
    assert control_token(live, "fleet") == "c-token" and serving_token(live, "fleet") == "s-token"
    assert secret_token(live, "broken-serving") is None and serving_token(live, "other") is None


def test_a_secret_created_first_is_a_normal_event_and_one_deleted_under_running_pods_a_warning_naming_them() -> None:
    _, _, children = build(spec())
    pods = children.all_of("Pod")
    (serving,) = missing({"fleet-control": {}})
    (first,) = secret_notes([serving], {})
    assert (first.type, first.reason, first.message) == (
        EventType.NORMAL,
        EventReason.TOKEN_SECRET_CREATED,
        "created Secret fleet-serving",
    )
    (again,) = secret_notes([serving], pods)
    assert again.type is EventType.WARNING and again.reason is EventReason.TOKEN_SECRET_RECREATED
    assert f"while {len(pods)} pod(s) that read it run" in again.message and "and " in again.message
    assert serving["stringData"]["token"] not in again.message
    older: dict[str, Any] = {
        name: {"spec": {"containers": [{"env": []}]}} for name in pods
    }  # pods from before the Secret
    assert secret_notes([serving], older)[0].type is EventType.NORMAL


def test_a_secret_deleted_under_running_pods_is_recreated_as_the_first_phase_of_a_rotation() -> None:
    _, _, children = build(spec())
    (serving,) = missing({"fleet-control": {}}, children.all_of("Pod"))
    assert set(serving["stringData"]) == {"next", "generation"}  # the pods keep presenting the token they hold
    assert serving["metadata"]["annotations"]["disagg.dev/token-rotation-phase"] == "next"
    (fresh,) = missing({"fleet-control": {}})
    assert set(fresh["stringData"]) == {"token"} and "annotations" not in fresh["metadata"]


def test_the_readers_of_a_secret_are_asked_at_their_health_probe_address() -> None:
    _, _, children = build(spec())
    pods = {name: {**pod, "status": {"podIP": "10.1.0.7"}} for name, pod in children.all_of("Pod").items()}
    pods["no-address-yet"] = {**next(iter(children.all_of("Pod").values())), "status": {}}
    for name, dep in children.all_of("Deployment").items():  # a frontend pod as its ReplicaSet makes it
        pods[f"{name}-abc12"] = {"spec": dep["spec"]["template"]["spec"], "status": {"podIP": "10.1.0.9"}}
    serving = reader_urls(pods, names.serving_secret_name(OWNER.name))
    control = reader_urls(pods, names.control_secret_name(OWNER.name))
    frontends = {n for n in serving if n.endswith("-abc12")}
    assert frontends and not frontends & set(control), "frontends read the serving token only"
    assert set(serving) - frontends == set(control) == set(pods) - {f"{n}-abc12" for n in children.all_of("Deployment")}
    assert serving["no-address-yet"] is None
    engine = next(n for n in control if n != "no-address-yet")
    probe = pods[engine]["spec"]["containers"][0]["readinessProbe"]["httpGet"]
    assert serving[engine] == control[engine] == f"http://10.1.0.7:{probe['port']}"
    assert all((serving[n] or "").startswith("http://10.1.0.9:") for n in frontends)
