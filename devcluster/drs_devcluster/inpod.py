"""The operator installed by Helm from the image built here, and a client run in a pod: what
`make demo` and the real-node end-to-end tests do on a cluster with real nodes.

* ``helm_install``: ``helm upgrade --install`` of ``helm/drs-operator`` with ``drs:<version>``
  (imported into the real nodes, so ``pullPolicy: Never``), waiting until the operator is Ready;
* ``client_objects``: a ConfigMap holding a Python script, a ServiceAccount allowed to read
  DisaggReplicaSets, and a pod of the project's image running the script with in-cluster
  credentials on a real node;
* ``trainer_objects``: the trainer's refit step, a script beside ``drs sidecar`` in one pod;
* ``gym_objects``: the real NeMo-Gym as the client: ``drs gym-config`` in an init container,
  then examples/gym_agent.py (Gym's ``vllm_model`` server + an agent loop) in ``drs-gym:<version>``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from drs_operator.api.names import control_secret_name
from drs_protocol import routes

from . import images, nodeconfig
from .cluster import DevCluster

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "drs-operator"
HELM_TIMEOUT_S = 300


class InPodError(RuntimeError):
    """helm or kubectl failed; the message has their output."""


def helm_install(cluster: DevCluster, release: str = "drs", namespace: str = "drs-system", replicas: int = 1) -> str:
    """Install (or upgrade) the chart with the locally built image; return helm's output."""
    repository, tag = images.image_ref().split(":")
    argv = [
        str(cluster.layout.bin_dir / "helm"),
        "upgrade",
        "--install",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--create-namespace",
        "--set",
        f"image.repository={repository}",
        "--set",
        f"image.tag={tag}",
        "--set",
        "image.pullPolicy=Never",
        "--set",
        f"replicaCount={replicas}",
        "--set-json",
        f'nodeSelector={{"{nodeconfig.REAL_NODE_LABEL}": "true"}}',
        "--wait",
        f"--timeout={HELM_TIMEOUT_S}s",
    ]
    env = {**os.environ, "KUBECONFIG": str(cluster.layout.kubeconfig)}
    helm_home = cluster.layout.state_dir / "helm"
    env.update({f"HELM_{p}_HOME": str(helm_home / p.lower()) for p in ("CACHE", "CONFIG", "DATA")})
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=HELM_TIMEOUT_S + 60, check=False)
    if out.returncode != 0:
        raise InPodError(f"helm install failed: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout


def client_objects(name: str, namespace: str, script: str, args: list[str]) -> list[dict[str, Any]]:
    """ConfigMap + ServiceAccount + Role/RoleBinding (read DisaggReplicaSets) + the client pod."""
    meta = {"name": name, "namespace": namespace}
    role_meta = {"name": f"{name}-read-drs", "namespace": namespace}
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"client.py": script}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": role_meta,
            "rules": [{"apiGroups": ["disagg.dev"], "resources": ["disaggreplicasets"], "verbs": ["get", "list"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": role_meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role_meta["name"]},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {**meta, "labels": {"app": name}},
            "spec": {
                "serviceAccountName": name,
                "restartPolicy": "Never",
                "nodeSelector": {nodeconfig.REAL_NODE_LABEL: "true"},
                "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [
                    {
                        "name": "client",
                        "image": images.image_ref(),
                        "imagePullPolicy": "Never",
                        "command": ["python", "/client/client.py", *args],
                        "volumeMounts": [{"name": "client", "mountPath": "/client", "readOnly": True}],
                        "securityContext": {
                            "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]},
                        },
                    }
                ],
                "volumes": [{"name": "client", "configMap": {"name": name}}],
            },
        },
    ]


#: Where the trainer pod mounts the checkpoint volume, and its sidecar's port (localhost only).
TRAINER_CHECKPOINTS = "/checkpoints"
SIDECAR_PORT = 8400


def checkpoint_volume_objects(claim: str, namespace: str, host_dir: Path) -> list[dict[str, Any]]:
    """A PersistentVolume on ``host_dir`` (every real node is this machine) bound to the claim
    ``claim``: the volume the trainer writes checkpoints into and the engines load them from."""
    pv = f"{namespace}-{claim}"
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": {"path": str(host_dir), "type": "Directory"},
                "claimRef": {"namespace": namespace, "name": claim},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "namespace": namespace},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": pv,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    ]


