"""What real nodes change on the host, recorded so ``drs dev down`` undoes exactly that.

* the cluster's CNI bridge with the gateway and node addresses (created before the apiserver,
  which listens on the gateway address);
* one iptables chain of ours jumped to from FORWARD: traffic may be forwarded from the bridge to
  the bridge (pod to Service to pod), nothing else leaves or enters it;
* sysctls: ``net.ipv4.ip_forward=1`` (pods reach Services through the gateway) and the ones the
  kubelet sets at start (``vm.overcommit_memory``, ``kernel.panic``, ``kernel.panic_on_oops``):
  all recorded before and restored afterwards;
* the kubelet's cgroup root in every cgroup v1 hierarchy;
* mounts under the cluster's directories (pod volumes, container root filesystems, network
  namespaces), unmounted deepest first.

The record is a JSON file in the state directory, written before each change is made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from .nodeconfig import Network

SYSCTLS = (
    "net.ipv4.ip_forward",
    "net.bridge.bridge-nf-call-iptables",
    "vm.overcommit_memory",
    "kernel.panic",
    "kernel.panic_on_oops",
)
CGROUP_ROOT = Path("/sys/fs/cgroup")
CMD_TIMEOUT_S = 30.0


class HostError(RuntimeError):
    """A host change failed; the message names the command and its error."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=CMD_TIMEOUT_S, check=False)
    if check and out.returncode != 0:
        raise HostError(f"`{' '.join(argv)}` failed: {out.stderr.strip()}")
    return out


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def read_sysctl(name: str) -> str | None:
    try:
        return _sysctl_path(name).read_text().strip()
    except OSError:
        return None


def write_sysctl(name: str, value: str) -> None:
    _sysctl_path(name).write_text(value + "\n")


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


#: Chains the kubelet adds at start (table, chain) and the jumps to them (table, from-chain, chain).
KUBELET_CHAINS = (
    ("filter", "KUBE-FIREWALL"),
    ("filter", "KUBE-KUBELET-CANARY"),
    ("nat", "KUBE-KUBELET-CANARY"),
    ("mangle", "KUBE-KUBELET-CANARY"),
    ("mangle", "KUBE-IPTABLES-HINT"),
)
KUBELET_JUMPS = (("filter", "INPUT", "KUBE-FIREWALL"), ("filter", "OUTPUT", "KUBE-FIREWALL"))
CONTAINER_LOGS = Path("/var/log/containers")


def _nft_tables() -> list[str]:
    out = _run("nft", "list", "tables", check=False)
    return sorted(line.strip() for line in out.stdout.splitlines() if line.startswith("table"))


def setup(net: Network, record: HostRecord, node_ips: list[str], cgroup_root: str) -> None:
    """Create the bridge, the forward chain, the cgroup root; record and set the sysctls."""
    record.note("sysctls", {name: read_sysctl(name) for name in SYSCTLS if read_sysctl(name) is not None})
    record.note("nftTables", _nft_tables())
    record.note("kubeletChains", [list(c) for c in KUBELET_CHAINS if not _chain_exists(*c)])
    record.note("containerLogsDir", not CONTAINER_LOGS.exists())
    record.note("network", dataclasses.asdict(net))
    if _run("ip", "link", "show", net.bridge, check=False).returncode != 0:
        record.note("bridge", net.bridge)
        _run("ip", "link", "add", net.bridge, "type", "bridge")
    prefix = net.cidr.split("/")[1]
    have = _run("ip", "-o", "addr", "show", "dev", net.bridge).stdout
    for ip in [net.gateway, *node_ips]:
        if f" {ip}/" not in have:
            _run("ip", "addr", "add", f"{ip}/{prefix}", "dev", net.bridge)
    _run("ip", "link", "set", net.bridge, "up")
    _add_forward_chain(net, record)
    write_sysctl("net.ipv4.ip_forward", "1")
    created = []
    for d in _cgroup_dirs(cgroup_root):
        if not d.exists():
            created.append(str(d))
            record.note("cgroups", created)
            d.mkdir()
        # A new cpuset cgroup has no CPUs or memory nodes: give it its parent's, or nothing can run.
        for name in ("cpuset.cpus", "cpuset.mems"):
            if (d / name).exists() and not (d / name).read_text().strip():
                (d / name).write_text((d.parent / name).read_text())


