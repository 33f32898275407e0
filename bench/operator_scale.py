"""Benchmark: how fast the operator turns a large DisaggReplicaSet into children and a status.

Not a test. It starts a private dev control plane (its own port range and state directory) with
one simulated 8-GPU node per replica, and measures in one run:

* the baselines, from child manifests rendered by the operator's own pure builders (no owner):
  ``serial_kubectl_apply_s``, one ``kubectl apply`` of them all (kubectl sends one object after
  another), and ``parallel_server_side_apply_s``, ``--clients`` concurrent
  ``kubectl apply --server-side`` processes splitting the same objects; each namespace is deleted
  and gone before the next step, so every step starts on empty nodes;
* ``apply_to_children_s``: ``kubectl apply`` of the DisaggReplicaSet until every child exists and
  ``status.urls`` lists every frontend, and ``ratio_to_serial`` / ``ratio_to_parallel_ssa``;
* ``apply_to_ready_s``: until ``status.phase`` is Ready (kwok runs the pods);
* ``components``: which component the fleet waited for (``bench/scale_components.py``): the last
  pod created, bound (kube-scheduler) and Ready (kwok), bind rate and per-pod latencies, the
  apiserver's mean latency per kind of write, nodes that turned NotReady, and the longest step;
* the operator's CPU seconds and RSS (``/proc``), and each control-plane process's CPU seconds
  over apply→Ready (which component was busy), and the machine's load average;
* ``writes_per_pod``: the operator's write requests (its own counter) per pod of the fleet, and
  ``retries`` (429/5xx answers sent again) and ``in_flight_peak`` (most writes in flight at once);
* ``resync``: three passes over the converged fleet: writes (should be 0), CPU seconds and
  reconcile seconds per pass;
* with ``--foreign-pods N``: N unrelated pods (no GPUs) bound to a CPU node, then the same
  resync figures again, so reconcile cost with and without them can be compared.

It ends by printing one JSON line with the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "cluster"))
sys.path.insert(0, str(ROOT))

from drs_devcluster import build, processes  # noqa: E402
from drs_devcluster.cluster import DevCluster  # noqa: E402
from drs_devcluster.testing import RunningCluster  # noqa: E402
from operator_harness import OperatorProcess, wait_for  # noqa: E402

from bench import scale_components  # noqa: E402
from bench.proc_stats import cpu_of, cpu_s, rss_mib  # noqa: E402

PORT_BASE = int(os.environ.get("DRS_BENCH_PORT_BASE", "25300"))
CHILD_KINDS = ("pods", "deployments", "services", "configmaps")
#: The kube-apiserver's own Prometheus endpoint (not one of ours).
APISERVER_METRICS = "/metrics"


def fleet(
    name: str, replicas: int, frontends: int, prefill: tuple[int, int], decode: tuple[int, int]
) -> dict[str, Any]:
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggReplicaSet",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "model": {"path": "/models/m"},
            "prefill": {"engines": prefill[0], "tensorParallelSize": prefill[1]},
            "decode": {"engines": decode[0], "tensorParallelSize": decode[1]},
            "frontend": {"workers": frontends, "basePort": 20000},
            "topology": {"gpusPerNode": 8},
        },
    }


# --------------------------------------------------------------------------- cluster reads
_CLIENTS: dict[str, Any] = {}


def get_json(rc: RunningCluster, path: str, meta_only: bool = False) -> dict[str, Any]:
    """GET ``path``; ``meta_only`` asks for metadata only (cheap to poll on a large list)."""
    api = _CLIENTS.get(str(rc.kubeconfig))
    if api is None:
        api = _CLIENTS[str(rc.kubeconfig)] = rc.api_client()
    headers = {"Accept": "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"} if meta_only else {}
    method, url, headers, _, _ = api.param_serialize("GET", path, header_params=headers, auth_settings=["BearerToken"])
    resp = api.call_api(method, url, header_params=headers, _request_timeout=60)
    resp.read()
    if resp.status != 200:
        raise RuntimeError(f"GET {path}: {resp.status} {resp.data[:300]!r}")
    data: dict[str, Any] = json.loads(resp.data)
    return data


def count_children(rc: RunningCluster, namespace: str) -> int:
    total = 0
    for kind in CHILD_KINDS:
        group = "/apis/apps/v1" if kind == "deployments" else "/api/v1"
        items = get_json(rc, f"{group}/namespaces/{namespace}/{kind}?labelSelector=disagg.dev/replicaset", True)
        total += len(items.get("items") or [])
    return total


def drs_status(rc: RunningCluster, namespace: str, name: str) -> dict[str, Any]:
    body = get_json(rc, f"/apis/disagg.dev/v1alpha1/namespaces/{namespace}/disaggreplicasets/{name}")
    status: dict[str, Any] = body.get("status") or {}
    return status


# --------------------------------------------------------------------------- baselines
def children_manifests(rc: RunningCluster, namespace: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The fleet's children, rendered by the operator's pure builders, without an owner."""
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
        nodes = get_json(rc, "/api/v1/nodes")["items"]
        infos = nodes_from_manifests(nodes, topology=drs.spec.topology)
        placement = place(p, infos)
        return (infos, placement) if placement.complete else None

    infos, placement = wait_for("every node to be schedulable", placed, timeout=180)
    owner = Owner(drs.metadata.name, namespace, "00000000-0000-0000-0000-000000000000")
    addresses = {n.name: n.address for n in infos if n.address}
    children = desired_children(owner, drs.spec, p, placement, addresses)
    items = []
    for kind in ("ConfigMap", "Service", "Pod", "Deployment"):
        for obj in children.all_of(kind).values():
            obj = json.loads(json.dumps(obj))
            obj["metadata"].pop("ownerReferences", None)  # no owner: the baseline has no DRS
            items.append(obj)
    return items


