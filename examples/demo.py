"""`make demo`: the main job, end to end, on a dev cluster with a real node.

1. bring up the dev control plane with one real node (kubelet + containerd + CNI + kube-proxy +
   CoreDNS + the fake GPU device plugin) and no simulated ones, building the project's image with
   no registry when it is missing (`drs dev images`); a running one is reused;
2. `helm install` the operator chart (helm/drs-operator) with that image: the operator runs as a
   pod with its ServiceAccount, talking to the apiserver through the `kubernetes` Service;
3. apply examples/pod-network-sim.yaml (sim engines, the CPU test double of a GPU engine, and
   frontends as containers on the real node, in pod networking) and wait until it is Ready;
4. run the trainer-side client (examples/gym_client.py) in a pod: it reads `status.urls` (Service
   names, resolved by the cluster's DNS) and drives multi-turn conversations through them, as
   NeMo-Gym does, printing which engines served each turn and the prefix-cache hits;
5. the real NeMo-Gym 0.7.0 drives the fleet, in a pod of its own image (``drs-gym``, the
   Dockerfile's ``gym`` target, built by `drs dev images` and imported into the node): an init
   container runs ``drs gym-config`` (Gym's ``vllm_model`` config from the status), then
   examples/gym_agent.py starts Gym's own ``vllm_model`` server on it and runs 4 tool-calling
   conversations x 3 turns through it, as Gym's ``simple_agent`` does, checking every turn, Gym's
   token ids against our answers, token continuity, and that each conversation stayed on its
   frontend and prefill engine; it prints one JSON line;
6. refit, in-cluster, as a trainer does after a policy update: a trainer pod
   (examples/trainer/refit_in_pod.py) writes new weights into the checkpoint volume the engines
   mount (a PersistentVolume on this machine: every real node is this machine) and asks its refit
   sidecar (`drs sidecar`, a native sidecar container of the same pod, with the RBAC of
   examples/trainer/sidecar-rbac.yaml) to load them on every engine; it prints the version each
   engine reports in the status and a fixed request's tokens before and after.

Everything keeps running afterwards; `make demo-down` (`drs dev down`) stops all of it and undoes
the host changes. `make demo-kwok` is the simulated-node demo (with the trainer sidecar's refit).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import yaml
from demo_steps import ROOT, kubectl, running, say, wait_ready
from drs_devcluster import build, images, inpod, nodeconfig, profiles, realnodes
from drs_devcluster.cluster import DevCluster
from drs_operator.api.constants import DEFAULT_MODEL_MOUNT_PATH
from drs_protocol.engine_config import SIM_DEFAULT_TOKENS_PER_BLOCK

EXAMPLE = ROOT / "examples" / "pod-network-sim.yaml"
CLIENT = ROOT / "examples" / "gym_client.py"
TRAINER = ROOT / "examples" / "trainer" / "refit_in_pod.py"
GYM_AGENT = ROOT / "examples" / "gym_agent.py"
CHECKPOINTS_CLAIM = "checkpoints"
NAME = "pod-sim"
NAMESPACE = "default"
READY_TIMEOUT_S = 300.0
CLIENT_TIMEOUT_S = 300.0


def ensure_cluster() -> DevCluster:
    cluster = DevCluster.at()
    if running(cluster):
        nodes = kubectl(DevCluster.at(bin_dir=build.bin_dir()), "get", "nodes", "-o", "name", check=False)
        if f"node/{nodeconfig.node_name(0)}" in nodes:
            say("reusing the running dev cluster with its real node")
            return DevCluster.at(bin_dir=build.bin_dir())
        raise SystemExit("a dev cluster without real nodes is running: `make demo-down` first (or `make demo-kwok`)")
    cluster.down()
    cluster = DevCluster.at()
    t0 = time.monotonic()
    # The demo's fleet has no NetworkPolicies: without enforcement a cold machine does not compile
    # kube-router (minutes). DRS_DEV_NETWORK_POLICIES=1 make demo enforces them all the same.
    os.environ.setdefault(profiles.NETWORK_POLICIES_ENV, "0")
    cluster.up("hgx", 0, real_nodes=1)
    say(f"dev cluster with 1 real node up in {time.monotonic() - t0:.0f}s")
    return cluster


def run_pod(cluster: DevCluster, name: str, objs: list[dict[str, Any]]) -> int:
    """Apply ``objs`` (a pod named ``name`` and what it needs), wait until the pod ends, print its log."""
    kubectl(cluster, "delete", "pod", name, "-n", NAMESPACE, "--ignore-not-found", "--wait=true")
    kubectl(cluster, "apply", "-f", "-", input=yaml.safe_dump_all(objs))
    deadline = time.monotonic() + CLIENT_TIMEOUT_S
    phase = ""
    while time.monotonic() < deadline and phase not in ("Succeeded", "Failed"):
        phase = kubectl(cluster, "get", "pod", name, "-n", NAMESPACE, "-o", "jsonpath={.status.phase}")
        time.sleep(1)
    print(kubectl(cluster, "logs", name, "-n", NAMESPACE, "-c", name_of_main(objs), check=False), end="", flush=True)
    return 0 if phase == "Succeeded" else 1


def name_of_main(objs: list[dict[str, Any]]) -> str:
    pod = next(o for o in objs if o["kind"] == "Pod")
    return str(pod["spec"]["containers"][0]["name"])


def apply_fleet(cluster: DevCluster) -> None:
    """The example, with the checkpoint volume the trainer writes into as the engines' model volume."""
    checkpoints = cluster.layout.state_dir / "checkpoints"
    checkpoints.mkdir(exist_ok=True)
    checkpoints.chmod(0o777)  # the trainer container runs as the image's non-root user
    volume = inpod.checkpoint_volume_objects(CHECKPOINTS_CLAIM, NAMESPACE, checkpoints)
    kubectl(cluster, "apply", "-f", "-", input=yaml.safe_dump_all(volume))
    fleet = yaml.safe_load(EXAMPLE.read_text())
    fleet["spec"]["model"]["volume"] = {"persistentVolumeClaim": {"claimName": CHECKPOINTS_CLAIM, "readOnly": True}}
    kubectl(cluster, "apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(fleet))


def refit(cluster: DevCluster) -> int:
    mount = yaml.safe_load(EXAMPLE.read_text())["spec"]["model"].get("mountPath", DEFAULT_MODEL_MOUNT_PATH)
    objs = inpod.trainer_objects("trainer", NAMESPACE, NAME, TRAINER.read_text(), CHECKPOINTS_CLAIM, mount)
    say("trainer pod started: its refit sidecar (drs sidecar, in the same pod) refits every engine")
    return run_pod(cluster, "trainer", objs)


def ensure_gym_image(cluster: DevCluster) -> None:
    """``drs-gym:<version>`` built (cached by its inputs' digest) and imported into the real node."""
    t0 = time.monotonic()
    archive = images.ensure_gym_image()
    realnodes.import_archive(cluster.layout, archive)
    say(f"{images.gym_ref()} (NeMo-Gym 0.7.0) on the real node after {time.monotonic() - t0:.0f}s")


def run_gym(cluster: DevCluster) -> int:
    args = ["--block-tokens", str(SIM_DEFAULT_TOKENS_PER_BLOCK)]
    objs = inpod.gym_objects("gym-rollouts", NAMESPACE, NAME, GYM_AGENT.read_text(), args)
    say("Gym pod gym-rollouts started: drs gym-config (init container), then NeMo-Gym's vllm_model server + agent")
    t0 = time.monotonic()
    rc = run_pod(cluster, "gym-rollouts", objs)
    say(f"Gym pod {'passed its checks' if rc == 0 else 'FAILED'} after {time.monotonic() - t0:.0f}s")
    return rc


def main() -> int:
    started = time.monotonic()
    cluster = ensure_cluster()
    ensure_gym_image(cluster)
    t0 = time.monotonic()
    inpod.helm_install(cluster)
    say(
        f"helm install of helm/drs-operator (image drs, pod with its ServiceAccount) Ready in {time.monotonic() - t0:.0f}s"
    )
    t0 = time.monotonic()
    apply_fleet(cluster)
    status = wait_ready(cluster, NAME, READY_TIMEOUT_S, NAMESPACE)
    say(f"{NAME} Ready in {time.monotonic() - t0:.0f}s; frontends: {status['urls']}")
    pods = kubectl(cluster, "get", "pods", "-n", NAMESPACE, "-o", "wide", "-l", f"disagg.dev/replicaset={NAME}")
    print(pods, end="")
    client = inpod.client_objects(
        "gym-client", NAMESPACE, CLIENT.read_text(), ["--name", NAME, "--namespace", NAMESPACE]
    )
    say("client pod gym-client started (image drs, in-cluster credentials, reads the status itself)")
    rc = run_pod(cluster, "gym-client", client) or run_gym(cluster) or refit(cluster)
    say(f"demo finished in {time.monotonic() - started:.0f}s (rc {rc}); `make demo-down` stops everything")
    return rc


if __name__ == "__main__":
    sys.exit(main())