def trainer_objects(
    name: str, namespace: str, drs: str, script: str, claim: str, engine_mount: str
) -> list[dict[str, Any]]:
    """The trainer's refit step as a pod: ``script`` beside ``drs sidecar`` (a native sidecar:
    an init container that keeps running; the pod completes when the script exits), with the
    RBAC of examples/trainer/sidecar-rbac.yaml and the fleet's control token."""
    objs = client_objects(name, namespace, script, [])
    role = next(o for o in objs if o["kind"] == "Role")
    role["rules"] = [
        {"apiGroups": ["disagg.dev"], "resources": ["disaggreplicasets"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["disagg.dev"], "resources": ["disaggreplicasets"], "resourceNames": [drs], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [control_secret_name(drs)], "verbs": ["get"]},
    ]
    pod = next(o for o in objs if o["kind"] == "Pod")
    (trainer,) = pod["spec"]["containers"]
    trainer["name"] = "trainer"
    trainer["command"] = [
        "python", "/client/client.py", "--name", drs, "--namespace", namespace,
        "--sidecar", f"http://127.0.0.1:{SIDECAR_PORT}", "--checkpoints", TRAINER_CHECKPOINTS,
        "--engine-mount", engine_mount,
    ]  # fmt: skip
    trainer["volumeMounts"].append({"name": "checkpoints", "mountPath": TRAINER_CHECKPOINTS})
    sidecar = {
        "name": "refit-sidecar",
        "image": images.image_ref(),
        "imagePullPolicy": "Never",
        "restartPolicy": "Always",  # a native sidecar: it runs beside the trainer, stopped after it
        # It reads the engines' control token from the fleet's Secret (the Role allows that one).
        "command": ["drs", "sidecar", "--name", drs, "--namespace", namespace, "--port", str(SIDECAR_PORT)],
        "securityContext": trainer["securityContext"],
    }
    pod["spec"]["initContainers"] = [sidecar]
    pod["spec"]["volumes"].append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim}})
    return objs


#: Run inside an engine pod: its ``GET /control/weights`` with the control token the pod holds.
_HELD_WEIGHTS = (
    "import os, sys, urllib.request; "
    "d = os.environ.get('DRS_CONTROL_TOKEN_DIR'); "
    "t = open(d + '/token').read().strip() if d else os.environ['DRS_CONTROL_TOKEN']; "
    "r = urllib.request.Request(sys.argv[1], headers={'authorization': 'Bearer ' + t}); "
    "print(urllib.request.urlopen(r, timeout=10).read().decode())"
)


def held_weights_command(url: str) -> list[str]:
    """The command that, run inside the pod of the engine serving at ``url`` (its status URL;
    ``kubectl exec``), prints its ``GET /control/weights`` (:class:`drs_protocol.control.WeightsInfo`:
    the version and digest it holds, and its ``catch_up`` with ``source`` and ``reached_from``)."""
    return ["python", "-c", _HELD_WEIGHTS, url.rstrip("/") + routes.CONTROL_WEIGHTS]


#: The Gym pod: where its init container writes Gym's config, and the file's name.
GYM_CONFIG_DIR = "/gym"
GYM_CONFIG_FILE = f"{GYM_CONFIG_DIR}/policy.yaml"
GYM_CONFIG_WAIT_S = 120
#: The kubelet's own label of its node (``--hostname-override`` is the node's name).
HOSTNAME_LABEL = "kubernetes.io/hostname"


def gym_objects(
    name: str, namespace: str, drs: str, script: str, args: list[str], node: str | None = None
) -> list[dict[str, Any]]:
    """The real NeMo-Gym as the fleet's client, in a pod: an init container of ``drs:<version>``
    runs ``drs gym-config`` (Gym's ``vllm_model`` config from the fleet's status, with in-cluster
    credentials) into an emptyDir; the main container of ``drs-gym:<version>`` runs ``script``
    (examples/gym_agent.py) with ``--config`` that file and ``args``; on the real node ``node``
    when given (the one the Gym image was imported into). The Role of :func:`client_objects`,
    with ``watch`` (``--wait`` follows the fleet)."""
    objs = client_objects(name, namespace, script, [])
    role = next(o for o in objs if o["kind"] == "Role")
    role["rules"] = [
        {"apiGroups": ["disagg.dev"], "resources": ["disaggreplicasets"], "verbs": ["get", "list", "watch"]}
    ]
    pod = next(o for o in objs if o["kind"] == "Pod")
    (agent,) = pod["spec"]["containers"]
    agent["name"] = "gym"
    agent["image"] = images.gym_ref()
    agent["command"] = ["python", "/client/client.py", "--config", GYM_CONFIG_FILE, *args]
    agent["env"] = [{"name": "HOME", "value": "/tmp"}]  # Gym's server writes nothing else; /tmp is an emptyDir
    agent["volumeMounts"] += [
        {"name": "gym-config", "mountPath": GYM_CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    config = {
        "name": "gym-config",
        "image": images.image_ref(),
        "imagePullPolicy": "Never",
        "command": ["drs", "gym-config", drs, "--namespace", namespace, "-o", GYM_CONFIG_FILE,
                    "--wait", str(GYM_CONFIG_WAIT_S)],
        "volumeMounts": [{"name": "gym-config", "mountPath": GYM_CONFIG_DIR}],
        "securityContext": agent["securityContext"],
    }  # fmt: skip
    pod["spec"]["initContainers"] = [config]
    pod["spec"]["volumes"] += [{"name": "gym-config", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    if node is not None:
        pod["spec"]["nodeSelector"][HOSTNAME_LABEL] = node
    return objs
