"""The gang of an engine wider than a node, from its pod's environment, and its ``ray start`` lines."""

from __future__ import annotations

import json

import pytest
from drs_engine.config import build_config
from drs_engine.gang.shards import bundles
from drs_engine.gang.spec import (
    GangSpec,
    GangSpecError,
    for_gang,
    gang_from_env,
    head_argv,
    head_temp_dir,
    worker_argv,
)
from drs_protocol.gang import DEFAULT_RAY_PORT, parse_gang_report, rank_resource, ray_port_for

GANG = {
    "DRS_RANK": "1",
    "DRS_WORLD_SIZE": "4",
    "DRS_LEADER_ADDRESS": "wide-r0-prefill-0.wide-engines.ns.svc",
    "DRS_RAY_PORT": "6380",
    "DRS_RANK_GPUS": "4",
}


def test_one_pod_is_no_gang() -> None:
    assert gang_from_env({}) is None
    assert gang_from_env({"DRS_RANK": "0", "DRS_WORLD_SIZE": "1", "DRS_LEADER_ADDRESS": "x"}) is None


def test_a_gang_reads_every_variable() -> None:
    spec = gang_from_env(GANG)
    assert spec == GangSpec(
        rank=1, world_size=4, leader_address="wide-r0-prefill-0.wide-engines.ns.svc", ray_port=6380, rank_gpus=4
    )
    assert not spec.is_leader and spec.ray_address == "wide-r0-prefill-0.wide-engines.ns.svc:6380"
    default_port = gang_from_env({k: v for k, v in GANG.items() if k != "DRS_RAY_PORT"})
    assert default_port is not None and default_port.ray_port == DEFAULT_RAY_PORT


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"DRS_RANK": "4"}, "DRS_RANK=4 must be below DRS_WORLD_SIZE=4"),
        ({"DRS_RANK": ""}, "DRS_RANK is required"),
        ({"DRS_RANK": "one"}, "DRS_RANK must be an integer, got 'one'"),
        ({"DRS_LEADER_ADDRESS": " "}, "DRS_LEADER_ADDRESS must name the leader's address"),
        ({"DRS_RAY_PORT": "70000"}, "DRS_RAY_PORT=70000 must be at most 65535"),
        ({"DRS_RANK_GPUS": "0"}, "DRS_RANK_GPUS must be at least 1, got 0"),
        ({"DRS_WORLD_SIZE": "0"}, "DRS_WORLD_SIZE must be at least 1, got 0"),
    ],
)
def test_a_wrong_variable_is_named_with_its_rule(change: dict[str, str], message: str) -> None:
    with pytest.raises(GangSpecError, match=message):
        gang_from_env({**GANG, **change})


def test_ray_start_lines_bind_the_pods_address_and_declare_the_node_slice() -> None:
    spec = gang_from_env({**GANG, "DRS_RANK": "0"})
    assert spec is not None
    head = head_argv(spec, "127.0.1.1", head_temp_dir("127.0.1.1", 6380))
    assert head[1:4] == ["start", "--head", "--port=6380"]
    worker = worker_argv(gang_from_env(GANG) or spec, "127.0.1.2")
    assert worker[1:3] == ["start", "--address=wide-r0-prefill-0.wide-engines.ns.svc:6380"]
    for argv, host, rank in ((head, "127.0.1.1", 0), (worker, "127.0.1.2", 1)):
        assert "--block" in argv and f"--node-ip-address={host}" in argv
        assert "--num-gpus=4" in argv and "--disable-usage-stats" in argv and "--include-log-monitor=false" in argv
        resources = next(a for a in argv if a.startswith("--resources="))
        assert json.loads(resources.split("=", 1)[1]) == {rank_resource(rank): 1}
    assert "--include-dashboard=false" in head and not any(a.startswith("--temp-dir") for a in worker)
    assert len(str(head_temp_dir("127.255.255.255", 65535))) < 60  # Ray's Unix sockets live below it


def test_one_bundle_per_gpu_pinned_to_its_ranks_node() -> None:
    b = bundles(world_size=3, rank_gpus=2)
    assert len(b) == 6 and all(x["GPU"] == 1.0 for x in b)
    assert [next(k for k in x if k.startswith("drs_rank_")) for x in b] == [
        rank_resource(r) for r in (0, 0, 1, 1, 2, 2)
    ]


def test_the_ray_port_rule() -> None:
    assert ray_port_for(8000, host_network=False) == DEFAULT_RAY_PORT
    assert ray_port_for(8000, host_network=True) == 9000
    assert ray_port_for(65000, host_network=True) == 64000


def test_a_gang_report_is_checked_field_by_field() -> None:
    report = {
        "world_size": 2,
        "session": "abc",
        "ray_address": "10.0.0.1:6379",
        "phase": "joining",
        "reason": "waiting for rank(s) 1",
        "ranks": [{"rank": 0, "joined": True, "node_ip": "10.0.0.1", "gpus": 4, "workers_alive": 0}],
    }
    assert parse_gang_report(report)["ranks"][0]["node_ip"] == "10.0.0.1"
    with pytest.raises(ValueError, match="phase must be one of"):
        parse_gang_report({**report, "phase": "dancing"})
    with pytest.raises(ValueError, match="session must be str"):
        parse_gang_report({**report, "session": 3})
    with pytest.raises(ValueError, match=r"ranks\[0\] needs an integer rank"):
        parse_gang_report({**report, "ranks": [{"rank": "0", "joined": True}]})


def test_a_trtllm_leader_runs_its_workers_through_ray_unless_told_otherwise() -> None:
    trtllm = build_config({"backend": "trtllm", "model": {"path": "/m"}, "trtllmKwargs": {"max_seq_len": 8}})
    assert for_gang(trtllm).trtllm_kwargs == {"max_seq_len": 8, "orchestrator_type": "ray"}
    mpi = build_config({"backend": "trtllm", "model": {"path": "/m"}, "trtllmKwargs": {"orchestrator_type": "mpi"}})
    assert for_gang(mpi).trtllm_kwargs == {"orchestrator_type": "mpi"}
    sim = build_config({"backend": "sim"})
    assert for_gang(sim) is sim