def in_namespace(items: list[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
    return [{**i, "metadata": {**i["metadata"], "namespace": namespace}} for i in items]


def serial_apply(rc: RunningCluster, namespace: str, items: list[dict[str, Any]]) -> float:
    doc = json.dumps({"apiVersion": "v1", "kind": "List", "items": in_namespace(items, namespace)})
    t0 = time.monotonic()
    rc.kubectl("apply", "-n", namespace, "-f", "-", input=doc, timeout=900)
    return time.monotonic() - t0


def parallel_server_side_apply(
    rc: RunningCluster, namespace: str, items: list[dict[str, Any]], clients: int, verb: str = "apply"
) -> float:
    """``clients`` concurrent kubectl processes, each sending its share of ``items``
    (``kubectl apply --server-side``, or ``kubectl create`` with ``verb="create"``)."""
    ordered = in_namespace(items, namespace)
    shares = [ordered[i::clients] for i in range(clients)]
    how = ["apply", "--server-side", "--field-manager=bench"] if verb == "apply" else ["create"]
    argv = [str(rc.bin_dir / "kubectl"), *how, "-n", namespace, "-f", "-"]
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=rc.env)
        for _ in shares
    ]
    for proc, share in zip(procs, shares, strict=True):
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"apiVersion": "v1", "kind": "List", "items": share}).encode())
        proc.stdin.close()
    for proc in procs:
        proc.wait(timeout=900)
        assert proc.stderr is not None
        assert proc.returncode == 0, proc.stderr.read().decode()
    return time.monotonic() - t0


def drop_namespace(rc: RunningCluster, namespace: str) -> None:
    rc.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=900s", timeout=960)


# --------------------------------------------------------------------------- the operator
def resync_figures(op: OperatorProcess, pid: int, passes: int = 3) -> dict[str, float]:
    time.sleep(1.0)  # let the pass that saw the last change finish
    writes, reconciles, cpu = op.writes(), op.reconciles(), cpu_s(pid)
    seconds = op.total("drs_operator_reconcile_duration_seconds_sum")
    wait_for(f"{passes} resyncs", lambda: op.reconciles() >= reconciles + passes, timeout=600)
    done = op.reconciles() - reconciles
    return {
        "passes": done,
        "writes": op.writes() - writes,
        "cpu_s_per_pass": round((cpu_s(pid) - cpu) / done, 3),
        "reconcile_s_per_pass": round((op.total("drs_operator_reconcile_duration_seconds_sum") - seconds) / done, 3),
    }


