"""Where a dev cluster keeps its files and which ports it uses, and the command line of each
component. Pure: nothing here starts a process or touches the disk.

Ports are ``port_base + offset`` on 127.0.0.1, so a second cluster (the test suite's, next to a
person's ``drs dev up``) only needs another base and another state directory.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Final

DEFAULT_PORT_BASE: Final = 17300
SERVICE_CIDR: Final = "10.96.0.0/16"
CLUSTER_CIDR: Final = "10.244.0.0/16"
COMPONENTS: Final = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
#: Offsets from the port base, one per listening socket.
PORT_OFFSETS: Final = {
    "etcd-client": 0,
    "etcd-peer": 1,
    "kube-apiserver": 2,
    "kube-controller-manager": 3,
    "kube-scheduler": 4,
    "kwok": 5,
    "etcd-metrics": 6,
}
#: The node lifecycle controller looks every second (default 5 s): a node marked NotReady (kwok's
#: node-not-ready stage, a kubelet posting NotReady) is acted on at once.
NODE_MONITOR_PERIOD: Final = "1s"
#: How long a node may go without renewing its Lease before it is Unknown, and the Lease's
#: duration (kwok renews it every quarter of that): Kubernetes' kubelet default lease, 40 s, and
#: a grace period of the same. With 10 s of each, kwok fell behind on a loaded 2-core machine at
#: 125 nodes (50 lease writes a second) and nodes flapped NotReady; at 40 s it writes a quarter as
#: often and rides out a 30 s stall. Node-loss tests mark nodes NotReady or delete them, which
#: does not wait on either.
NODE_MONITOR_GRACE_PERIOD: Final = "40s"
NODE_LEASE_DURATION_S: Final = 40
#: Deployment and ReplicaSet syncs the controller-manager runs at once.
CONTROLLER_SYNCS: Final = 50
#: Client rate limits of the controller-manager and the scheduler.
CLIENT_QPS: Final = 200
CLIENT_BURST: Final = 400


#: The apiserver's audit policy: who deleted or evicted a pod, and nothing else (Metadata level:
#: user, user agent, object, answer). ``logs/audit.log`` answers "who deleted this pod?".
AUDIT_POLICY: Final = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: Metadata
  verbs: ["delete", "deletecollection"]
  resources: [{group: "", resources: ["pods"]}]
- level: Metadata
  verbs: ["create"]
  resources: [{group: "", resources: ["pods/eviction"]}]
- level: None
"""


#: kwok's own options, the first document of its config file: pod stages played 16 at a time
#: (kwok's default is 4: at 1,000 pods its pod-ready stage, one status PATCH per pod, was the
#: last step before Ready, 25 s behind the last bind; at 32, on the loaded machine, its own lease
#: renewals fell 40 s behind and three nodes blipped NotReady). kwok applies no defaults to a
#: configuration read from a file, so every option that has one is spelled with kwok v0.8.0's
#: default (the command line sets the rest).
KWOK_POD_STAGE_PARALLELISM: Final = 16
KWOK_CONFIGURATION: Final = f"""apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokConfiguration
options:
  podPlayStageParallelism: {KWOK_POD_STAGE_PARALLELISM}
  nodePlayStageParallelism: 4
  nodeLeaseParallelism: 4
  podsOnNodeSyncParallelism: 1
  enablePodsOnNodeSyncListPager: true
  enablePodsOnNodeSyncStreamWatch: false
  enableDebuggingHandlers: true
  enableContentionProfiling: false
  enableProfilingHandler: true
"""


def default_state_dir() -> Path:
    return Path(os.environ.get("DRS_DEV_STATE_DIR", Path.home() / ".cache" / "drs" / "dev")).expanduser()


@dataclasses.dataclass(frozen=True)
class Layout:
    """Files and ports of one dev cluster."""

    state_dir: Path
    bin_dir: Path
    port_base: int = DEFAULT_PORT_BASE
    #: Where the apiserver listens: 127.0.0.1, or with real nodes the host end of the veth into
    #: the cluster's network namespace (pods reach it there through the ``kubernetes`` Service;
    #: no other interface ever).
    apiserver_host: str = "127.0.0.1"
    #: With real nodes: the cluster's pod network (``nodeconfig.Network``), fixed at ``up``.
    pod_net: int | None = None

    def port(self, name: str) -> int:
        return self.port_base + PORT_OFFSETS[name]

    @property
    def ports(self) -> dict[str, int]:
        return {name: self.port(name) for name in PORT_OFFSETS}

    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "pki"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def etcd_dir(self) -> Path:
        return self.state_dir / "etcd"

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def pids_file(self) -> Path:
        return self.state_dir / "pids.json"

    @property
    def kwok_config(self) -> Path:
        return self.state_dir / "kwok.yaml"

    @property
    def audit_policy(self) -> Path:
        return self.state_dir / "audit-policy.yaml"

    @property
    def audit_log(self) -> Path:
        return self.log_dir / "audit.log"

    @property
    def apiserver_url(self) -> str:
        return f"https://{self.apiserver_host}:{self.port('kube-apiserver')}"

    def binary(self, name: str) -> Path:
        return self.bin_dir / name

    def log(self, component: str) -> Path:
        return self.log_dir / f"{component}.log"


