"""Start and stop the dev cluster's real nodes (``drs dev up --real-nodes R``).

For each node, in the cluster's network namespace and a mount namespace of the node's own
(``namespaces``): its own containerd (CRI plugin, runc on cgroupfs, the cluster's CNI bridge)
with the project's images imported (nothing is ever pulled), a kubelet registered under the
node's name with GPU topology labels, and the fake GPU device plugin, which registers with the
kubelet so ``nvidia.com/gpu`` capacity comes from a real device-plugin registration. Once per
cluster, in its network namespace: kube-proxy (nftables) for Services, kube-router's firewall
(iptables + ipset) for NetworkPolicies, and CoreDNS (on the bridge gateway) for their names.

Stopping deletes the nodes' pods through the API first (so the kubelet tears down their
sandboxes and CNI networking), stops every process by pid, kills containers that are left (and
their shims), then the namespace holders (the nodes' mounts go with them), and undoes the host
changes (hostnet).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from . import hostnet, images, namespaces, nodebuild, nodeconfig, processes, profiles
from .layout import Layout

PIDS_FILE = "real-nodes-pids.json"
HOST_RECORD = "real-nodes-host.json"
HOLDER_START_TIMEOUT_S = 10.0
CONTAINERD_START_TIMEOUT_S = 30.0
IMPORT_TIMEOUT_S = 600.0
KUBELET_HEALTHY_TIMEOUT_S = 60.0
NODE_READY_TIMEOUT_S = 120.0
SERVICE_START_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 60.0
POLL_S = 0.25
#: kube-router's chain for traffic no NetworkPolicy admits (made at its start, before the first sync).
KUBE_ROUTER_DEFAULT_CHAIN = "KUBE-NWPLCY-DEFAULT"


class RealNodeStartError(RuntimeError):
    """A real node did not come up; the message names the component and its log."""


def _say(msg: str) -> None:
    print(f"[drs dev] {msg}", file=sys.stderr, flush=True)


def pids_file(layout: Layout) -> Path:
    return layout.state_dir / PIDS_FILE


def _wait(what: str, ok: Any, timeout: float, proc: processes.Tracked | None = None) -> float:
    t0 = time.monotonic()
    while not ok():
        if proc is not None and not processes.is_running(proc):
            raise RealNodeStartError(f"{what}: exited; last lines of {proc.log}:\n{processes.log_tail(proc.log)}")
        if time.monotonic() - t0 > timeout:
            log = f"; last lines of {proc.log}:\n{processes.log_tail(proc.log)}" if proc else ""
            raise RealNodeStartError(f"{what}: not ready after {timeout:.0f}s{log}")
        time.sleep(POLL_S)
    return time.monotonic() - t0


def _http_ok(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return 200 <= int(resp.status) < 300
    except OSError:
        return False


def _ctr(dirs: nodeconfig.NodeDirs, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    argv = ["ctr", "--address", str(dirs.containerd_socket), "--namespace", "k8s.io", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


# ------------------------------------------------------------------------------------ start


def prepare_host(layout: Layout, real: int) -> None:
    """The host side, before the control plane starts (the apiserver listens on the veth)."""
    nodeconfig.check_count(real)
    net = nodeconfig.network(layout)
    record = hostnet.HostRecord(layout.state_dir / HOST_RECORD)
    roots = [nodeconfig.cgroup_root(net, i) for i in range(real)]
    hostnet.setup(net, record, [net.node_ip(i) for i in range(real)], roots)
    hostnet.share(record, list(nodeconfig.NODE_BINDS))


def start(layout: Layout, real: int, archive: Path) -> list[processes.Tracked]:
    """Start ``real`` nodes and the cluster services; every process is recorded as it starts."""
    bins = nodebuild.ensure_node_built(layout.bin_dir)
    net = nodeconfig.network(layout)
    started: list[processes.Tracked] = []

    def track(t: processes.Tracked) -> processes.Tracked:
        started.append(t)
        processes.save(pids_file(layout), started)
        return t

    resolv = layout.state_dir / "resolv.conf"
    resolv.write_text(nodeconfig.resolv_conf(net))
    for i in range(real):
        _start_node(layout, net, i, bins, archive, resolv, track)
    _start_services(layout, net, bins, track)
    for i in range(real):
        _wait_node_ready(layout, nodeconfig.node_name(i))
    if profiles.network_policies():
        _start_firewall(layout, net, bins, track)
    else:
        _say(f"NetworkPolicies not enforced ({profiles.NETWORK_POLICIES_ENV}=0): kube-router not started")
    return started


def _start_node(
    layout: Layout, net: nodeconfig.Network, i: int, bins: Path, archive: Path, resolv: Path, track: Any
) -> None:
    name = nodeconfig.node_name(i)
    dirs = nodeconfig.node_dirs(layout, i)
    for d in (dirs.root, dirs.cni_conf_dir, dirs.ipam_dir, dirs.kubelet_root, *dirs.binds.values()):
        d.mkdir(parents=True, exist_ok=True)
    sandbox = f"docker.io/library/{images.pause_ref()}"
    dirs.containerd_config.write_text(nodeconfig.containerd_toml(dirs, sandbox))
    (dirs.cni_conf_dir / "10-drs.conflist").write_text(nodeconfig.cni_conflist(net, dirs, i))
    holder = track(_start_holder(layout, dirs, name))
    inside = namespaces.entering(net.netns_path, holder.pid)
    containerd = track(
        processes.start(f"containerd {name}", ["/usr/bin/containerd", "--config", str(dirs.containerd_config)],
                        layout.log(f"containerd-{name}"), preexec=inside)
    )  # fmt: skip
    took = _wait(f"containerd {name}", lambda: _ctr(dirs, "version", timeout=5).returncode == 0,
                 CONTAINERD_START_TIMEOUT_S, containerd)  # fmt: skip
    _say(f"{name}: containerd ready in {took:.1f}s; importing {archive.name}")
    t0 = time.monotonic()
    out = _ctr(dirs, "images", "import", str(archive), timeout=IMPORT_TIMEOUT_S)
    if out.returncode != 0:
        raise RealNodeStartError(f"{name}: `ctr images import {archive}` failed: {out.stderr.strip()}")
    _say(f"{name}: images imported in {time.monotonic() - t0:.1f}s")
    config = nodeconfig.kubelet_config(layout, net, dirs, i, resolv)
    config["podLogsDir"] = str(dirs.root / "pod-logs")
    dirs.kubelet_config.write_text(yaml.safe_dump(config, sort_keys=False))
    kubelet = track(_start_kubelet_process(layout, i, bins, holder.pid))
    _wait_kubelet(layout, i, kubelet)
    plugin = [str(bins / "drs-device-plugin"), f"--dir={nodeconfig.DEVICE_PLUGIN_DIR}",
              f"--count={nodeconfig.GPUS_PER_REAL_NODE}", "--resource=nvidia.com/gpu"]  # fmt: skip
    track(processes.start(f"device-plugin {name}", plugin, layout.log(f"device-plugin-{name}"), preexec=inside))


def _start_holder(layout: Layout, dirs: nodeconfig.NodeDirs, name: str) -> processes.Tracked:
    """The process holding node ``name``'s mount namespace; waited on until its mounts are made."""
    log = layout.log(f"mount-namespace-{name}")
    holder = processes.start(
        f"mount-namespace {name}", namespaces.holder_argv(dirs.binds), log, exe=namespaces.sleep_binary()
    )
    alive = Path(f"/proc/{holder.pid}")
    deadline = time.monotonic() + HOLDER_START_TIMEOUT_S
    while not processes.is_running(holder):  # runs `sleep` once every bind mount is made
        if not alive.exists() or time.monotonic() > deadline:
            processes.stop([dataclasses.replace(holder, exe=str(Path(f"/proc/{holder.pid}/exe").resolve()))])
            raise RealNodeStartError(f"{name}: its mount namespace was not made; last lines of {log}:\n"
                                     f"{processes.log_tail(log)}")  # fmt: skip
        time.sleep(0.05)
    return holder