def foreign_pods(rc: RunningCluster, count: int, clients: int) -> float:
    """``count`` pods without GPUs bound to a CPU node kwok does not run (they stay Pending but
    bound and unfinished, so they pass the operator's field-selected watch like running pods)."""
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "cpu-pool-0", "labels": {"pool": "cpu"}},
        "spec": {"taints": [{"key": "pool", "value": "cpu", "effect": "NoSchedule"}]},
    }
    rc.kubectl("apply", "-f", "-", input=json.dumps(node))
    rc.kubectl("create", "namespace", "foreign")
    pods = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"web-{i}", "namespace": "foreign", "labels": {"app": "web"}},
            "spec": {
                "nodeName": "cpu-pool-0",
                "tolerations": [{"operator": "Exists"}],
                "containers": [{"name": "web", "image": "nginx", "resources": {"requests": {"cpu": "10m"}}}],
            },
        }
        for i in range(count)
    ]
    return parallel_server_side_apply(rc, "foreign", pods, clients, verb="create")


def _r(x: float) -> float | None:
    return None if x != x else round(x, 2)  # NaN: the step did not run


def get_text(rc: RunningCluster, path: str) -> str:
    """GET ``path`` as text (the apiserver's ``/metrics``)."""
    api = _CLIENTS.get(str(rc.kubeconfig))
    if api is None:
        api = _CLIENTS[str(rc.kubeconfig)] = rc.api_client()
    method, url, headers, _, _ = api.param_serialize("GET", path, auth_settings=["BearerToken"])
    resp = api.call_api(method, url, header_params=headers, _request_timeout=60)
    resp.read()
    if resp.status != 200:
        raise RuntimeError(f"GET {path}: {resp.status}")
    text: str = resp.data.decode()
    return text


def audit_lines(rc: RunningCluster) -> list[str]:
    """The dev apiserver's audit log (pod deletes and evictions), if it keeps one."""
    log = rc.cluster.layout.audit_log
    return log.read_text().splitlines() if log.is_file() else []


# --------------------------------------------------------------------------- the steps of a run
@dataclasses.dataclass(frozen=True)
class Args:
    replicas: int
    frontends: int
    prefill: tuple[int, int]
    decode: tuple[int, int]
    clients: int
    foreign_pods: int
    ready_timeout: float
    skip_baselines: bool
    operator_args: tuple[str, ...]


def parse_args(argv: list[str] | None = None) -> Args:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--replicas", type=int, default=32)
    ap.add_argument("--frontends", type=int, default=8, help="frontends per replica")
    ap.add_argument("--prefill", default="1x4", help="engines x tensor parallel")
    ap.add_argument("--decode", default="2x2", help="engines x tensor parallel")
    ap.add_argument("--clients", type=int, default=8, help="parallel kubectl processes of the server-side baseline")
    ap.add_argument("--foreign-pods", type=int, default=0)
    ap.add_argument("--ready-timeout", type=float, default=900, help="seconds to wait for Ready")
    ap.add_argument("--skip-baselines", action="store_true", help="only the operator (e.g. for --foreign-pods)")
    ap.add_argument("--operator-args", default="", help="extra `drs operator` flags, space separated")
    a = ap.parse_args(argv)

    def pair(text: str) -> tuple[int, int]:
        engines, width = text.split("x")
        return int(engines), int(width)

    return Args(
        replicas=a.replicas,
        frontends=a.frontends,
        prefill=pair(a.prefill),
        decode=pair(a.decode),
        clients=a.clients,
        foreign_pods=a.foreign_pods,
        ready_timeout=a.ready_timeout,
        skip_baselines=a.skip_baselines,
        operator_args=tuple(a.operator_args.split()),
    )


def start_cluster(nodes: int, state: Path) -> tuple[DevCluster, RunningCluster, dict[str, int]]:
    """A private control plane with ``nodes`` 8-GPU nodes, the CRD and the bench's namespaces."""
    cluster = DevCluster.at(state, PORT_BASE, bin_dir=build.bin_dir())
    print(f"[bench] starting a private control plane with {nodes} 8-GPU nodes", file=sys.stderr, flush=True)
    cluster.up("hgx", nodes)
    rc = RunningCluster(cluster)
    plane = {t.name: t.pid for t in processes.load(cluster.layout.pids_file)}
    rc.kubectl("apply", "-f", str(ROOT / "crds"))
    rc.kubectl("wait", "--for=condition=Established", "crd/disaggreplicasets.disagg.dev", "--timeout=60s")
    return cluster, rc, plane