def etcd_args(layout: Layout) -> list[str]:
    client = f"http://127.0.0.1:{layout.port('etcd-client')}"
    peer = f"http://127.0.0.1:{layout.port('etcd-peer')}"
    return [
        str(layout.binary("etcd")),
        "--name=drs-dev",
        f"--data-dir={layout.etcd_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=drs-dev={peer}",
        f"--listen-metrics-urls=http://127.0.0.1:{layout.port('etcd-metrics')}",
        "--unsafe-no-fsync",
        "--log-level=warn",
    ]


def apiserver_args(layout: Layout) -> list[str]:
    pki = layout.pki_dir
    host = layout.apiserver_host
    return [
        str(layout.binary("kube-apiserver")),
        f"--etcd-servers=http://127.0.0.1:{layout.port('etcd-client')}",
        f"--bind-address={host}",
        f"--advertise-address={host}",
        f"--secure-port={layout.port('kube-apiserver')}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        f"--token-auth-file={pki / 'tokens.csv'}",
        f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
        f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--authorization-mode=RBAC",
        "--allow-privileged=true",
        # With real nodes the `kubernetes` Service must have endpoints (in-cluster clients use it).
        f"--endpoint-reconciler-type={'none' if host == '127.0.0.1' else 'lease'}",
        # Logs and exec reach a real kubelet at its node's address, not a DNS name.
        "--kubelet-preferred-address-types=InternalIP,Hostname",
        # Simulated nodes: pods may be created before the controller-manager has made the
        # `default` ServiceAccount. Real nodes run in-cluster clients: tokens are mounted.
        *(["--disable-admission-plugins=ServiceAccount"] if host == "127.0.0.1" else []),
        f"--audit-policy-file={layout.audit_policy}",
        f"--audit-log-path={layout.audit_log}",
        "--profiling=false",
        "--v=1",
    ]


def controller_manager_args(layout: Layout) -> list[str]:
    pki = layout.pki_dir
    return [
        str(layout.binary("kube-controller-manager")),
        f"--kubeconfig={layout.kubeconfig}",
        f"--authentication-kubeconfig={layout.kubeconfig}",
        f"--authorization-kubeconfig={layout.kubeconfig}",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        f"--secure-port={layout.port('kube-controller-manager')}",
        f"--service-account-private-key-file={pki / 'sa.key'}",
        f"--root-ca-file={pki / 'ca.crt'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        f"--cluster-cidr={CLUSTER_CIDR}",
        "--allocate-node-cidrs=false",
        f"--node-monitor-period={NODE_MONITOR_PERIOD}",
        f"--node-monitor-grace-period={NODE_MONITOR_GRACE_PERIOD}",
        "--concurrent-gc-syncs=5",
        # Deployments and ReplicaSets synced concurrently (default 5 each): at 256 frontend
        # Deployments the controllers' syncs wait on apiserver round trips, not CPU, and five
        # at a time put the last frontend pod half a minute behind the operator's last write.
        f"--concurrent-deployment-syncs={CONTROLLER_SYNCS}",
        f"--concurrent-replicaset-syncs={CONTROLLER_SYNCS}",
        # A real cluster's defaults (20 QPS) make 256 frontend Deployments trickle out over half
        # a minute; the dev cluster answers the operator as fast as a tuned control plane would.
        f"--kube-api-qps={CLIENT_QPS}",
        f"--kube-api-burst={CLIENT_BURST}",
        "--v=1",
    ]


def scheduler_args(layout: Layout) -> list[str]:
    return [
        str(layout.binary("kube-scheduler")),
        f"--kubeconfig={layout.kubeconfig}",
        f"--authentication-kubeconfig={layout.kubeconfig}",
        f"--authorization-kubeconfig={layout.kubeconfig}",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        f"--secure-port={layout.port('kube-scheduler')}",
        f"--kube-api-qps={CLIENT_QPS}",
        f"--kube-api-burst={CLIENT_BURST}",
        "--v=1",
    ]


def kwok_args(layout: Layout) -> list[str]:
    return [
        str(layout.binary("kwok")),
        f"--kubeconfig={layout.kubeconfig}",
        f"--config={layout.kwok_config}",
        "--manage-all-nodes=false",
        "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
        f"--node-lease-duration-seconds={NODE_LEASE_DURATION_S}",
        f"--server-address=127.0.0.1:{layout.port('kwok')}",
        f"--cidr={CLUSTER_CIDR}",
    ]


def component_args(layout: Layout, component: str) -> list[str]:
    builders = {
        "etcd": etcd_args,
        "kube-apiserver": apiserver_args,
        "kube-controller-manager": controller_manager_args,
        "kube-scheduler": scheduler_args,
        "kwok": kwok_args,
    }
    return builders[component](layout)


def kubeconfig_yaml(layout: Layout, ca_pem: str, token: str) -> dict[str, object]:
    """The admin kubeconfig (token auth, TLS verified against the dev CA)."""
    import base64

    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "drs-dev",
                "cluster": {
                    "server": layout.apiserver_url,
                    "certificate-authority-data": base64.b64encode(ca_pem.encode()).decode(),
                },
            }
        ],
        "users": [{"name": "drs-dev-admin", "user": {"token": token}}],
        "contexts": [{"name": "drs-dev", "context": {"cluster": "drs-dev", "user": "drs-dev-admin"}}],
        "current-context": "drs-dev",
    }
