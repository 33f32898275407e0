"""What real nodes change on the host, recorded so ``drs dev down`` undoes exactly that.

* the cluster's network namespace (``drs<net>``) with its bridge (gateway and node addresses),
  ``ip_forward`` on inside it, and the veth pair to the host (the host end holds the address the
  apiserver listens on; created before the apiserver). Everything the kubelets, kube-proxy and
  kube-router add to the network stack (iptables chains, the ``kube-proxy`` nftables table,
  kube-router's ipsets) lives inside it and goes with it;
* each node's cgroup root in every cgroup v1 hierarchy;
* machine-wide (``hostshare``): the kernel settings the kubelet changes and the empty mount points
  of the nodes' bind mounts, restored by the last cluster with real nodes to leave.

The host's own network stack (its iptables, nftables, routes other than the veth's, sysctls of
its namespace) is never touched. The record is a JSON file in the state directory, written
before each change is made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from . import hostshare
from .nodeconfig import Network

CGROUP_ROOT = Path("/sys/fs/cgroup")
CMD_TIMEOUT_S = 30.0


class HostError(RuntimeError):
    """A host change failed; the message names the command and its error."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=CMD_TIMEOUT_S, check=False)
    if check and out.returncode != 0:
        raise HostError(f"`{' '.join(argv)}` failed: {out.stderr.strip()}")
    return out


@dataclasses.dataclass
class HostRecord:
    """What was changed (and the values before), persisted next to the cluster's state."""

    path: Path
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> HostRecord:
        try:
            return cls(path, json.loads(path.read_text()))
        except (OSError, ValueError):
            return cls(path, {})

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2))
        tmp.replace(self.path)

    def note(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.save()


def _cgroup_dirs(root: str) -> list[Path]:
    hierarchies = (
        [p for p in CGROUP_ROOT.iterdir() if p.is_dir() and not p.is_symlink()] if CGROUP_ROOT.is_dir() else []
    )
    return [h / root.lstrip("/") for h in hierarchies]


class NetworkTakenError(HostError):
    """The pod network is in use by another dev cluster."""


def _exists(*argv: str) -> bool:
    return _run(*argv, check=False).returncode == 0


def setup(net: Network, record: HostRecord, node_ips: list[str], cgroup_roots: list[str]) -> None:
    """Create the cluster's network namespace, bridge and veth, and the nodes' cgroup roots."""
    if net.netns_path.exists() or _exists("ip", "link", "show", net.host_veth):
        raise NetworkTakenError(
            f"pod network {net.net} ({net.cidr}) is in use: network namespace {net.netns} or link "
            f"{net.host_veth} exists (another dev cluster with real nodes); pick another DRS_DEV_NODE_NET"
        )
    record.note("network", dataclasses.asdict(net))
    _run("ip", "netns", "add", net.netns)  # recorded once made: a clash must not undo another's
    record.note("netns", net.netns)
    inside = ("ip", "-n", net.netns)
    prefix = net.cidr.split("/")[1]
    _run(*inside, "link", "set", "lo", "up")
    _run(*inside, "link", "add", net.bridge, "type", "bridge")
    for ip in [net.gateway, *node_ips]:
        _run(*inside, "addr", "add", f"{ip}/{prefix}", "dev", net.bridge)
    _run(*inside, "link", "set", net.bridge, "up")
    _run("ip", "link", "add", net.host_veth, "type", "veth", "peer", "name", net.peer_veth, "netns", net.netns)
    record.note("veth", net.host_veth)
    _run(*inside, "link", "set", net.peer_veth, "master", net.bridge, "up")
    _run("ip", "addr", "add", f"{net.host_ip}/{prefix}", "dev", net.host_veth)
    _run("ip", "link", "set", net.host_veth, "up")
    # Pods reach Services through the gateway: forwarding inside the namespace only.
    _run("nsenter", f"--net={net.netns_path}", "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
    # Pod-to-pod packets cross the bridge: iptables (kube-router's NetworkPolicy rules) sees them
    # only with this on (the default of a new namespace; set so it never depends on that).
    _run("nsenter", f"--net={net.netns_path}", "sh", "-c", "echo 1 > /proc/sys/net/bridge/bridge-nf-call-iptables")
    created: list[str] = []
    for root in cgroup_roots:
        for d in _cgroup_dirs(root):
            if not d.exists():
                created.append(str(d))
                record.note("cgroups", created)
                d.mkdir()
            # A new cpuset cgroup has no CPUs or memory nodes: give it its parent's, or nothing can run.
            for name in ("cpuset.cpus", "cpuset.mems"):
                if (d / name).exists() and not (d / name).read_text().strip():
                    (d / name).write_text((d.parent / name).read_text())


def share(record: HostRecord, mount_points: list[Path]) -> None:
    """Join the machine-wide holders (before any kubelet changes a kernel setting)."""
    record.note("shared", True)
    hostshare.acquire(record.path, mount_points)


def mounts_under(*roots: Path) -> list[str]:
    """Mount points at or below any of ``roots``, deepest first."""
    prefixes = [str(r.resolve()) for r in roots]
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if any(point == p or point.startswith(p + "/") for p in prefixes):
                found.append(point)
    return sorted(set(found), key=lambda p: (-p.count("/"), p))


def teardown(record: HostRecord) -> list[str]:
    """Undo what ``setup`` and ``share`` recorded; return what was undone (for the log)."""
    undone: list[str] = []
    data = record.data
    veth = data.get("veth")
    if veth and _exists("ip", "link", "del", veth):
        undone.append(f"veth {veth}")
    netns = data.get("netns")
    if netns and _exists("ip", "netns", "del", netns):
        undone.append(f"network namespace {netns} (its bridge, chains and nftables tables)")
    for d in sorted(data.get("cgroups", []), key=len, reverse=True):
        _remove_cgroup_tree(Path(d))
    if data.get("shared"):
        undone += hostshare.release(record.path)
    record.path.unlink(missing_ok=True)
    return undone


def _remove_cgroup_tree(root: Path) -> None:
    if not root.is_dir():
        return
    for dirpath, _dirs, _files in sorted(os.walk(root), key=lambda t: -t[0].count("/")):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)
