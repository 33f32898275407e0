"""The operator installed by Helm from the image built here, and a client run in a pod: what
`make demo` and the real-node end-to-end tests do on a cluster with real nodes.

* ``helm_install``: ``helm upgrade --install`` of ``helm/drs-operator`` with ``drs:<version>``
  (imported into the real nodes, so ``pullPolicy: Never``), waiting until the operator is Ready;
* ``client_objects``: a ConfigMap holding a Python script, a ServiceAccount allowed to read
  DisaggReplicaSets, and a pod of the project's image running the script with in-cluster
  credentials on a real node.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

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
