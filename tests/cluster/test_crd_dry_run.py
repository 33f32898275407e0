"""The generated CRD against the real kube-apiserver: accepted, examples valid, CEL rules enforced.

Every CEL rule of ``drs_operator.api.rules`` is exercised here with an object that breaks it and
must be rejected with the rule's own message (the same words ``drs plan`` prints); the examples
must pass server-side dry runs and come back with the schema's defaults filled in.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from drs_devcluster.testing import RunningCluster
from drs_operator.api import DisaggReplicaSetSpec, rules
from drs_operator.api.constants import CRD_NAME, Phase
from drs_operator.api.status import DisaggReplicaSetStatus
from drs_operator.layout import replica_statuses
from drs_operator.placement import NodeInfo, place
from drs_operator.plan import plan

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "disagg.dev_disaggreplicasets.yaml"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
REFERENCE = yaml.safe_load((REPO / "examples" / "reference.yaml").read_text())


@pytest.fixture(scope="module")
def crd(devcluster: RunningCluster) -> Iterator[None]:
    """The CRD, applied once (left installed: other tests of the session use it too)."""
    devcluster.kubectl("apply", "-f", str(CRD_FILE))
    devcluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{CRD_NAME}")
    yield


def apply(devcluster: RunningCluster, namespace: str, obj: dict[str, Any], dry_run: bool = True) -> Any:
    args = ["apply", "-n", namespace, "-f", "-", "-o", "json"]
    if dry_run:
        args.insert(1, "--dry-run=server")
    return devcluster.kubectl(*args, input=json.dumps(obj), check=False)


def test_the_apiserver_accepts_the_crd_and_serves_it(devcluster: RunningCluster, crd: None) -> None:
    got = json.loads(devcluster.kubectl("get", "crd", CRD_NAME, "-o", "json").stdout)
    conditions = {c["type"]: c["status"] for c in got["status"]["conditions"]}
    assert conditions.get("Established") == "True" and conditions.get("NamesAccepted") == "True"
    assert got["status"]["acceptedNames"]["shortNames"] == ["drs"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: f"example {p.name} passes a server-side dry run")
def test_examples_are_accepted(devcluster: RunningCluster, crd: None, namespace: str, path: Path) -> None:
    obj = yaml.safe_load(path.read_text())
    out = apply(devcluster, namespace, obj)
    assert out.returncode == 0, out.stderr
    stored = json.loads(out.stdout)
    assert stored["spec"]["router"]["maxSessions"] == 100000, "nested defaults apply inside a defaulted block"
    assert stored["spec"]["images"]["engine"] == obj["spec"]["images"]["engine"]
    if "kwargs" in obj["spec"].get("trtllm", {}):
        assert stored["spec"]["trtllm"]["kwargs"] == obj["spec"]["trtllm"]["kwargs"], "free-form kwargs survive pruning"


def test_a_minimal_object_gets_every_block_defaulted(devcluster: RunningCluster, crd: None, namespace: str) -> None:
    obj = {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggReplicaSet",
        "metadata": {"name": "mini"},
        "spec": {"replicas": 1, "model": {"path": "/m"}},
    }
    out = apply(devcluster, namespace, obj)
    assert out.returncode == 0, out.stderr
    spec = json.loads(out.stdout)["spec"]
    assert spec["prefill"] == {"engines": 1, "tensorParallelSize": 1}
    assert spec["frontend"]["basePort"] == 8300 and spec["trtllm"]["enginePort"] == 8000
    assert spec["network"] == {"hostNetwork": False} and spec["engine"]["backend"] == "trtllm"


def mutate(changes: Callable[[dict[str, Any]], None], name: str = "reference") -> dict[str, Any]:
    obj: dict[str, Any] = copy.deepcopy(REFERENCE)
    obj["metadata"]["name"] = name
    changes(obj["spec"])
    return obj


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(spec: dict[str, Any]) -> None:
        node = spec
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value

    return change


def _all(*changes: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def change(spec: dict[str, Any]) -> None:
        for c in changes:
            c(spec)

    return change


REJECTED = [
    ("a prefill MoE split of 2 x 1 for TP4", _set("prefill.moeExpertParallelSize", 1), rules.MSG_MOE_SPLIT),
    (
        "a decode MoE TP of 3 for TP2",
        _all(_set("decode.moeTensorParallelSize", 3), _set("decode.moeExpertParallelSize", None)),
        rules.MSG_MOE_TP_DIVIDES,
    ),
    (
        "a decode MoE EP of 3 for TP2",
        _all(_set("decode.moeExpertParallelSize", 3), _set("decode.moeTensorParallelSize", None)),
        rules.MSG_MOE_EP_DIVIDES,
    ),
    ("precision in a role", _set("prefill.precision", "bfloat16"), rules.MSG_ROLE_PRECISION),
    ("maxModelLen in a role", _set("decode.maxModelLen", 4096), rules.MSG_ROLE_MAX_MODEL_LEN),
    ("parsers in a role", _set("decode.parsers", {"tool": "qwen3"}), rules.MSG_ROLE_PARSERS),
    ("both replicas and inferenceGPUs", _set("inferenceGPUs", 16), rules.MSG_REPLICAS_XOR),
    ("neither replicas nor inferenceGPUs", _set("replicas", None), rules.MSG_REPLICAS_XOR),
    (
        "inferenceGPUs 20 for width 8",
        _all(_set("replicas", None), _set("inferenceGPUs", 20)),
        rules.MSG_INFERENCE_GPUS_DIVISIBLE,
    ),
    (
        "N x F = 257",
        _all(_set("replicas", None), _set("inferenceGPUs", 257 * 8), _set("frontend.workers", 1)),
        rules.MSG_FRONTEND_COUNT,
    ),
    ("frontend ports beyond 65535", _set("frontend.basePort", 65533), rules.MSG_FRONTEND_PORT_RANGE),
    ("the engine port among the frontend ports", _set("trtllm.enginePort", 8301), rules.MSG_ENGINE_PORT_COLLISION),
    (
        "host-network engine ports beyond 65535",
        _all(_set("network.hostNetwork", True), _set("trtllm.enginePort", 65533)),
        rules.MSG_ENGINE_PORT_RANGE,
    ),
    (
        "per-replica NetworkPolicies with host networking",
        _all(_set("network.hostNetwork", True), _set("networkPolicy", {"enabled": True})),
        rules.MSG_POLICY_HOST_NETWORK,
    ),
    (
        "both engine.sim and the deprecated engine.simOptions",
        _all(_set("engine.sim", {"speed": 0}), _set("engine.simOptions", {"speed": 0})),
        rules.MSG_SIM_OPTIONS_ALIAS,
    ),
    (
        "a standby frontend with host networking",
        _all(_set("network.hostNetwork", True), _set("frontend.standby", True)),
        rules.MSG_STANDBY_HOST_NETWORK,
    ),
    (
        "a sibling hold without group routing",
        _all(_set("frontend.groupRouting", False), _set("frontend.groupHoldSeconds", 5)),
        rules.MSG_GROUP_HOLD_ROUTING,
    ),
]


@pytest.mark.parametrize(("change", "message"), [r[1:] for r in REJECTED], ids=[f"rejects {r[0]}" for r in REJECTED])
def test_cel_rules_reject_with_their_message(
    devcluster: RunningCluster, crd: None, namespace: str, change: Callable[[dict[str, Any]], None], message: str
) -> None:
    out = apply(devcluster, namespace, mutate(change))
    assert out.returncode != 0, "the apiserver accepted an invalid object"
    assert message in out.stderr, out.stderr


@pytest.mark.parametrize(
    "name", ["a" * 41, "has.dot", "9starts-with-a-digit"], ids=lambda n: f"rejects the name {n[:12]}"
)
def test_the_name_rule(devcluster: RunningCluster, crd: None, namespace: str, name: str) -> None:
    out = apply(devcluster, namespace, mutate(lambda spec: None, name=name))
    assert out.returncode != 0 and rules.MSG_NAME in out.stderr, out.stderr


def test_every_cel_rule_is_exercised_here() -> None:
    covered = {r[2] for r in REJECTED} | {rules.MSG_NAME}
    assert {r.message for r in (*rules.ROLE_RULES, *rules.SPEC_RULES, *rules.RESOURCE_RULES)} <= covered
    assert {r.message for r in rules.ENGINE_RULES} <= covered


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (_set("engine.sim", {"speed": -1}), "spec.engine.sim.speed"),
        (_set("engine.sim", {"sped": 1}), "sped"),
        (_set("engine.torch", {"kvTransport": "nvlink"}), "spec.engine.torch.kvTransport"),
        (_set("frontend.groupHoldSeconds", 601), "spec.frontend.groupHoldSeconds"),
        (_set("frontend.groupHoldSeconds", -1), "spec.frontend.groupHoldSeconds"),
        (_set("frontend.groupRouting", "yes"), "spec.frontend.groupRouting"),
    ],
    ids=[
        "rejects a negative engine.sim.speed",
        "rejects an unknown engine.sim field",
        "rejects an unknown kvTransport",
        "rejects a sibling hold over 600 s",
        "rejects a negative sibling hold",
        "rejects a groupRouting that is not a boolean",
    ],
)
def test_the_backend_options_are_typed_by_the_schema(
    devcluster: RunningCluster, crd: None, namespace: str, change: Callable[[dict[str, Any]], None], words: str
) -> None:
    out = apply(devcluster, namespace, mutate(change))
    assert out.returncode != 0 and words in out.stderr, out.stderr


def test_backend_options_get_the_engines_defaults_and_sim_options_stay_free_form(
    devcluster: RunningCluster, crd: None, namespace: str
) -> None:
    out = apply(devcluster, namespace, mutate(_all(_set("engine.sim", {"speed": 0}), _set("engine.torch", {}))))
    assert out.returncode == 0, out.stderr
    engine = json.loads(out.stdout)["spec"]["engine"]
    assert engine["sim"]["speed"] == 0 and engine["sim"]["tokensPerBlock"] == 32
    assert engine["torch"]["kvTransport"] == "auto"
    old = apply(devcluster, namespace, mutate(_set("engine.simOptions", {"speed": "fast", "anything": 1})))
    assert old.returncode == 0, "the deprecated simOptions is accepted as before (the operator reports Valid=False)"


def test_unknown_fields_outside_free_form_blocks_are_refused(
    devcluster: RunningCluster, crd: None, namespace: str
) -> None:
    out = apply(devcluster, namespace, mutate(_set("frontend.tokenise", True)))
    assert out.returncode != 0 and "tokenise" in out.stderr


def test_status_scale_and_printer_columns(devcluster: RunningCluster, crd: None, namespace: str) -> None:
    obj = mutate(lambda spec: None, name="live")
    out = apply(devcluster, namespace, obj, dry_run=False)
    assert out.returncode == 0, out.stderr

    layout = plan(DisaggReplicaSetSpec.model_validate(obj["spec"]), "live")
    placement = place(layout, [NodeInfo(f"hgx-{i:03d}", 8, 8, f"hgx-{i:03d}") for i in range(2)])
    status = DisaggReplicaSetStatus(
        replicas=2,
        ready_replicas=0,
        gpus=layout.gpus,
        phase=Phase.PENDING,
        selector="disagg.dev/replicaset=live",
        replica_statuses=replica_statuses(layout, placement, namespace, {}),
        urls=[f"http://live-r{r}-f{f}.{namespace}.svc:{8300 + 2 * r + f}" for r in (0, 1) for f in (0, 1)],
    )
    body = {"status": status.model_dump(mode="json", exclude_none=True)}
    devcluster.kubectl(
        "patch", "drs", "live", "-n", namespace, "--subresource=status", "--type=merge", "-p", json.dumps(body)
    )
    stored = json.loads(devcluster.kubectl("get", "drs", "live", "-n", namespace, "-o", "json").stdout)
    assert DisaggReplicaSetStatus.model_validate(stored["status"]) == status

    table = devcluster.kubectl("get", "drs", "-n", namespace).stdout.splitlines()
    assert table[0].split() == ["NAME", "REPLICAS", "READY", "GPUS", "PHASE", "WEIGHTS", "AGE"]
    assert table[1].split()[:5] == ["live", "2", "0", "16", "Pending"]

    devcluster.kubectl("scale", "drs", "live", "-n", namespace, "--replicas=3")
    scaled = json.loads(devcluster.kubectl("get", "drs", "live", "-n", namespace, "-o", "json").stdout)
    assert scaled["spec"]["replicas"] == 3


def test_group_routing_is_defaulted_and_a_hold_with_it_accepted(
    devcluster: RunningCluster, crd: None, namespace: str
) -> None:
    out = apply(devcluster, namespace, mutate(_set("frontend.groupHoldSeconds", 2.5)))
    assert out.returncode == 0, out.stderr
    frontend = json.loads(out.stdout)["spec"]["frontend"]
    assert frontend["groupRouting"] is True and frontend["groupHoldSeconds"] == 2.5
    off = apply(
        devcluster, namespace, mutate(_all(_set("frontend.groupRouting", False), _set("frontend.groupHoldSeconds", 0)))
    )
    assert off.returncode == 0, off.stderr