def _holder_pid(layout: Layout, i: int) -> int:
    name = f"mount-namespace {nodeconfig.node_name(i)}"
    for t in processes.load(pids_file(layout)):
        if t.name == name and processes.is_running(t):
            return t.pid
    raise RealNodeStartError(f"{nodeconfig.node_name(i)}: its mount namespace holder is not running")


def _start_kubelet_process(layout: Layout, i: int, bins: Path, holder_pid: int) -> processes.Tracked:
    name = nodeconfig.node_name(i)
    inside = namespaces.entering(nodeconfig.network(layout).netns_path, holder_pid)
    return processes.start(f"kubelet {name}", kubelet_argv(layout, i, bins), layout.log(f"kubelet-{name}"),
                           preexec=inside)  # fmt: skip


def kubelet_argv(layout: Layout, i: int, bins: Path) -> list[str]:
    name = nodeconfig.node_name(i)
    dirs = nodeconfig.node_dirs(layout, i)
    labels = ",".join(f"{k}={v}" for k, v in nodeconfig.node_labels(i).items())
    return [
        str(bins / "kubelet"),
        f"--config={dirs.kubelet_config}",
        f"--kubeconfig={layout.kubeconfig}",
        f"--root-dir={dirs.kubelet_root}",
        f"--cert-dir={dirs.root / 'kubelet-pki'}",
        f"--hostname-override={name}",
        f"--node-ip={nodeconfig.network(layout).node_ip(i)}",
        f"--node-labels={labels}",
        "--v=1",
    ]


