"""Engine authentication on the kwok dev cluster: a fleet serves with it on; a pod without the token is refused.

The operator creates the fleet's ``<name>-serving`` and ``<name>-control`` Secrets (owned by the
DisaggReplicaSet, distinct random tokens); its engine and frontend pods mount the Secrets (the
pod runner projects them as a kubelet would), so a turn through the
status URL is served; the engines refuse a direct call without the token (401 naming the realm)
and serve one with it; ``/health`` stays open. Two hand-made frontend pods in front of the same
engines, one without the token and one with the Secret's: the first answers every turn 502
naming the refused credential, the second serves.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from drs_devcluster.testing import RunningCluster
from drs_operator.kube.engines import secret_token
from operator_harness import (
    CHAT_BODY,
    OperatorProcess,
    apply,
    auth_fleet,
    free_port,
    get_json,
    serving_fleet,
    wait_for,
)
from operator_harness import http_call as call

pytestmark = pytest.mark.cluster

NAME = "authd"
NODE = "hgx-001"


def hand_made_frontend(name: str, port: int, prefill: str, decode: str, with_token: bool) -> dict[str, Any]:
    env: list[dict[str, Any]] = []
    if with_token:
        env = [
            {
                "name": "DRS_SERVING_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": f"{NAME}-serving", "key": "token"}},
            }
        ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeName": NODE,
            "hostNetwork": True,
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "frontend",
                    "image": "drs:dev",
                    "command": ["drs", "frontend"],
                    "args": ["--host", "$(DRS_NODE_IP)", "--port", str(port), "--prefill", prefill, "--decode", decode],
                    "env": env,
                }
            ],
        },
    }


def ready_url(devcluster: RunningCluster, namespace: str, pod: str, port: int) -> str:
    def url() -> str | None:
        ip = (get_json(devcluster, "pod", "-n", namespace, pod).get("status") or {}).get("hostIP")
        if not ip:
            return None
        try:
            return f"http://{ip}:{port}" if call(f"http://{ip}:{port}/ready")[0] == 200 else None
        except OSError:
            return None

    found: str = wait_for(f"{pod} to serve /ready", url, timeout=90)
    return found


def test_a_fleet_serves_with_engine_auth_on_and_a_pod_without_the_token_is_refused(
    devcluster: RunningCluster, namespace: str, stack: OperatorProcess
) -> None:
    status, url = serving_fleet(devcluster, namespace, auth_fleet(NAME, base_port=18500, engine_port=18100))

    secrets = {s["metadata"]["name"]: s for s in get_json(devcluster, "secrets", "-n", namespace)["items"]}
    serving, control = secret_token(secrets, f"{NAME}-serving"), secret_token(secrets, f"{NAME}-control")
    assert serving and control and serving != control
    for name in (f"{NAME}-serving", f"{NAME}-control"):
        (owner,) = secrets[name]["metadata"]["ownerReferences"]
        assert owner["kind"] == "DisaggReplicaSet" and owner["name"] == NAME
    assert serving not in json.dumps(get_json(devcluster, "configmaps", "-n", namespace))
    assert serving not in json.dumps(status)

    code, _, text = call(f"{url}/v1/chat/completions", CHAT_BODY)
    assert code == 200, text

    engines = {e["role"]: e["url"] for e in status["replicaStatuses"][0]["engines"]}
    prefill, decode = engines["prefill"], engines["decode"]
    code, headers, text = call(f"{prefill}/v1/chat/completions", CHAT_BODY)
    assert code == 401, text
    assert headers.get("www-authenticate") == 'Bearer realm="drs-serving"'
    assert call(f"{prefill}/v1/chat/completions", CHAT_BODY, token=control)[0] == 401
    assert call(f"{prefill}/v1/chat/completions", CHAT_BODY, token=serving)[0] == 200
    assert call(f"{decode}/health")[0] == 200

    bare_port, token_port = free_port(), free_port()
    apply(devcluster, namespace, hand_made_frontend("bare", bare_port, prefill, decode, with_token=False))
    apply(devcluster, namespace, hand_made_frontend("holder", token_port, prefill, decode, with_token=True))
    bare = ready_url(devcluster, namespace, "bare", bare_port)  # ready: /health is open
    holder = ready_url(devcluster, namespace, "holder", token_port)
    code, _, text = call(f"{bare}/v1/chat/completions", CHAT_BODY)
    assert code == 502 and "refused this frontend's serving token (401)" in text, text
    code, _, text = call(f"{holder}/v1/chat/completions", CHAT_BODY)
    assert code == 200, text
