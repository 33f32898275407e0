"""`make demo-kwok`: the main job on the local control plane with simulated nodes and the pod runner.

1. bring up the dev control plane with simulated HGX GPU nodes (reused when already up);
2. install the CRD, start the operator and the local pod runner (which runs our pods' commands as
   processes bound to their nodes' loopback addresses);
3. apply examples/local-sim.yaml (sim engines: the CPU test double of a GPU engine) and wait,
   showing progress, until the DisaggReplicaSet is Ready;
4. read `status.urls` and drive multi-turn conversations through them with the demo's Gym client
   (`examples/gym_client.py`, the one `make demo` runs in a pod: the OpenAI wire format,
   sha256(session) % len(urls) as NeMo-Gym does), printing which prefill and decode engines
   served each turn and how many prompt tokens the prefill engines' cache held;
5. start the trainer's refit sidecar (`drs sidecar`), refit every engine to new weights through
   it as a trainer does after a policy update (with the trainer's library, `drs_client`), and
   show `status.weights.version` and that the same request now generates other tokens.

Everything keeps running afterwards; `make demo-down` (`drs dev down`) stops all of it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

from demo_steps import ROOT, ensure_operator, ensure_sim_cluster, install_crd, kubectl, say, wait_ready, wait_serving
from drs_client import Fleet, SidecarUnreachable
from drs_devcluster import processes, runner_daemon
from drs_devcluster.cluster import DevCluster
from drs_protocol import routes
from gym_client import drive

EXAMPLE = ROOT / "examples" / "local-sim.yaml"
NAME = "local-sim"
READY_TIMEOUT_S = 180.0


SIDECAR_PORT = 18400


def one_completion(url: str) -> list[int]:
    """The token ids a fixed request generates through a frontend (the sim's depend on the weights)."""
    body = {"model": "sim-qwen3", "prompt": "The policy after this update says", "max_tokens": 6, "ignore_eos": True}
    request = urllib.request.Request(
        url + routes.Endpoint.COMPLETIONS, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        return list(json.loads(resp.read())["choices"][0]["token_ids"])


def start_sidecar(cluster: DevCluster) -> None:
    pids = cluster.layout.state_dir / "sidecar-pids.json"
    processes.stop(processes.load(pids))  # a sidecar left by an earlier `make demo`
    drs = str(Path(sys.executable).parent / "drs")
    env = {**os.environ, "KUBECONFIG": str(cluster.layout.kubeconfig)}
    argv = [sys.executable, drs, "sidecar", "--name", NAME, "--namespace", "default", "--port", str(SIDECAR_PORT)]
    tracked = processes.start("sidecar", argv, cluster.layout.log("sidecar"), env=env)
    processes.save(pids, [tracked])
    say(f"trainer sidecar started (pid {tracked.pid}, http://127.0.0.1:{SIDECAR_PORT}, reads {NAME}'s status)")


def refit(cluster: DevCluster, fleet: Fleet) -> None:
    """The trainer's refit through the library: the sidecar loads new weights on every engine."""
    start_sidecar(cluster)
    try:
        fleet.wait_sidecar(timeout_s=30)
    except SidecarUnreachable:
        raise SystemExit(f"the sidecar did not start; see {cluster.layout.log('sidecar')}") from None
    version = time.strftime("step-%H%M%S")  # a new policy version on every run of the demo
    checkpoint = cluster.layout.state_dir / "checkpoints" / version
    checkpoint.mkdir(parents=True, exist_ok=True)
    (checkpoint / "model.safetensors").write_bytes(os.urandom(64))  # the sim hashes what it loads
    url = fleet.get().urls[0]
    before = one_completion(url)
    report = fleet.refit(str(checkpoint), version)
    say(
        f"POST {routes.TrainerRoute.REFIT} {version}: complete={report.complete} engines={report.engines} ok={report.ok} "
        f"in {report.elapsed_s}s"
    )
    shown = fleet.wait_weights(version, timeout_s=30).weights_version
    say(f"status.weights.version = {shown}")
    after = one_completion(url)
    say(f"the same request via {url}: token ids {before} before, {after} after the refit")


def main() -> None:
    cluster = ensure_sim_cluster("hgx", 4)
    install_crd(cluster)
    ensure_operator(cluster, metrics_port=19090, health_port=18080)
    if runner_daemon.running_runner(cluster) is None:
        runner_daemon.start_runner(cluster)
    say("pod runner started (runs pods whose command is `drs` as local processes on their node's address)")
    kubectl(cluster, "apply", "-f", str(EXAMPLE))
    say(f"applied {EXAMPLE.relative_to(ROOT)}; waiting for Ready")
    status = wait_ready(cluster, NAME, READY_TIMEOUT_S)
    print(kubectl(cluster, "get", "drs", "-o", "wide"), flush=True)
    wait_serving(status["urls"], READY_TIMEOUT_S)
    sidecar = f"http://127.0.0.1:{SIDECAR_PORT}"
    with Fleet.connect(NAME, "default", kubeconfig=cluster.layout.kubeconfig, sidecar_url=sidecar) as fleet:
        drive(fleet.get())
        refit(cluster, fleet)
    say(
        f"done. The fleet keeps running: export KUBECONFIG={cluster.layout.kubeconfig}; `make demo-down` stops everything."
    )


if __name__ == "__main__":
    main()