def _wait_kubelet(layout: Layout, i: int, kubelet: processes.Tracked) -> None:
    ip = nodeconfig.network(layout).node_ip(i)
    healthz = f"http://{ip}:{nodeconfig.kubelet_healthz_port(layout, i)}/healthz"
    took = _wait(f"kubelet {nodeconfig.node_name(i)}", lambda: _http_ok(healthz), KUBELET_HEALTHY_TIMEOUT_S, kubelet)
    _say(f"{nodeconfig.node_name(i)}: kubelet healthy in {took:.1f}s")


def stop_kubelet(layout: Layout, i: int) -> None:
    """Stop node ``i``'s kubelet (its containers keep running, as on a node whose kubelet died)."""
    name = f"kubelet {nodeconfig.node_name(i)}"
    tracked = processes.load(pids_file(layout))
    processes.stop([t for t in tracked if t.name == name])
    processes.save(pids_file(layout), [t for t in tracked if t.name != name])


def start_kubelet(layout: Layout, i: int) -> None:
    """Start node ``i``'s kubelet again with the same configuration; wait until it is healthy."""
    kubelet = _start_kubelet_process(layout, i, layout.bin_dir, _holder_pid(layout, i))
    processes.save(pids_file(layout), [*processes.load(pids_file(layout)), kubelet])
    _wait_kubelet(layout, i, kubelet)


def _start_services(layout: Layout, net: nodeconfig.Network, bins: Path, track: Any) -> None:
    proxy_config = layout.state_dir / "kube-proxy.yaml"
    proxy_config.write_text(yaml.safe_dump(nodeconfig.kube_proxy_config(layout, net), sort_keys=False))
    inside = namespaces.entering(net.netns_path)
    proxy = track(
        processes.start("kube-proxy", [str(bins / "kube-proxy"), f"--config={proxy_config}", "--v=1"],
                        layout.log("kube-proxy"), preexec=inside)
    )  # fmt: skip
    healthz = f"http://{net.gateway}:{nodeconfig.port(layout, 'kube-proxy-healthz')}/healthz"
    # kube-proxy's /healthz says 503 until its first sync; /livez answers once it serves.
    livez = healthz.replace("/healthz", "/livez")
    took = _wait("kube-proxy", lambda: _http_ok(healthz) or _http_ok(livez), SERVICE_START_TIMEOUT_S, proxy)
    _say(f"kube-proxy (nftables) serving in {took:.1f}s")
    corefile = layout.state_dir / "Corefile"
    corefile.write_text(nodeconfig.corefile(layout, net))
    dns = track(
        processes.start("coredns", [str(bins / "drs-coredns"), "-conf", str(corefile)], layout.log("coredns"),
                        preexec=inside)
    )  # fmt: skip
    ready = f"http://{net.gateway}:{nodeconfig.port(layout, 'coredns-ready')}/ready"
    took = _wait("coredns", lambda: _http_ok(ready), SERVICE_START_TIMEOUT_S, dns)
    _say(f"CoreDNS ready in {took:.1f}s on {net.gateway}:53")


