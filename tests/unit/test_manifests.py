"""Child manifests: what every engine pod and frontend must carry, built without a cluster."""

from __future__ import annotations

import json
from typing import Any

import pytest
from drs_devcluster.profiles import build_nodes
from drs_operator.api import names
from drs_operator.manifests.common import CONFIG_KEY, SPEC_HASH_ANNOTATION, spec_hash
from drs_operator.nodepool import nodes_from_manifests
from operator_fixtures import OWNER, build, spec


def pinned_node(pod: dict[str, Any]) -> str:
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    node: str = terms[0]["matchFields"][0]["values"][0]
    return node


def test_engine_pods_are_pinned_sized_probed_owned_and_labelled() -> None:
    _, placement, children = build(spec())
    pods = children.all_of("Pod")
    assert sorted(pods) == sorted(
        f"fleet-r{r}-{role}-{o}"
        for r in range(2)
        for role, count in (("prefill", 1), ("decode", 2))
        for o in range(count)
    )
    for rp in placement.replicas:
        for e in rp.engines:
            pod = pods[e.name]
            assert pinned_node(pod) == e.node
            c = pod["spec"]["containers"][0]
            assert c["resources"]["limits"]["nvidia.com/gpu"] == str(e.width)
            assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
            assert pod["metadata"]["ownerReferences"][0] == OWNER.reference()
            labels = pod["metadata"]["labels"]
            assert labels["disagg.dev/replicaset"] == "fleet"
            assert labels["disagg.dev/replica"] == str(rp.index)
            assert labels["disagg.dev/role"] == e.role
            assert labels["app.kubernetes.io/managed-by"] == "drs-operator"
            assert pod["spec"]["hostname"] == e.name and pod["spec"]["subdomain"] == "fleet-engines"
            assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["spec"]["volumes"]


def test_engine_config_carries_the_merged_trtllm_kwargs_of_its_role() -> None:
    s = spec(
        trtllm={
            "kwargs": {"cache_transceiver_config": {"backend": "NIXL"}, "kv_cache_config": {"enable_block_reuse": True}}
        },
        decode={"engines": 2, "tensorParallelSize": 2, "trtllmKwargs": {"kv_cache_config": {"dtype": "fp8"}}},
    )
    _, _, children = build(s)
    config = json.loads(children.all_of("ConfigMap")[names.engine_config_name("fleet", "decode")]["data"][CONFIG_KEY])
    assert config["role"] == "decode"
    assert config["cacheTransceiver"] == {"backend": "NIXL"}
    assert config["trtllmKwargs"]["kv_cache_config"] == {"enable_block_reuse": True, "dtype": "fp8"}
    prefill = json.loads(children.all_of("ConfigMap")[names.engine_config_name("fleet", "prefill")]["data"][CONFIG_KEY])
    assert prefill["trtllmKwargs"]["kv_cache_config"] == {"enable_block_reuse": True}


def test_frontends_are_single_recreate_deployments_on_deterministic_ports_and_node_ids() -> None:
    _, placement, children = build(spec())
    deps = children.all_of("Deployment")
    for rp in placement.replicas:
        for f in rp.frontends:
            dep = deps[names.frontend_name("fleet", rp.index, f.index)]
            assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
            args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
            assert args[args.index("--port") + 1] == str(8300 + rp.index * 2 + f.index)
            assert args[args.index("--node-id") + 1] == str(rp.index * 2 + f.index)
            assert pinned_node(dep["spec"]["template"]) == rp.nodes[f.index % len(rp.nodes)]
            svc = children.all_of("Service")[dep["metadata"]["name"]]
            assert svc["spec"]["ports"][0]["port"] == 8300 + rp.index * 2 + f.index


def test_host_networking_uses_node_addresses_and_distinct_engine_ports() -> None:
    nodes = nodes_from_manifests(build_nodes("hgx", 2))
    _, placement, children = build(spec(network={"hostNetwork": True}), nodes)
    pods = children.all_of("Pod")
    assert len({p["spec"]["containers"][0]["ports"][0]["containerPort"] for p in pods.values()}) == len(pods)
    assert all(p["spec"]["hostNetwork"] for p in pods.values())
    address = {n.name: n.address for n in nodes}
    fe_config = json.loads(children.replicas[0].frontend_config["data"][CONFIG_KEY])
    assert all(
        url.startswith(f"http://{address[placement.replica(0).nodes[0]]}:")
        for url in fe_config["prefill"] + fe_config["decode"]
    )
    assert not children.services  # no headless Service without pod networking


