"""docs/nemo.md, run: every ``python`` and ``bash`` block in order against the local control plane with
a sim fleet ``rollouts`` in the namespace ``rl`` (operator and pod runner up, ``KUBECONFIG`` set, a
``drs sidecar`` at ``$DRS_SIDECAR_URL``, ``$CHECKPOINTS`` a directory), and the ``yaml`` block
compared with the config the ``bash`` block wrote."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from drs_devcluster.testing import RunningCluster
from operator_harness import ROOT, apply, free_port, running_operator, wait_ready

DOC = ROOT / "docs" / "nemo.md"
DRS = str(Path(sys.executable).parent / "drs")
NAMESPACE = "rl"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)

pytestmark = pytest.mark.cluster


def blocks(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


@pytest.fixture(scope="module")
def rollouts(
    devcluster: RunningCluster, pod_runner: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    """The fleet the doc names, an operator, a sidecar, and the environment the doc's blocks run in."""
    devcluster.install_crd()
    work = tmp_path_factory.mktemp("nemo-docs")
    devcluster.kubectl("create", "namespace", NAMESPACE, check=False)
    with running_operator(devcluster, work / "operator.log"):
        apply(devcluster, NAMESPACE, fleet())
        wait_ready(devcluster, NAMESPACE, "rollouts", 2, timeout=180)
        port = free_port()
        sidecar = subprocess.Popen(
            [DRS, "sidecar", "--name", "rollouts", "--namespace", NAMESPACE, "--port", str(port)],
            env={k: v for k, v in devcluster.env.items() if k != "DRS_CONTROL_TOKEN"},
            stderr=subprocess.DEVNULL,
        )
        (work / "checkpoints").mkdir()
        try:
            yield {
                **devcluster.env,
                "DRS_SIDECAR_URL": f"http://127.0.0.1:{port}",
                "CHECKPOINTS": str(work / "checkpoints"),
                "PATH": f"{Path(sys.executable).parent}:{devcluster.env['PATH']}",
                "WORK": str(work),
            }
        finally:
            sidecar.terminate()
            sidecar.wait(timeout=15)
            devcluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


def fleet() -> dict[str, Any]:
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggReplicaSet",
        "metadata": {"name": "rollouts"},
        "spec": {
            "replicas": 2,
            "model": {"path": "sim-qwen3"},
            "engine": {"backend": "sim", "simOptions": {"speed": 0}},
            "prefill": {"engines": 1, "tensorParallelSize": 1},
            "decode": {"engines": 1, "tensorParallelSize": 1},
            "frontend": {"workers": 1, "basePort": 18600},
            "trtllm": {"enginePort": 18250},
            "network": {"hostNetwork": True},
            "topology": {"gpusPerNode": 8},
            "images": {"engine": "drs:dev", "frontend": "drs:dev", "pullPolicy": "Never"},
        },
    }


def test_the_doc_has_blocks_to_run_and_one_config_to_compare() -> None:
    kinds = [kind for kind, _ in blocks(DOC.read_text())]
    assert kinds.count("python") >= 3 and kinds.count("bash") >= 2 and kinds.count("yaml") == 1
    assert set(kinds) == {"python", "bash", "yaml"}, "a block of another kind would be neither run nor compared"


def test_every_block_of_the_doc_runs_and_the_config_it_shows_is_what_it_wrote(rollouts: dict[str, str]) -> None:
    work = Path(rollouts["WORK"])
    shown: Any = None
    for i, (kind, code) in enumerate(blocks(DOC.read_text())):
        if kind == "yaml":
            shown = yaml.safe_load(code)
            continue
        command = [sys.executable, "-c", code] if kind == "python" else ["bash", "-euo", "pipefail", "-c", code]
        result = subprocess.run(command, cwd=work, env=rollouts, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"block {i} ({kind}) failed:\n{code}\n{result.stdout}\n{result.stderr}"
        print(f"--- block {i} ({kind}):\n{result.stdout}")
    written = yaml.safe_load((work / "gym_policy.yaml").read_text())
    assert shown is not None and len(written["policy_base_url"]) == len(shown["policy_base_url"]) == 2
    assert {**written, "policy_base_url": None} == {**shown, "policy_base_url": None}