def _start_firewall(layout: Layout, net: nodeconfig.Network, bins: Path, track: Any) -> None:
    """kube-router's NetworkPolicy controller, once its node is registered (it reads the Node at
    start and exits without it)."""
    router = track(
        processes.start("kube-router", nodeconfig.kube_router_argv(layout, bins), layout.log("kube-router"),
                        preexec=namespaces.entering(net.netns_path))
    )  # fmt: skip
    # /healthz answers as soon as it listens; the chain of the traffic no policy admits is made
    # after its top-level chains (hooked into INPUT, FORWARD and OUTPUT), before the first sync.
    health = f"http://{net.gateway}:{nodeconfig.port(layout, 'kube-router-health')}/healthz"
    chain = ["nsenter", f"--net={net.netns_path}", "iptables", "-w", "5", "-S", KUBE_ROUTER_DEFAULT_CHAIN]

    def ready() -> bool:
        out = subprocess.run(chain, capture_output=True, timeout=30, check=False)
        return _http_ok(health) and out.returncode == 0

    took = _wait("kube-router", ready, SERVICE_START_TIMEOUT_S, router)
    _say(f"kube-router (NetworkPolicies: iptables + ipset) serving in {took:.1f}s")


def _core_api(layout: Layout) -> Any:
    from kubernetes import client, config

    return client.CoreV1Api(config.new_client_from_config(config_file=str(layout.kubeconfig)))


def _wait_node_ready(layout: Layout, name: str) -> None:
    api = _core_api(layout)

    def ready() -> bool:
        try:
            node = api.read_node(name)
        except Exception:  # not registered yet
            return False
        conditions = {c.type: c.status for c in (node.status.conditions or [])}
        gpus = (node.status.allocatable or {}).get("nvidia.com/gpu")
        return conditions.get("Ready") == "True" and gpus == str(nodeconfig.GPUS_PER_REAL_NODE)

    took = _wait(f"node {name} Ready with nvidia.com/gpu", ready, NODE_READY_TIMEOUT_S)
    _say(f"{name}: Ready with {nodeconfig.GPUS_PER_REAL_NODE} nvidia.com/gpu (device plugin) in {took:.1f}s")


def import_archive(layout: Layout, archive: Path, only: list[int] | None = None) -> None:
    """Import ``archive`` (a ``docker save`` of images) into the running real nodes' containerd
    (every node, or the indices ``only``), the nodes at once: an image the nodes did not get at
    start (the NeMo-Gym image, when a Gym pod is about to run; 1.6 GB, 40-65 s a node here)."""
    t0 = time.monotonic()
    indices = [i for i in _node_indices(layout) if only is None or i in only]
    nodes = {nodeconfig.node_name(i): nodeconfig.node_dirs(layout, i) for i in indices}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
        futures = {
            name: pool.submit(_ctr, dirs, "images", "import", str(archive), timeout=IMPORT_TIMEOUT_S)
            for name, dirs in nodes.items()
        }
    for name, future in futures.items():
        out = future.result()
        if out.returncode != 0:
            raise RealNodeStartError(f"{name}: `ctr images import {archive}` failed: {out.stderr.strip()}")
    _say(f"{', '.join(nodes)}: {archive.name} imported in {time.monotonic() - t0:.1f}s")


# ------------------------------------------------------------------------------------ stop


