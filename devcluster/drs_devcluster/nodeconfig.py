"""Real nodes of the dev cluster: their addresses, ports and configuration files. Pure: nothing
here starts a process or touches the host.

A real node is a kubelet with its own containerd (CRI, cgroupfs, runc), pods on one CNI bridge
of the cluster's own (``drs<net>br``, ``10.<100 + net>.0.0/16``), kube-proxy (nftables) and
CoreDNS for Services, and a fake GPU device plugin. Every address is on this machine.

Nothing a real node uses is named machine-wide, so several nodes per cluster and several
clusters per machine coexist:

* the cluster's network lives in a network namespace of its own (``drs<net>``): the bridge, the
  node addresses, the pods' routes, kube-proxy's nftables table ``kube-proxy`` (a fixed name), the
  kubelet's iptables chains (fixed names) and ``ip_forward``. A veth pair joins it to the host:
  the host end (``drs<net>h``) holds the address the apiserver listens on, so pods reach the
  apiserver and the host (tests, the apiserver's calls to kubelets) reaches pods and nodes;
* each node runs in a mount namespace of its own (slave to the host's, so nothing propagates
  back), where node directories are bind-mounted over the paths the kubelet, containerd and CNI
  fix: the device-plugin directory, containerd's shim and runc state under /run/containerd, the
  CNI result cache and /var/log/containers (see ``NODE_BINDS``);
* per-node cgroup roots (the kubelet removes pod cgroups it does not know under its root).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
from pathlib import Path
from typing import Any, Final

from . import profiles
from .layout import SERVICE_CIDR, Layout

CLUSTER_DOMAIN: Final = "cluster.local"
REAL_NODE_LABEL: Final = "disagg.dev/real-node"
#: The taint ``drs dev down`` puts on real nodes before deleting their pods.
STOPPING_TAINT: Final = "disagg.dev/stopping"
#: Offsets from the port base (after the control plane's 0-6).
#: kube-router's health port comes after the nodes' (11 + 2 * MAX_REAL_NODES).
PORT_OFFSETS: Final = {
    "coredns-health": 7,
    "coredns-ready": 8,
    "kube-proxy-healthz": 9,
    "kube-proxy-metrics": 10,
    "kube-router-health": 27,
}
NODE_PORT_OFFSET: Final = 11  # node i: kubelet 11 + 2i, its healthz 12 + 2i
MAX_REAL_NODES: Final = 8
assert PORT_OFFSETS["kube-router-health"] == NODE_PORT_OFFSET + 2 * MAX_REAL_NODES
#: Every port a cluster may take is ``port_base + 0 .. port_base + CLUSTER_PORT_SPAN - 1``.
CLUSTER_PORT_SPAN: Final = max(PORT_OFFSETS.values()) + 1
#: The kubelet's device-plugin directory is fixed (not under --root-dir): bind-mounted per node.
DEVICE_PLUGIN_DIR: Final = Path("/var/lib/kubelet/device-plugins")
#: Machine-wide paths the kubelet, containerd 1.6 (shim sockets, runc state) and libcni (its
#: result cache) fix, and the node subdirectory bind-mounted over each in the node's mount
#: namespace.
NODE_BINDS: Final = {
    DEVICE_PLUGIN_DIR: "device-plugins",
    Path("/run/containerd"): "run-containerd",
    Path("/var/lib/cni"): "cni-cache",
    Path("/var/log/containers"): "container-logs",
}
GPUS_PER_REAL_NODE: Final = 8
GPU_PRODUCT: Final = "NVIDIA-H100-80GB-HBM3"
#: Lease and status cadence the dev controller-manager's 10 s grace period accepts.
NODE_LEASE_DURATION_S: Final = 8
NODE_STATUS_UPDATE: Final = "2s"


#: Pod networks one machine offers (10.100.0.0/16 - 10.249.0.0/16).
NETWORKS: Final = 150


def test_network(dev_net: int) -> int:
    """The test session's real-node network: half the range away from the dev cluster's own, so a
    person's ``drs dev up --real-nodes`` and the tests' cluster coexist."""
    return (dev_net + NETWORKS // 2) % NETWORKS


class RealNodeError(ValueError):
    """A bad real-node request; the message names the rule."""


@dataclasses.dataclass(frozen=True)
class Network:
    """The cluster's pod network: one bridge, a /16, the gateway and one address per node."""

    net: int

    @property
    def slot(self) -> int:
        """Which of the NETWORKS /16s (10.100-10.249): networks of one slot are the same network."""
        return self.net % NETWORKS

    @property
    def bridge(self) -> str:
        return f"drs{self.slot}br"

    @property
    def cidr(self) -> str:
        return f"10.{100 + self.slot}.0.0/16"

    @property
    def gateway(self) -> str:
        return str(ipaddress.ip_network(self.cidr).network_address + 1)

    def node_ip(self, index: int) -> str:
        return str(ipaddress.ip_network(self.cidr).network_address + 10 + index)

    @property
    def host_ip(self) -> str:
        """The host end of the veth into the cluster's namespace: where the apiserver listens."""
        return str(ipaddress.ip_network(self.cidr).network_address + 2)

    @property
    def netns(self) -> str:
        return f"drs{self.slot}"

    @property
    def host_veth(self) -> str:
        return f"drs{self.slot}h"

    @property
    def peer_veth(self) -> str:
        return f"drs{self.slot}p"

    @property
    def netns_path(self) -> Path:
        return Path("/run/netns") / self.netns

    def pod_range(self, index: int) -> tuple[str, str]:
        """The first and last pod address of node ``index`` (10.x.<1+i>.2 - .254)."""
        base = ipaddress.ip_network(self.cidr).network_address + 256 * (1 + index)
        return str(base + 2), str(base + 254)


