"""The Gym-shaped load of the real-node weights tests: a client pod over the status URLs whose
answers carry each turn's stamp, weights version and boundary mark (``examples/load_client.py``)."""

from __future__ import annotations

import json
from typing import Any

import yaml
from drs_devcluster import inpod
from drs_devcluster.testing import RunningCluster

from .pods import logs, wait_phase
from .test_weights_on_real_node import LOAD, NAME, wait

#: how long past its own seconds the client may take to end
END_S = 120


def start_load(cluster: RunningCluster, ns: str, pod: str, seconds: int) -> None:
    """The client pod ``pod`` started (8 sessions, every answer kept); back at its first turn."""
    args = ["--name", NAME, "--namespace", ns, "--seconds", str(seconds), "--sessions", "8", "--answers"]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(inpod.client_objects(pod, ns, LOAD, args)))
    wait(
        "the client's first turn",
        lambda: "[load] started" in cluster.kubectl("logs", pod, "-n", ns, check=False).stdout,
    )


def load_answers(cluster: RunningCluster, ns: str, pod: str, seconds: int) -> tuple[dict[str, Any], list[list[Any]]]:
    """The client's figures once it ended (it must succeed), and its answers: [stamp, version, boundary]."""
    client = wait_phase(cluster, ns, pod, {"Succeeded", "Failed"}, timeout=seconds + END_S)
    out = logs(cluster, ns, pod)
    assert client["status"]["phase"] == "Succeeded", out
    load: dict[str, Any] = json.loads(out.strip().splitlines()[-1])["load"]
    answers: list[list[Any]] = load.pop("answers")
    return load, answers


def off_policy(answers: list[list[Any]], version: str, effective_at: float) -> list[list[Any]]:
    """Answers of turns stamped at or after the cut-over at another version (boundary turns excepted)."""
    return [a for a in answers if a[0] is not None and a[0] >= effective_at and not a[2] and a[1] != version]