def _add_forward_chain(net: Network, record: HostRecord) -> None:
    chain = net.iptables_chain
    record.note("chain", chain)
    if _run("iptables", "-w", "-n", "-L", chain, check=False).returncode != 0:
        _run("iptables", "-w", "-N", chain)
    _run("iptables", "-w", "-F", chain)
    _run("iptables", "-w", "-A", chain, "-i", net.bridge, "-o", net.bridge, "-j", "ACCEPT")
    _run("iptables", "-w", "-A", chain, "-i", net.bridge, "-j", "DROP")
    _run("iptables", "-w", "-A", chain, "-o", net.bridge, "-j", "DROP")
    if _run("iptables", "-w", "-C", "FORWARD", "-j", chain, check=False).returncode != 0:
        _run("iptables", "-w", "-I", "FORWARD", "1", "-j", chain)


def _chain_exists(table: str, chain: str) -> bool:
    return _run("iptables", "-w", "-t", table, "-n", "-L", chain, check=False).returncode == 0


def _remove_kubelet_chains(data: dict[str, Any]) -> list[str]:
    """The kubelet's iptables chains (IPv4 and IPv6) that were not there before, then the nftables
    tables that did not exist before and are left without rules."""
    removed = []
    ours = {tuple(c) for c in data.get("kubeletChains", [])}
    for binary in ("iptables", "ip6tables"):
        for table, source, chain in KUBELET_JUMPS:
            if (table, chain) in ours:
                while _run(binary, "-w", "-t", table, "-D", source, "-j", chain, check=False).returncode == 0:
                    pass
        for table, chain in KUBELET_CHAINS:
            if (table, chain) in ours:
                _run(binary, "-w", "-t", table, "-F", chain, check=False)
                if _run(binary, "-w", "-t", table, "-X", chain, check=False).returncode == 0:
                    removed.append(f"{binary} {table}/{chain}")
    before = set(data.get("nftTables", []))
    for table in sorted(set(_nft_tables()) - before):
        family, name = table.split()[1:3]
        if family in ("ip", "ip6") and name in ("filter", "nat", "mangle"):
            listing = _run("nft", "list", "table", family, name, check=False).stdout
            if _is_bare(listing):
                _run("nft", "delete", "table", family, name, check=False)
                removed.append(f"nft table {family} {name}")
    return removed


def _is_bare(listing: str) -> bool:
    """An nftables table listing with chains but no rules (only hooks, policies and braces)."""
    for line in listing.splitlines():
        text = line.strip()
        if text and not (text.startswith(("table ", "chain ", "type ")) or text == "}"):
            return False
    return True


def remove_log_links(pod_logs: Path) -> None:
    """The kubelet's /var/log/containers links into a node's pod log directory."""
    if not CONTAINER_LOGS.is_dir():
        return
    for link in CONTAINER_LOGS.iterdir():
        with contextlib.suppress(OSError):
            if link.is_symlink() and os.readlink(link).startswith(str(pod_logs) + "/"):
                link.unlink()


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


def unmount_under(*roots: Path) -> list[str]:
    points = mounts_under(*roots)
    for point in points:
        if _run("umount", point, check=False).returncode != 0:
            _run("umount", "-l", point, check=False)
    return points


def teardown(record: HostRecord) -> list[str]:
    """Undo what ``setup`` recorded; return what was undone (for the log)."""
    undone: list[str] = []
    data = record.data
    chain = data.get("chain")
    if chain:
        while _run("iptables", "-w", "-D", "FORWARD", "-j", chain, check=False).returncode == 0:
            pass
        _run("iptables", "-w", "-F", chain, check=False)
        _run("iptables", "-w", "-X", chain, check=False)
        undone.append(f"iptables chain {chain}")
    undone += _remove_kubelet_chains(data)
    if data.get("containerLogsDir"):
        with contextlib.suppress(OSError):
            CONTAINER_LOGS.rmdir()
    bridge = data.get("bridge")
    if bridge and _run("ip", "link", "del", bridge, check=False).returncode == 0:
        undone.append(f"bridge {bridge}")
    for d in sorted(data.get("cgroups", []), key=len, reverse=True):
        _remove_cgroup_tree(Path(d))
    for name, value in (data.get("sysctls") or {}).items():
        if read_sysctl(name) != value:
            with contextlib.suppress(OSError):
                write_sysctl(name, value)
                undone.append(f"{name}={value}")
    record.path.unlink(missing_ok=True)
    return undone


def _remove_cgroup_tree(root: Path) -> None:
    if not root.is_dir():
        return
    for dirpath, _dirs, _files in sorted(os.walk(root), key=lambda t: -t[0].count("/")):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)
