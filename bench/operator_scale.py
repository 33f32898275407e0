"""Benchmark: how fast the operator turns a large DisaggReplicaSet into children and a status.

Not a test. It starts a private dev control plane (its own port range and state directory), with
enough simulated 8-GPU nodes, and measures in one run:

* ``apply_to_children_s``: ``kubectl apply`` of a 32-replica fleet (8 frontends per replica:
  256 frontend URLs) until every child exists and ``status.urls`` lists all 256 URLs;
* ``apply_to_ready_s``: until ``status.phase`` is Ready (kwok runs the pods);
* ``writes_per_pod``: the operator's write requests (its own counter) per pod of the fleet;
* ``resync_writes``: writes during three full resyncs after convergence (should be 0);
* the baseline: ``kubectl apply`` of the very same child manifests, rendered by the same pure
  builders, in one bulk request stream, so ``ratio_to_baseline`` says what the operator adds over
  the apiserver's own create throughput on this machine.

It ends by printing one JSON line with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "cluster"))

from drs_devcluster import build  # noqa: E402
from drs_devcluster.cluster import DevCluster  # noqa: E402
from drs_devcluster.testing import RunningCluster  # noqa: E402
from operator_harness import OperatorProcess, wait_for  # noqa: E402

PORT_BASE = 25300


def fleet(name: str, replicas: int, frontends: int) -> dict[str, Any]:
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggReplicaSet",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "model": {"path": "/models/m"},
            "prefill": {"engines": 1, "tensorParallelSize": 4},
            "decode": {"engines": 2, "tensorParallelSize": 2},
            "frontend": {"workers": frontends, "basePort": 20000},
            "topology": {"gpusPerNode": 8},
        },
    }


def count_children(rc: RunningCluster, namespace: str, name: str) -> int:
    out = rc.kubectl(
        "get",
        "pods,deployments,services,configmaps",
        "-n",
        namespace,
        "-l",
        f"disagg.dev/replicaset={name}",
        "-o",
        "name",
    )
    return len(out.stdout.split())


def baseline(rc: RunningCluster, namespace: str, body: dict[str, Any]) -> tuple[float, int]:
    """Create the same children with kubectl from manifests rendered by the operator's builders."""
    from drs_operator.manifests import Owner, desired_children
    from drs_operator.nodepool import nodes_from_manifests
    from drs_operator.placement import place
    from drs_operator.plan import plan
    from drs_operator.validation import validate_manifest

    drs, problems = validate_manifest(body)
    assert drs is not None, problems
    p = plan(drs.spec, drs.metadata.name)

    def placed() -> tuple[Any, Any] | None:
        # right after start-up the node lifecycle controller briefly taints nodes: wait it out
        nodes = json.loads(rc.kubectl("get", "nodes", "-o", "json").stdout)["items"]
        infos = nodes_from_manifests(nodes, topology=drs.spec.topology)
        placement = place(p, infos)
        return (infos, placement) if placement.complete else None

    infos, placement = wait_for("every node to be schedulable", placed, timeout=120)
    children = desired_children(
        Owner(drs.metadata.name, namespace, "00000000-0000-0000-0000-000000000000"),
        drs.spec,
        p,
        placement,
        {n.name: n.address for n in infos if n.address},
    )
    items = []
    for kind in ("ConfigMap", "Service", "Pod", "Deployment"):
        for obj in children.all_of(kind).values():
            obj = json.loads(json.dumps(obj))
            obj["metadata"].pop("ownerReferences", None)  # no owner: the baseline has no DRS
            items.append(obj)
    doc = json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
    t0 = time.monotonic()
    rc.kubectl("apply", "-n", namespace, "-f", "-", input=doc, timeout=600)
    return time.monotonic() - t0, len(items)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=32)
    ap.add_argument("--frontends", type=int, default=8)
    args = ap.parse_args()
    n, f = args.replicas, args.frontends
    state = Path(tempfile.mkdtemp(prefix="drs-bench-"))
    cluster = DevCluster.at(state, PORT_BASE, bin_dir=build.bin_dir())
    print(f"[bench] starting a private control plane with {n} 8-GPU nodes", file=sys.stderr, flush=True)
    cluster.up("hgx", n)
    rc = RunningCluster(cluster)
    op: OperatorProcess | None = None
    try:
        rc.kubectl("apply", "-f", str(ROOT / "crds"))
        rc.kubectl("wait", "--for=condition=Established", "crd/disaggreplicasets.disagg.dev", "--timeout=60s")
        for ns in ("bench-baseline", "bench"):
            rc.kubectl("create", "namespace", ns)
        print("[bench] baseline: kubectl apply of the same children", file=sys.stderr, flush=True)
        base_s, objects = baseline(rc, "bench-baseline", fleet("big", n, f))
        rc.kubectl("delete", "namespace", "bench-baseline", "--wait=false")
        op = OperatorProcess(rc, state / "operator.log", resync_s=2.0).start()
        time.sleep(3)  # leadership acquired, watches listed
        body = fleet("big", n, f)
        print(f"[bench] applying a {n}-replica fleet ({n * f} frontends)", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        rc.kubectl("apply", "-n", "bench", "-f", "-", input=json.dumps(body))

        def published() -> bool:
            st = json.loads(rc.kubectl("get", "drs", "big", "-n", "bench", "-o", "json").stdout).get("status") or {}
            return len(st.get("urls", [])) == n * f and count_children(rc, "bench", "big") >= objects

        wait_for("children and urls", published, timeout=900)
        t_children = time.monotonic() - t0

        def ready() -> bool:
            st = json.loads(rc.kubectl("get", "drs", "big", "-n", "bench", "-o", "json").stdout).get("status") or {}
            return bool(st.get("phase") == "Ready")

        wait_for("Ready", ready, timeout=900)
        t_ready = time.monotonic() - t0
        pods = len(rc.kubectl("get", "pods", "-n", "bench", "-o", "name").stdout.split())
        writes = op.writes()
        reconciles = op.reconciles()
        wait_for("three resyncs", lambda: op is not None and op.reconciles() >= reconciles + 3, timeout=60)
        resync_writes = op.writes() - writes
    finally:
        if op is not None:
            op.kill(signal.SIGTERM)
        cluster.down()
    result = {
        "bench": "operator_scale",
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "replicas": n,
        "frontends": n * f,
        "pods": pods,
        "child_objects": objects,
        "apply_to_children_s": round(t_children, 2),
        "apply_to_ready_s": round(t_ready, 2),
        "baseline_kubectl_apply_s": round(base_s, 2),
        "ratio_to_baseline": round(t_children / base_s, 2),
        "writes_total": writes,
        "writes_per_pod": round(writes / pods, 2),
        "resync_writes": resync_writes,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