def run_baselines(rc: RunningCluster, items: list[dict[str, Any]], clients: int) -> tuple[float, float]:
    """Serial ``kubectl apply`` and parallel server-side apply of the same children, each on empty nodes."""
    print(f"[bench] serial kubectl apply of {len(items)} objects", file=sys.stderr, flush=True)
    serial_s = serial_apply(rc, "bench-serial", items)
    print(f"[bench] serial: {serial_s:.1f}s; deleting its namespace", file=sys.stderr, flush=True)
    drop_namespace(rc, "bench-serial")
    print(f"[bench] {clients} parallel kubectl apply --server-side", file=sys.stderr, flush=True)
    ssa_s = parallel_server_side_apply(rc, "bench-ssa", items, clients)
    print(f"[bench] server-side: {ssa_s:.1f}s; deleting its namespace", file=sys.stderr, flush=True)
    drop_namespace(rc, "bench-ssa")
    return serial_s, ssa_s


def start_operator(rc: RunningCluster, state: Path, extra: tuple[str, ...]) -> tuple[OperatorProcess, int]:
    op = OperatorProcess(rc, state / "operator.log", resync_s=5.0, extra_args=extra).start()
    assert op.proc is not None
    wait_for("the operator to lead with its caches listed", op.leading, timeout=120)
    return op, op.proc.pid


@dataclasses.dataclass(frozen=True)
class Applied:
    """What ``apply_fleet`` measured."""

    at: datetime.datetime  #: wall-clock moment of the apply (pod timestamps are relative to it)
    children_s: float
    ready_s: float | None
    cpu_children_s: float
    cpu_ready_s: float
    plane_cpu_s: dict[str, float]
    not_ready_conditions: Any


def apply_fleet(
    rc: RunningCluster, pid: int, body: dict[str, Any], items: int, plane: dict[str, int], ready_timeout: float
) -> Applied:
    """``kubectl apply`` of the fleet; time to every child and URL, then to Ready."""
    urls = body["spec"]["replicas"] * body["spec"]["frontend"]["workers"]
    cpu0, plane0 = cpu_s(pid), cpu_of(plane)
    print(
        f"[bench] applying a {body['spec']['replicas']}-replica fleet ({urls} frontends)", file=sys.stderr, flush=True
    )
    at, t0 = datetime.datetime.now(datetime.UTC), time.monotonic()
    rc.kubectl("apply", "-n", "bench", "-f", "-", input=json.dumps(body))

    def published() -> bool:
        return len(drs_status(rc, "bench", "big").get("urls", [])) == urls and count_children(rc, "bench") >= items

    wait_for("children and urls", published, timeout=900)
    children_s = time.monotonic() - t0
    print(f"[bench] children: {children_s:.1f}s", file=sys.stderr, flush=True)
    cpu_children = cpu_s(pid) - cpu0
    ready_s: float | None = None
    not_ready: Any = None
    try:
        wait_for("Ready", lambda: drs_status(rc, "bench", "big").get("phase") == "Ready", timeout=ready_timeout)
        ready_s = round(time.monotonic() - t0, 2)
    except AssertionError:  # still report what was measured; the status says how far it got
        not_ready = drs_status(rc, "bench", "big").get("conditions")
    plane1 = cpu_of(plane)
    return Applied(
        at=at,
        children_s=children_s,
        ready_s=ready_s,
        cpu_children_s=cpu_children,
        cpu_ready_s=cpu_s(pid) - cpu0,
        plane_cpu_s={k: round(plane1[k] - plane0[k], 1) for k in plane},
        not_ready_conditions=not_ready,
    )


def component_figures(rc: RunningCluster, applied: Applied, metrics_before: str) -> dict[str, Any]:
    """Which component the fleet waited for, and who deleted its pods (``scale_components``)."""
    pods = get_json(rc, "/api/v1/namespaces/bench/pods")["items"]
    timeline = scale_components.pod_timeline(pods, applied.at)
    before = scale_components.request_totals(metrics_before)
    after = scale_components.request_totals(get_text(rc, APISERVER_METRICS))
    events = get_json(rc, "/api/v1/events?fieldSelector=reason%3DNodeNotReady")["items"]
    return {
        "pods": timeline,
        "apiserver": scale_components.apiserver_latency(before, after),
        "nodes_turned_not_ready": scale_components.nodes_not_ready(events, applied.at),
        "pod_deletes_by": scale_components.pod_deletes_by(audit_lines(rc), "bench"),
        "bound_by": scale_components.bound_by(timeline, applied.ready_s),
    }