def network(layout: Layout | None = None) -> Network:
    """The cluster's network: the one recorded for ``layout``, else ``DRS_DEV_NODE_NET``'s."""
    if layout is not None and layout.pod_net is not None:
        return Network(layout.pod_net)
    return Network(profiles.node_net())


def node_name(index: int) -> str:
    return f"real-{index:03d}"


def check_count(real: int) -> None:
    if not 0 <= real <= MAX_REAL_NODES:
        raise RealNodeError(
            f"--real-nodes must be between 0 and {MAX_REAL_NODES}, got {real}: each real node takes a slice "
            f"of the cluster's pod network and two ports, and this machine's budget is {MAX_REAL_NODES}"
        )


def port(layout: Layout, name: str) -> int:
    return layout.port_base + PORT_OFFSETS[name]


def kubelet_port(layout: Layout, index: int) -> int:
    return layout.port_base + NODE_PORT_OFFSET + 2 * index


def kubelet_healthz_port(layout: Layout, index: int) -> int:
    return kubelet_port(layout, index) + 1


def ports(layout: Layout, real: int) -> dict[str, int]:
    out = {name: port(layout, name) for name in PORT_OFFSETS}
    for i in range(real):
        out[f"kubelet {node_name(i)}"] = kubelet_port(layout, i)
        out[f"kubelet healthz {node_name(i)}"] = kubelet_healthz_port(layout, i)
    return out


@dataclasses.dataclass(frozen=True)
class NodeDirs:
    """Files of one real node under the cluster's state directory."""

    root: Path

    @property
    def containerd_root(self) -> Path:
        return self.root / "containerd"

    @property
    def containerd_state(self) -> Path:
        return self.root / "containerd-state"

    @property
    def containerd_socket(self) -> Path:
        return self.root / "containerd.sock"

    @property
    def containerd_config(self) -> Path:
        return self.root / "containerd.toml"

    @property
    def cni_conf_dir(self) -> Path:
        return self.root / "cni"

    @property
    def ipam_dir(self) -> Path:
        return self.root / "ipam"

    @property
    def kubelet_root(self) -> Path:
        return self.root / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.root / "kubelet.yaml"

    @property
    def binds(self) -> dict[Path, Path]:
        """Machine-wide path -> this node's directory mounted over it (in the node's namespace)."""
        return {target: self.root / sub for target, sub in NODE_BINDS.items()}


def node_dirs(layout: Layout, index: int) -> NodeDirs:
    return NodeDirs(layout.state_dir / "nodes" / node_name(index))


def cgroup_root(net: Network, index: int) -> str:
    """Node ``index``'s cgroup root (its pods live under it, apart from any other kubelet's)."""
    return f"/drs-{net.slot}-{index}"


def containerd_toml(dirs: NodeDirs, sandbox_image: str) -> str:
    """containerd 1.6 config: CRI with runc on cgroupfs, nothing listening but its own socket."""
    return f"""version = 2
root = "{dirs.containerd_root}"
state = "{dirs.containerd_state}"

[grpc]
  address = "{dirs.containerd_socket}"

[ttrpc]
  address = ""

[debug]
  address = ""

[metrics]
  address = ""

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{sandbox_image}"
  # root here lacks CAP_SYS_RESOURCE: runc cannot lower oom_score_adj below its own.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  # Pod network namespaces under the node's own state directory, not the machine's /run/netns.
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{dirs.cni_conf_dir}"
"""


