"""The fleet's two token Secrets and the pods that read them (``drs_operator.manifests.secrets``).

Pure: the Secrets are owned by the fleet and hold a fresh random token each; only the missing
ones are created; every engine pod reads both tokens and every frontend pod the serving token
through ``secretKeyRef`` (never a literal value, and no ConfigMap holds a token); the operator's
one reader of a live Secret reads either.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from drs_operator.api import names
from drs_operator.api.constants import EventReason, EventType
from drs_operator.kube.engines import control_token, secret_token, serving_token
from drs_operator.manifests.secrets import build_serving_secret, missing_secrets, secret_notes
from drs_protocol import env
from operator_fixtures import OWNER, build, spec


def _env(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    pod_spec = manifest["spec"]["template"]["spec"] if manifest["kind"] == "Deployment" else manifest["spec"]
    return list(pod_spec["containers"][0]["env"])


def test_both_secrets_are_owned_by_the_fleet_and_hold_distinct_random_tokens() -> None:
    control, serving = missing_secrets(OWNER, {})
    assert [control["metadata"]["name"], serving["metadata"]["name"]] == ["fleet-control", "fleet-serving"]
    for secret in (control, serving):
        (ref,) = secret["metadata"]["ownerReferences"]
        assert ref["uid"] == OWNER.uid and ref["kind"] == "DisaggReplicaSet"
        assert len(secret["stringData"][env.TOKEN_SECRET_KEY]) == 64
    assert control["stringData"] != serving["stringData"]
    again = missing_secrets(OWNER, {})
    assert again[1]["stringData"] != serving["stringData"]  # fresh each time: never derived


def test_only_the_missing_secret_is_created_so_an_upgraded_fleet_keeps_its_control_token() -> None:
    live = {"fleet-control": {"data": {"token": base64.b64encode(b"kept").decode()}}}
    (created,) = missing_secrets(OWNER, live)
    assert created["metadata"]["name"] == names.serving_secret_name("fleet")
    both = {**live, "fleet-serving": build_serving_secret(OWNER, "s")}
    assert missing_secrets(OWNER, both) == []


def test_every_engine_pod_reads_both_tokens_and_every_frontend_the_serving_token_from_the_secrets() -> None:
    _, _, children = build(spec(frontend={"standby": True}))
    pods, deployments = children.all_of("Pod"), children.all_of("Deployment")
    assert pods and deployments
    refs = {
        env.CONTROL_TOKEN: {"name": "fleet-control", "key": "token"},
        env.SERVING_TOKEN: {"name": "fleet-serving", "key": "token"},
    }
    for pod in pods.values():
        by_name = {e["name"]: e for e in _env(pod)}
        for variable, ref in refs.items():
            assert by_name[variable] == {"name": variable, "valueFrom": {"secretKeyRef": ref}}
    for deployment in deployments.values():
        by_name = {e["name"]: e for e in _env(deployment)}
        assert by_name[env.SERVING_TOKEN] == {
            "name": env.SERVING_TOKEN,
            "valueFrom": {"secretKeyRef": refs[env.SERVING_TOKEN]},
        }
        assert env.CONTROL_TOKEN not in by_name  # a frontend never calls the control API


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
    (serving,) = missing_secrets(OWNER, {"fleet-control": {}})
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
    older = {name: {"spec": {"containers": [{"env": []}]}} for name in pods}  # pods from before the Secret
    assert secret_notes([serving], older)[0].type is EventType.NORMAL