def test_a_pod_template_overlay_adds_what_users_need_but_cannot_move_or_resize_an_engine() -> None:
    overlay = {
        "metadata": {"labels": {"team": "rl"}},
        "spec": {
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}},
            "containers": [
                {
                    "name": "engine",
                    "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                    "resources": {"limits": {"nvidia.com/gpu": "1", "rdma/ib": "1"}},
                }
            ],
        },
    }
    _, placement, children = build(spec(template=overlay))
    pod = children.all_of("Pod")["fleet-r0-prefill-0"]
    c = pod["spec"]["containers"][0]
    assert {"name": "NCCL_DEBUG", "value": "INFO"} in c["env"]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "4", "rdma/ib": "1"}
    assert pinned_node(pod) == placement.replica(0).engines[0].node
    assert pod["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["metadata"]["labels"]["team"] == "rl" and pod["metadata"]["labels"]["disagg.dev/replicaset"] == "fleet"


def test_the_spec_hash_is_stable_and_follows_only_what_changed() -> None:
    _, _, a = build(spec())
    _, _, b = build(spec())
    _, _, c = build(spec(decode={"engines": 2, "tensorParallelSize": 2, "gpuMemoryUtilization": 0.5}))
    pa, pb, pc = a.all_of("Pod"), b.all_of("Pod"), c.all_of("Pod")
    assert all(pa[n]["metadata"]["annotations"][SPEC_HASH_ANNOTATION] == spec_hash(pa[n]) for n in pa)
    assert {n: spec_hash(p) for n, p in pa.items()} == {n: spec_hash(p) for n, p in pb.items()}
    changed = {n for n in pa if spec_hash(pa[n]) != spec_hash(pc[n])}
    assert changed == {n for n in pa if "-decode-" in n}


@pytest.mark.parametrize("rank_count", [2])
def test_an_engine_wider_than_a_node_is_one_pod_per_node_with_rank_environment(rank_count: int) -> None:
    nodes = nodes_from_manifests(build_nodes("gb200", 18))  # 4-GPU nodes, one clique
    s = spec(
        replicas=1, prefill={"engines": 1, "tensorParallelSize": 8}, decode={"engines": 1, "tensorParallelSize": 4}
    )
    _, placement, children = build(s, nodes)
    pods = children.all_of("Pod")
    group = [pods["fleet-r0-prefill-0"], pods["fleet-r0-prefill-0-w1"]]
    engine = placement.replica(0).engines[0]
    assert [pinned_node(p) for p in group] == list(engine.nodes)
    for rank, pod in enumerate(group):
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["DRS_RANK"] == str(rank) and env["DRS_WORLD_SIZE"] == str(rank_count)
        assert env["DRS_LEADER_ADDRESS"] == "fleet-r0-prefill-0.fleet-engines.ns.svc"
        assert env["DRS_RAY_PORT"] == "6379" and env["DRS_RANK_GPUS"] == "4"
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
        assert pod["spec"]["hostname"] == pod["metadata"]["name"] and pod["spec"]["subdomain"] == "fleet-engines"
    decode_env = {e["name"]: e.get("value") for e in pods["fleet-r0-decode-0"]["spec"]["containers"][0]["env"]}
    assert decode_env["DRS_WORLD_SIZE"] == "1" and "DRS_RAY_PORT" not in decode_env


def test_with_host_networking_a_gangs_leader_is_its_nodes_address_and_its_ray_port_follows_the_engine_port() -> None:
    nodes = nodes_from_manifests(build_nodes("gb200", 18))
    s = spec(
        replicas=1,
        prefill={"engines": 1, "tensorParallelSize": 4},
        decode={"engines": 1, "tensorParallelSize": 8},
        network={"hostNetwork": True},
        trtllm={"enginePort": 9000},
    )
    _, placement, children = build(s, nodes)
    wide = next(e for e in placement.replica(0).engines if e.width == 8)
    leader_ip = next(n.address for n in nodes if n.name == wide.nodes[0])
    for rank in range(2):
        pod = children.all_of("Pod")[names.engine_pod_name("fleet", 0, "decode", 0, rank)]
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["DRS_LEADER_ADDRESS"] == leader_ip
        assert env["DRS_RAY_PORT"] == "10001"  # engine port 9001 (slot 1) + 1000


@pytest.mark.parametrize("continuity", [None, False], ids=["default", "off"])
def test_token_continuity_is_rendered_into_a_frontend_config_the_frontend_accepts(continuity: bool | None) -> None:
    from drs_frontend.config import FrontendConfig

    frontend = {} if continuity is None else {"tokenContinuity": continuity}
    _, _, children = build(spec(frontend=frontend), nodes_from_manifests(build_nodes("hgx", 2)))
    rendered = json.loads(children.replicas[0].frontend_config["data"][CONFIG_KEY])
    config = FrontendConfig.model_validate({**rendered, "port": 8300, "node_id": 0})
    assert config.token_continuity is (continuity is None)


@pytest.mark.parametrize(
    ("frontend", "routing", "hold"),
    [
        ({}, True, 30.0),
        ({"groupRouting": False}, False, 0.0),
        ({"groupHoldSeconds": 2.5}, True, 2.5),
        ({"groupHoldSeconds": 0}, True, 0.0),
        ({"groupRouting": False, "groupHoldSeconds": 0}, False, 0.0),
    ],
    ids=["default", "off", "a shorter hold", "no holding", "off with no holding"],
)
def test_group_routing_is_rendered_into_a_frontend_config_the_frontend_accepts(
    frontend: dict[str, Any], routing: bool, hold: float
) -> None:
    from drs_frontend.config import FrontendConfig
    from drs_frontend.routing.factory import build_ctx_router

    _, _, children = build(spec(frontend=frontend), nodes_from_manifests(build_nodes("hgx", 2)))
    rendered = json.loads(children.replicas[0].frontend_config["data"][CONFIG_KEY])
    assert (rendered["groupRouting"], rendered["groupHoldSeconds"]) == (routing, hold)
    config = FrontendConfig.model_validate({**rendered, "port": 8300, "node_id": 0})
    assert (config.group_routing, config.group_hold_seconds) == (routing, hold)
    router = build_ctx_router(config)
    assert getattr(router, "groups", None) is routing


@pytest.mark.parametrize("lookup", [None, 0, 4])
def test_group_lookup_engines_is_rendered_into_the_frontend_config(lookup: int | None) -> None:
    """spec.frontend.groupLookupEngines reaches every frontend (unset: 4, the bounded walk with the
    lookup, since 2026-12-07; 0: the load-free rule), and the frontend's ctx router asks that many engines."""
    from drs_frontend.config import FrontendConfig
    from drs_frontend.routing.factory import build_ctx_router

    frontend = {} if lookup is None else {"groupLookupEngines": lookup}
    _, _, children = build(spec(frontend=frontend), nodes_from_manifests(build_nodes("hgx", 2)))
    rendered = json.loads(children.replicas[0].frontend_config["data"][CONFIG_KEY])
    expected = 4 if lookup is None else lookup
    assert rendered["groupLookupEngines"] == expected
    config = FrontendConfig.model_validate({**rendered, "port": 8300, "node_id": 0})
    assert config.group_lookup_engines == expected
    assert build_ctx_router(config).looks_up is bool(expected)


def test_engines_and_frontends_run_restricted_with_a_scratch_emptydir() -> None:
    """Non-root (the images' uid), read-only root filesystem, no capabilities, RuntimeDefault
    seccomp, /tmp an emptyDir; a real kubelet enforces it (tests/realnodes)."""
    _, _, children = build(spec())
    pod_specs = [p["spec"] for p in children.all_of("Pod").values()]
    pod_specs += [d["spec"]["template"]["spec"] for d in children.all_of("Deployment").values()]
    assert len(pod_specs) > 3
    for ps in pod_specs:
        assert ps["securityContext"]["runAsNonRoot"] is True and ps["securityContext"]["runAsUser"] == 10001
        assert ps["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        c = ps["containers"][0]
        assert c["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
        tmp = next(m for m in c["volumeMounts"] if m["mountPath"] == "/tmp")
        assert next(v for v in ps["volumes"] if v["name"] == tmp["name"]) == {"name": tmp["name"], "emptyDir": {}}


def test_a_frontend_is_not_killed_by_liveness_before_it_has_started() -> None:
    _, _, children = build(spec())
    for d in children.all_of("Deployment").values():
        c = d["spec"]["template"]["spec"]["containers"][0]
        startup, liveness = c["startupProbe"], c["livenessProbe"]
        assert startup["httpGet"] == liveness["httpGet"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # minutes, not 30 s
