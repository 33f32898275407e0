"""``drs plan`` and ``drs crd`` through the real ``drs`` command group."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner, Result
from drs_cli.main import main
from drs_operator.profiles import build_nodes

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def drs(*args: str, stdin: str | None = None) -> Result:
    return CliRunner().invoke(main, list(args), input=stdin, catch_exceptions=False)


def test_json_output_has_the_documented_shape() -> None:
    result = drs("plan", "-f", str(EXAMPLES / "reference.yaml"), "--profile", "hgx", "-o", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["replicaWidth"] == 8 and report["replicaCount"] == 2 and report["gpus"] == 16
    (r0, r1) = report["replicas"]
    assert set(r0) >= {"index", "segment", "nodes", "engines", "frontends"}
    assert (r0["index"], r0["segment"], r0["nodes"]) == (0, "hgx-000", ["hgx-000"])
    assert r0["engines"][0] == {
        "name": "reference-r0-prefill-0",
        "role": "prefill",
        "ordinal": 0,
        "width": 4,
        "port": 8000,
        "nodes": ["hgx-000"],
    }
    assert set(r0["engines"][1]) >= {"name", "role", "ordinal", "width", "nodes"}
    assert r1["frontends"] == [
        {"index": 0, "port": 8302, "nodeId": 2, "node": "hgx-001"},
        {"index": 1, "port": 8303, "nodeId": 3, "node": "hgx-001"},
    ]
    assert report["urls"] == [
        f"http://reference-r{r}-f{f}.default.svc:{8300 + 2 * r + f}" for r in (0, 1) for f in (0, 1)
    ]
    assert report["unplaced"] == [] and report["split"] == []


def test_the_gb200_example_keeps_each_replica_in_one_clique() -> None:
    result = drs("plan", "-f", str(EXAMPLES / "gb200.yaml"), "--profile", "gb200", "-o", "json")
    report = json.loads(result.stdout)
    assert result.exit_code == 0 and [r["segment"] for r in report["replicas"]] == ["nvl72-0", "nvl72-0"]
    assert [len(r["nodes"]) for r in report["replicas"]] == [2, 2]


def test_the_wide_gb200_example_shows_the_prefill_gang_one_pod_per_tray() -> None:
    result = drs("plan", "-f", str(EXAMPLES / "gb200-wide.yaml"), "--profile", "gb200", "-o", "json")
    assert result.exit_code == 0, result.output
    (replica,) = json.loads(result.stdout)["replicas"]
    prefill, decode0, decode1 = replica["engines"]
    assert replica["segment"] == "nvl72-0" and len(replica["nodes"]) == 6
    assert prefill["width"] == 16 and prefill["gpusPerPod"] == 4
    assert [p["name"] for p in prefill["pods"]] == ["gb200-wide-r0-prefill-0"] + [
        f"gb200-wide-r0-prefill-0-w{k}" for k in (1, 2, 3)
    ]
    assert [p["node"] for p in prefill["pods"]] == prefill["nodes"] and len(set(prefill["nodes"])) == 4
    assert "pods" not in decode0 and "pods" not in decode1
    table = drs("plan", "-f", str(EXAMPLES / "gb200-wide.yaml"), "--profile", "gb200").stdout
    rank_rows = [line.split() for line in table.splitlines() if "- rank" in line or "- leader" in line]
    assert [next(c for c in row if c.startswith("gb200-wide-r0-")) for row in rank_rows] == [
        "gb200-wide-r0-prefill-0",
        *(f"gb200-wide-r0-prefill-0-w{k}" for k in (1, 2, 3)),
    ]


def test_host_networking_urls_name_node_addresses() -> None:
    result = drs("plan", "-f", str(EXAMPLES / "local-sim.yaml"), "--profile", "hgx", "--node-count", "2", "-o", "json")
    report = json.loads(result.stdout)
    assert result.exit_code == 0 and report["urls"] == [f"http://127.0.1.1:{8300 + i}" for i in range(4)]


@pytest.mark.parametrize("shape", ["list", "multi-document"], ids=lambda s: f"--nodes reads a {s} of Node manifests")
def test_nodes_file(tmp_path: Path, shape: str) -> None:
    nodes = build_nodes("gb200", 4)
    path = tmp_path / "nodes.yaml"
    if shape == "list":
        path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": nodes}))
    else:
        path.write_text(yaml.safe_dump_all(nodes))
    result = drs("plan", "-f", str(EXAMPLES / "gb200.yaml"), "--nodes", str(path), "-o", "json")
    report = json.loads(result.stdout)
    assert result.exit_code == 0
    assert [r["nodes"] for r in report["replicas"]] == [["gb200-000", "gb200-001"], ["gb200-002", "gb200-003"]]


def test_unplaceable_replicas_exit_1_and_say_why() -> None:
    result = drs("plan", "-f", str(EXAMPLES / "reference.yaml"), "--profile", "hgx", "--node-count", "1")
    assert result.exit_code == 1
    assert "Not placed:" in result.stdout and "replica 1 needs 8 GPUs in one node or segment" in result.stdout


def test_the_table_names_every_engine_frontend_and_url() -> None:
    result = drs("plan", "-f", str(EXAMPLES / "reference.yaml"), "--profile", "hgx")
    assert result.exit_code == 0
    for text in (
        "reference-r1-decode-1",
        "node id 3",
        "http://reference-r1-f1.default.svc:8303",
        "2 replica(s) x 8 GPUs = 16 GPUs",
    ):
        assert text in result.stdout


def test_without_nodes_the_plan_is_shown_unplaced() -> None:
    result = drs("plan", "-f", "-", "-o", "json", stdin=(EXAMPLES / "reference.yaml").read_text())
    report = json.loads(result.stdout)
    assert result.exit_code == 0 and all(not r["placed"] and r["nodes"] == [] for r in report["replicas"])
    assert "unplaced" not in report and len(report["urls"]) == 4


def invalid_manifest() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((EXAMPLES / "reference.yaml").read_text())
    data["metadata"]["name"] = "Reference"
    spec = data["spec"]
    spec["prefill"]["moeExpertParallelSize"] = 1  # MoE split 2 * 1 != 4
    spec["decode"]["maxModelLen"] = 4096  # replica-wide field inside a role
    spec["frontend"]["workers"] = "two"  # a type error
    spec["trtllm"]["enginePort"] = 8301  # collides with a frontend port
    spec["replicas"] = None
    spec["inferenceGPUs"] = 12  # not a multiple of 8
    return data


def test_an_invalid_file_exits_2_listing_every_problem_with_its_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(invalid_manifest()))
    result = drs("plan", "-f", str(path), "--profile", "hgx", "-o", "json")
    assert result.exit_code == 2 and result.stdout == ""
    for text in (
        "metadata.name: metadata.name must be a DNS label",
        "spec.prefill.moeExpertParallelSize: moeTensorParallelSize * moeExpertParallelSize must equal tensorParallelSize",
        "spec.decode.maxModelLen: maxModelLen is replica-wide",
        "spec.frontend.workers: Input should be a valid integer",
        "spec.inferenceGPUs: inferenceGPUs must be a multiple of the replica width",
    ):
        assert text in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--profile", "hgx", "--nodes", "x.yaml"], "exclusive", id="--nodes with --profile"),
        pytest.param(["--node-count", "3"], "--node-count needs --profile", id="--node-count without --profile"),
        pytest.param(["--profile", "hgx", "--node-count", "0"], "between 1 and", id="a node count of zero"),
    ],
)
def test_bad_options_exit_2(args: list[str], message: str) -> None:
    result = drs("plan", "-f", str(EXAMPLES / "reference.yaml"), *args)
    assert result.exit_code == 2 and message in result.stderr


def test_a_file_that_is_not_yaml_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("spec: [unclosed")
    result = drs("plan", "-f", str(path))
    assert result.exit_code == 2 and "not valid YAML" in result.stderr


def test_drs_crd_prints_the_committed_crd() -> None:
    result = drs("crd")
    assert result.exit_code == 0
    assert result.stdout == (REPO / "crds" / "disagg.dev_disaggreplicasets.yaml").read_text()