def cni_conflist(net: Network, dirs: NodeDirs, index: int) -> str:
    """bridge + host-local (this node's slice of the /16) + portmap + loopback; no masquerade."""
    first, last = net.pod_range(index)
    conf = {
        "cniVersion": "0.4.0",
        "name": f"drs{net.net}",
        "plugins": [
            {
                "type": "bridge",
                "bridge": net.bridge,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(dirs.ipam_dir),
                    "ranges": [[{"subnet": net.cidr, "rangeStart": first, "rangeEnd": last, "gateway": net.gateway}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}, "snat": False},
        ],
    }
    return json.dumps(conf, indent=2)


def kubelet_config(layout: Layout, net: Network, dirs: NodeDirs, index: int, resolv_conf: Path) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": net.node_ip(index),
        "port": kubelet_port(layout, index),
        "readOnlyPort": 0,
        # The kubelet runs in the cluster's network namespace: health on its node address.
        "healthzBindAddress": net.node_ip(index),
        "healthzPort": kubelet_healthz_port(layout, index),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(layout.pki_dir / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root(net, index),
        "failCgroupV1": False,
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{dirs.containerd_socket}",
        "clusterDNS": [net.gateway],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(resolv_conf),
        "nodeLeaseDurationSeconds": NODE_LEASE_DURATION_S,
        "nodeStatusUpdateFrequency": NODE_STATUS_UPDATE,
        "nodeStatusReportFrequency": NODE_STATUS_UPDATE,
        # The project's images are imported, never pulled: never garbage-collect them.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        # A shared machine's disk and memory are not this node's to guard: no disk signal at all
        # ("0%" turns one off, as kind does; an unnamed one is off too). With "1%" (2.5 GB of a
        # 252 GB disk), a second dev cluster importing the images onto the same nearly full disk
        # set DiskPressure on this cluster's nodes: they evicted its pods and kept the NoSchedule
        # taint for the 5-minute pressure transition period after the disk was free again.
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "0%",
            "nodefs.inodesFree": "0%",
            "imagefs.available": "0%",
            "imagefs.inodesFree": "0%",
        },
        "serializeImagePulls": False,
        "maxPods": 110,
        "registerNode": True,
    }


def node_labels(index: int) -> dict[str, str]:
    """GPU topology labels of a real node (an HGX-shaped node: the node is its NVLink domain)."""
    return {
        REAL_NODE_LABEL: "true",
        profiles.DEV_NODE_LABEL: "true",
        profiles.GPU_PRODUCT_LABEL: GPU_PRODUCT,
        profiles.GPU_COUNT_LABEL: str(GPUS_PER_REAL_NODE),
    }


def kube_proxy_config(layout: Layout, net: Network) -> dict[str, Any]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(layout.kubeconfig)},
        "mode": "nftables",
        "hostnameOverride": node_name(0),
        "bindAddress": net.gateway,
        # It runs in the cluster's network namespace: health and metrics on the gateway.
        "healthzBindAddress": f"{net.gateway}:{port(layout, 'kube-proxy-healthz')}",
        "metricsBindAddress": f"{net.gateway}:{port(layout, 'kube-proxy-metrics')}",
        "clusterCIDR": net.cidr,
        # NodePorts open on the bridge only, never on the machine's other interfaces.
        "nodePortAddresses": [net.cidr],
        # Pods on one bridge reach Services through the gateway: masquerade so replies return.
        "masqueradeAll": True,
        # Leave the machine's conntrack sysctls alone.
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
        },
    }


def kube_router_argv(layout: Layout, bins: Path) -> list[str]:
    """kube-router with its firewall only (the NetworkPolicy controller): no routing (the bridge
    is the pod network), no service proxy (kube-proxy's). One per cluster, in the cluster's network
    namespace, named after the first node as kube-proxy is; it filters the pods of every real node
    (``nodebuild.KUBE_ROUTER_PATCH``)."""
    return [
        str(bins / "kube-router"),
        "--run-firewall=true",
        "--run-router=false",
        "--run-service-proxy=false",
        f"--kubeconfig={layout.kubeconfig}",
        f"--hostname-override={node_name(0)}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        f"--health-port={port(layout, 'kube-router-health')}",
        "--metrics-port=0",
        "--v=1",
    ]


def corefile(layout: Layout, net: Network) -> str:
    """CoreDNS answers cluster.local (and reverse) names from the apiserver; nothing is forwarded."""
    return f""".:53 {{
    bind {net.gateway}
    errors
    health {net.gateway}:{port(layout, "coredns-health")}
    ready {net.gateway}:{port(layout, "coredns-ready")}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {layout.kubeconfig} drs-dev
        pods insecure
    }}
    cache 5
}}
"""


def resolv_conf(net: Network) -> str:
    return f"nameserver {net.gateway}\n"


def service_cidr() -> str:
    return SERVICE_CIDR
