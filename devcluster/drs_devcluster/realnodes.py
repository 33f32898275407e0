"""Start and stop the dev cluster's real nodes (``drs dev up --real-nodes R``).

For each node: its own containerd (CRI plugin, runc on cgroupfs, the cluster's CNI bridge) with
the project's images imported (nothing is ever pulled), a kubelet registered under the node's
name with GPU topology labels, and the fake GPU device plugin, which registers with the kubelet
so ``nvidia.com/gpu`` capacity comes from a real device-plugin registration. Once per cluster:
kube-proxy (nftables) for Services and CoreDNS (on the bridge gateway) for their names.

Stopping deletes the nodes' pods through the API first (so the kubelet tears down their
sandboxes and CNI networking), stops every process by pid, kills containers that are left,
unmounts what is left under the node directories, and undoes the host changes (hostnet).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from . import hostnet, images, nodebuild, nodeconfig, processes
from .layout import Layout

PIDS_FILE = "real-nodes-pids.json"
HOST_RECORD = "real-nodes-host.json"
CONTAINERD_START_TIMEOUT_S = 30.0
IMPORT_TIMEOUT_S = 600.0
KUBELET_HEALTHY_TIMEOUT_S = 60.0
NODE_READY_TIMEOUT_S = 120.0
SERVICE_START_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 60.0
POLL_S = 0.25


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
    """The host side, before the control plane starts (the apiserver listens on the gateway)."""
    nodeconfig.check_count(real)
    net = nodeconfig.network()
    for name, port in nodeconfig.ports(layout, real).items():
        processes.check_port_free("127.0.0.1", port, name)
    record = hostnet.HostRecord(layout.state_dir / HOST_RECORD)
    hostnet.setup(net, record, [net.node_ip(i) for i in range(real)], nodeconfig.cgroup_root(net))
    nodeconfig.DEVICE_PLUGIN_DIR.mkdir(parents=True, exist_ok=True)


def start(layout: Layout, real: int, archive: Path) -> list[processes.Tracked]:
    """Start ``real`` nodes and the cluster services; every process is recorded as it starts."""
    bins = nodebuild.ensure_node_built(layout.bin_dir)
    net = nodeconfig.network()
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
    return started


def _start_node(
    layout: Layout, net: nodeconfig.Network, i: int, bins: Path, archive: Path, resolv: Path, track: Any
) -> None:
    name = nodeconfig.node_name(i)
    dirs = nodeconfig.node_dirs(layout, i)
    for d in (dirs.root, dirs.cni_conf_dir, dirs.ipam_dir, dirs.kubelet_root):
        d.mkdir(parents=True, exist_ok=True)
    sandbox = f"docker.io/library/{images.pause_ref()}"
    dirs.containerd_config.write_text(nodeconfig.containerd_toml(dirs, sandbox))
    (dirs.cni_conf_dir / "10-drs.conflist").write_text(nodeconfig.cni_conflist(net, dirs, i))
    containerd = track(
        processes.start(f"containerd {name}", ["/usr/bin/containerd", "--config", str(dirs.containerd_config)],
                        layout.log(f"containerd-{name}"))
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
    kubelet = track(processes.start(f"kubelet {name}", kubelet_argv(layout, i, bins), layout.log(f"kubelet-{name}")))
    _wait_kubelet(layout, i, kubelet)
    plugin = [str(bins / "drs-device-plugin"), f"--dir={nodeconfig.DEVICE_PLUGIN_DIR}",
              f"--count={nodeconfig.GPUS_PER_REAL_NODE}", "--resource=nvidia.com/gpu"]  # fmt: skip
    track(processes.start(f"device-plugin {name}", plugin, layout.log(f"device-plugin-{name}")))


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
        f"--node-ip={nodeconfig.network().node_ip(i)}",
        f"--node-labels={labels}",
        "--v=1",
    ]


def _wait_kubelet(layout: Layout, i: int, kubelet: processes.Tracked) -> None:
    healthz = f"http://127.0.0.1:{nodeconfig.kubelet_healthz_port(layout, i)}/healthz"
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
    name = f"kubelet {nodeconfig.node_name(i)}"
    kubelet = processes.start(
        name, kubelet_argv(layout, i, layout.bin_dir), layout.log(f"kubelet-{nodeconfig.node_name(i)}")
    )
    processes.save(pids_file(layout), [*processes.load(pids_file(layout)), kubelet])
    _wait_kubelet(layout, i, kubelet)


def _start_services(layout: Layout, net: nodeconfig.Network, bins: Path, track: Any) -> None:
    proxy_config = layout.state_dir / "kube-proxy.yaml"
    proxy_config.write_text(yaml.safe_dump(nodeconfig.kube_proxy_config(layout, net), sort_keys=False))
    proxy = track(
        processes.start("kube-proxy", [str(bins / "kube-proxy"), f"--config={proxy_config}", "--v=1"],
                        layout.log("kube-proxy"))
    )  # fmt: skip
    healthz = f"http://127.0.0.1:{nodeconfig.port(layout, 'kube-proxy-healthz')}/healthz"
    # kube-proxy's /healthz says 503 until its first sync; /livez answers once it serves.
    livez = healthz.replace("/healthz", "/livez")
    took = _wait("kube-proxy", lambda: _http_ok(healthz) or _http_ok(livez), SERVICE_START_TIMEOUT_S, proxy)
    _say(f"kube-proxy (nftables) serving in {took:.1f}s")
    corefile = layout.state_dir / "Corefile"
    corefile.write_text(nodeconfig.corefile(layout, net))
    dns = track(processes.start("coredns", [str(bins / "drs-coredns"), "-conf", str(corefile)], layout.log("coredns")))
    ready = f"http://127.0.0.1:{nodeconfig.port(layout, 'coredns-ready')}/ready"
    took = _wait("coredns", lambda: _http_ok(ready), SERVICE_START_TIMEOUT_S, dns)
    _say(f"CoreDNS ready in {took:.1f}s on {net.gateway}:53")


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


# ------------------------------------------------------------------------------------ stop


def _node_indices(layout: Layout) -> list[int]:
    root = layout.state_dir / "nodes"
    names = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    return [int(n.split("-")[1]) for n in names if n.startswith("real-")]


def _delete_pods(layout: Layout, nodes: list[str]) -> None:
    """Delete every pod bound to the real nodes (grace 0) so kubelets tear their sandboxes down."""
    with contextlib.suppress(Exception):
        api = _core_api(layout)
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


def _sandbox_netns(dirs: nodeconfig.NodeDirs) -> list[str]:
    """The network namespace paths of this node's containers (CRI bind-mounts them in /run/netns)."""
    paths: list[str] = []
    out = _ctr(dirs, "containers", "ls", "-q", timeout=10)
    for cid in out.stdout.split() if out.returncode == 0 else []:
        info = _ctr(dirs, "containers", "info", cid, timeout=10)
        with contextlib.suppress(ValueError, KeyError, TypeError):
            spec = json.loads(info.stdout)["Spec"]
            paths += [n["path"] for n in spec["linux"]["namespaces"] if n["type"] == "network" and n.get("path")]
    return sorted(set(paths))


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
    netns = [p for d in all_dirs for p in _sandbox_netns(d)]
    stopped = processes.stop(reversed([t for t in tracked if not t.name.startswith("containerd")]))
    for d in all_dirs:
        _kill_tasks(d)
    stopped += processes.stop([t for t in tracked if t.name.startswith("containerd")])
    for d in all_dirs:
        processes.stop(_shims_of(d))
    _cleanup_kube_proxy(layout)
    unmounted = hostnet.unmount_under(*(d.root for d in all_dirs))
    for path in netns:
        if hostnet.mounts_under(Path(path)):
            hostnet.unmount_under(Path(path))
        Path(path).unlink(missing_ok=True)
    _cleanup_device_plugin_dir()
    for d in all_dirs:
        hostnet.remove_log_links(d.root / "pod-logs")
    undone = hostnet.teardown(record)
    pids_file(layout).unlink(missing_ok=True)
    _say(
        f"real nodes: stopped {len(stopped)} processes, {len(unmounted)} mounts, undid {', '.join(undone) or 'nothing'}"
    )
    return stopped


def _cleanup_kube_proxy(layout: Layout) -> None:
    binary = layout.bin_dir / "kube-proxy"
    config = layout.state_dir / "kube-proxy.yaml"
    if binary.is_file() and config.is_file():
        subprocess.run([str(binary), "--cleanup", f"--config={config}"], capture_output=True, timeout=60, check=False)


def _cleanup_device_plugin_dir() -> None:
    d = nodeconfig.DEVICE_PLUGIN_DIR
    for name in ("kubelet.sock", "drs-gpu.sock", "kubelet_internal_checkpoint"):
        (d / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        d.rmdir()
    with contextlib.suppress(OSError):
        d.parent.rmdir()


def remove_node_dirs(layout: Layout) -> None:
    root = layout.state_dir / "nodes"
    if root.is_dir() and not hostnet.mounts_under(root):
        shutil.rmtree(root, ignore_errors=True)