def operator_figures(op: OperatorProcess, pid: int, applied: Applied, pods: int) -> dict[str, Any]:
    writes = op.writes()
    return {
        "operator_cpu_s_to_children": round(applied.cpu_children_s, 2),
        "operator_cpu_s_to_ready": round(applied.cpu_ready_s, 2),
        "operator_rss_mib": rss_mib(pid),
        "control_plane_cpu_s_to_ready": applied.plane_cpu_s,
        "writes_total": writes,
        "writes_per_pod": round(writes / pods, 3),
        "retries": op.total("drs_operator_api_retries_total"),
        "in_flight_peak": op.total("drs_operator_api_in_flight_peak"),
        "resync": resync_figures(op, pid) if applied.ready_s is not None else None,
    }


def foreign_figures(rc: RunningCluster, op: OperatorProcess, pid: int, count: int, clients: int) -> dict[str, Any]:
    """``count`` unrelated pods, then the same resync figures again."""
    print(f"[bench] {count} foreign pods", file=sys.stderr, flush=True)
    seen = op.total('drs_operator_watch_events_total{cache="GpuPod"}')
    create_s = round(foreign_pods(rc, count, clients), 1)
    wait_for(
        "the operator to see every foreign pod",
        lambda: op.total('drs_operator_watch_events_total{cache="GpuPod"}') >= seen + count,
        timeout=600,
    )
    return {
        "foreign_pods": count,
        "foreign_pods_create_s": create_s,
        "resync_with_foreign_pods": resync_figures(op, pid),
        "operator_rss_mib_with_foreign_pods": rss_mib(pid),
    }


def measure(args: Args, rc: RunningCluster, plane: dict[str, int], state: Path) -> dict[str, Any]:
    """Baselines, then the operator on the same fleet; every figure of the JSON line."""
    n, f = args.replicas, args.frontends
    body = fleet("big", n, f, args.prefill, args.decode)
    items = children_manifests(rc, "bench", body)
    for ns in ("bench-serial", "bench-ssa", "bench"):
        rc.kubectl("create", "namespace", ns)
    serial_s, ssa_s = (float("nan"),) * 2 if args.skip_baselines else run_baselines(rc, items, args.clients)
    op, pid = start_operator(rc, state, args.operator_args)
    try:
        metrics_before = get_text(rc, APISERVER_METRICS)
        applied = apply_fleet(rc, pid, body, len(items), plane, args.ready_timeout)
        pods = len(get_json(rc, "/api/v1/namespaces/bench/pods", True)["items"])
        result: dict[str, Any] = {
            "replicas": n,
            "frontends": n * f,
            "engines_per_replica": args.prefill[0] + args.decode[0],
            "pods": pods,
            "child_objects": len(items),
            "serial_kubectl_apply_s": _r(serial_s),
            "parallel_server_side_apply_s": _r(ssa_s),
            "ssa_clients": args.clients,
            "apply_to_children_s": round(applied.children_s, 2),
            "ratio_to_serial": _r(applied.children_s / serial_s),
            "ratio_to_parallel_ssa": _r(applied.children_s / ssa_s),
            "apply_to_ready_s": applied.ready_s,
            "components": component_figures(rc, applied, metrics_before),
            **operator_figures(op, pid, applied, pods),
        }
        if applied.not_ready_conditions is not None:
            result["ready_not_reached"] = applied.not_ready_conditions
        print(f"[bench] {json.dumps(result)}", file=sys.stderr, flush=True)  # kept if what follows fails
        if args.foreign_pods and applied.ready_s is not None:
            result.update(foreign_figures(rc, op, pid, args.foreign_pods, args.clients))
        return result
    finally:
        op.kill(signal.SIGTERM)


def main() -> None:
    args = parse_args()
    state = Path(tempfile.mkdtemp(prefix="drs-bench-"))
    load_before = os.getloadavg()
    result: dict[str, Any] = {
        "bench": "operator_scale",
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "started_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    cluster, rc, plane = start_cluster(args.replicas, state)
    try:
        result.update(measure(args, rc, plane, state))
    finally:
        cluster.down()
    result["load_average_before_after"] = [round(x, 1) for x in (*load_before, *os.getloadavg())]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