def _node_indices(layout: Layout) -> list[int]:
    root = layout.state_dir / "nodes"
    names = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    return [int(n.split("-")[1]) for n in names if n.startswith("real-")]


def _delete_pods(layout: Layout, nodes: list[str]) -> None:
    """Delete every pod bound to the real nodes (grace 0) so kubelets tear their sandboxes down.

    The nodes are tainted ``NoExecute`` first: controllers recreate deleted pods (a Deployment's,
    the operator's engines), and a kubelet refuses to start a pod that does not tolerate its
    node's NoExecute taint, so the drain is not a race against them."""
    with contextlib.suppress(Exception):
        api = _core_api(layout)
        taint = {"key": nodeconfig.STOPPING_TAINT, "value": "true", "effect": "NoExecute"}
        for node in nodes:
            with contextlib.suppress(Exception):
                api.patch_node(node, {"spec": {"unschedulable": True, "taints": [taint]}}, _request_timeout=10)
        for node in nodes:
            pods = api.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}", _request_timeout=10).items
            for pod in pods:
                with contextlib.suppress(Exception):
                    api.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0,
                                              _request_timeout=10)  # fmt: skip


def _running_tasks(dirs: nodeconfig.NodeDirs) -> list[str]:
    if not dirs.containerd_socket.exists():
        return []
    out = _ctr(dirs, "tasks", "ls", timeout=10)  # TASK PID STATUS; stopped tasks are listed too
    rows = [line.split() for line in out.stdout.splitlines()[1:]] if out.returncode == 0 else []
    return [row[0] for row in rows if len(row) >= 3 and row[2] == "RUNNING"]


def _kill_tasks(dirs: nodeconfig.NodeDirs) -> None:
    for task in _running_tasks(dirs):
        _ctr(dirs, "tasks", "kill", "-s", "SIGKILL", task, timeout=10)
    deadline = time.monotonic() + 10
    while _running_tasks(dirs) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for cid in _ctr(dirs, "tasks", "ls", "-q", timeout=10).stdout.split():
        _ctr(dirs, "tasks", "delete", "-f", cid, timeout=10)


def _shims_of(dirs: nodeconfig.NodeDirs) -> list[processes.Tracked]:
    """containerd shims started for this node's containerd (their command line names its socket)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if str(dirs.containerd_socket).encode() in argv and b"containerd-shim" in argv[0]:
                found.append(processes.Tracked("shim", int(pid), os.readlink(f"/proc/{pid}/exe"), ""))
    return found


def stop(layout: Layout) -> list[str]:
    """Stop the real nodes and services of the cluster at ``layout`` and undo the host changes."""
    indices = _node_indices(layout)
    tracked = processes.load(pids_file(layout))
    record = hostnet.HostRecord.load(layout.state_dir / HOST_RECORD)
    if not indices and not tracked and not record.data:
        return []
    all_dirs = [nodeconfig.node_dirs(layout, i) for i in indices]
    kubelets = [t for t in tracked if t.name.startswith("kubelet") and processes.is_running(t)]
    if kubelets:
        _delete_pods(layout, [nodeconfig.node_name(i) for i in indices])
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while any(_running_tasks(d) for d in all_dirs) and time.monotonic() < deadline:
            time.sleep(0.5)
    last = ("containerd", "mount-namespace")
    stopped = processes.stop(reversed([t for t in tracked if not t.name.startswith(last)]))
    for d in all_dirs:
        _kill_tasks(d)
    stopped += processes.stop([t for t in tracked if t.name.startswith("containerd")])
    for d in all_dirs:
        processes.stop(_shims_of(d))
    # The last processes of each node's mount namespace: its mounts (pod volumes, container
    # root filesystems, pod network namespaces) go with it.
    stopped += processes.stop([t for t in tracked if t.name.startswith("mount-namespace")])
    undone = hostnet.teardown(record)
    pids_file(layout).unlink(missing_ok=True)
    _say(f"real nodes: stopped {len(stopped)} processes, undid {', '.join(undone) or 'nothing'}")
    return stopped
