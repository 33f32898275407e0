"""``drs dev up / down / status``: a real control plane as local processes, with simulated GPU nodes.

``up`` runs as a script of named steps: check the input and the ports, build (or find) the
binaries, write credentials, kubeconfig and kwok stages, then start etcd → kube-apiserver →
kube-controller-manager → kube-scheduler → kwok, each waited on until healthy, then create the
profile's Node objects and wait until kwok reports them Ready. Any failure stops every process
this call started, names the cause and the log to read, and leaves nothing running.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from . import build, hostnet, images, nodebuild, nodeconfig, packages, pki, portrange, processes, profiles, realnodes
from .kwok_stages import POD_READY_AGAIN, adjust
from .layout import (
    AUDIT_POLICY,
    COMPONENTS,
    DEFAULT_PORT_BASE,
    KWOK_CONFIGURATION,
    Layout,
    component_args,
    default_state_dir,
    kubeconfig_yaml,
)

HEALTH_TIMEOUT_S = {
    "etcd": 30.0,
    "kube-apiserver": 120.0,
    "kube-controller-manager": 60.0,
    "kube-scheduler": 60.0,
    "kwok": 30.0,
}
HEALTH_POLL_S = 0.25
HTTP_PROBE_TIMEOUT_S = 2.0
NODES_READY_TIMEOUT_S = 60.0


class DevClusterError(RuntimeError):
    """``drs dev`` could not do what was asked; the message names the cause."""


def _say(msg: str) -> None:
    print(f"[drs dev] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class DevCluster:
    """A dev cluster described by its layout (state directory, binaries, ports)."""

    layout: Layout

    @classmethod
    def at(cls, state_dir: Path | None = None, port_base: int | None = None, bin_dir: Path | None = None) -> DevCluster:
        state = (state_dir or default_state_dir()).resolve()
        saved = _read_meta(state)
        base = port_base if port_base is not None else int(saved.get("portBase", 0)) or None
        bins = bin_dir or (Path(saved["binDir"]) if "binDir" in saved else None)
        host = str(saved.get("apiserverHost", "127.0.0.1"))
        net = saved.get("podNet")
        lay = Layout(state_dir=state, bin_dir=bins or Path("/nonexistent"), port_base=base or DEFAULT_PORT_BASE)
        return cls(dataclasses.replace(lay, apiserver_host=host, pod_net=int(net) if net is not None else None))

    # ------------------------------------------------------------------ up
    def up(
        self,
        profile: str,
        node_count: int | None = None,
        build_if_missing: bool = True,
        real_nodes: int = 0,
        pod_net: int | None = None,
        port_setting: str = "--port-base",
    ) -> None:
        """Start the control plane, ``node_count`` kwok nodes and ``real_nodes`` real nodes.

        With real nodes, ``node_count`` may be 0 (a cluster of real nodes only); ``pod_net``
        picks the real nodes' network (default ``DRS_DEV_NODE_NET``). ``port_setting`` names
        where the port base came from, for the error when its ports are unusable."""
        nodeconfig.check_count(real_nodes)  # bad input: fail before anything starts
        portrange.check_here(port_setting, self.layout.port_base, nodeconfig.CLUSTER_PORT_SPAN)
        nodes = [] if real_nodes and node_count == 0 else profiles.build_nodes(profile, node_count)
        self._refuse_if_running()
        self._check_ports()
        bins = build.ensure_built() if build_if_missing else build.bin_dir()
        if not build.is_built(bins):
            raise DevClusterError(f"control-plane binaries missing in {bins}: run `drs dev build`")
        archive = None
        if real_nodes:
            packages.ensure_packages()  # containerd, runc, the CNI plugins, iproute2, nftables
            archive = images.ensure_images()
            nodebuild.ensure_node_built(bins)
            net = nodeconfig.Network(pod_net) if pod_net is not None else nodeconfig.network()
            self.layout = dataclasses.replace(self.layout, apiserver_host=net.host_ip, pod_net=net.net)
        self.layout = dataclasses.replace(self.layout, bin_dir=bins)
        self.layout.state_dir.mkdir(parents=True, exist_ok=True)
        started: list[processes.Tracked] = []
        t0 = time.monotonic()
        try:
            if real_nodes:
                realnodes.prepare_host(self.layout, real_nodes)
            self._write_files()
            for component in COMPONENTS:
                started.append(self._start(component))
                processes.save(self.layout.pids_file, started)
                self._wait_healthy(component, started[-1])
            if nodes:
                self.create_nodes(nodes)
            if archive is not None:
                t1 = time.monotonic()
                realnodes.start(self.layout, real_nodes, archive)
                _say(f"{real_nodes} real node(s) up in {time.monotonic() - t1:.1f}s")
        except BaseException:
            _say("start-up failed: stopping what was started")
            realnodes.stop(self.layout)
            processes.stop(started)
            self.layout.pids_file.unlink(missing_ok=True)
            raise
        _say(
            f"control plane, {len(nodes)} {profile} kwok nodes and {real_nodes} real nodes ready in {time.monotonic() - t0:.1f}s"
        )

    def _refuse_if_running(self) -> None:
        live = [t.name for t in processes.load(self.layout.pids_file) if processes.is_running(t)]
        if live:
            raise DevClusterError(
                f"a dev cluster is already running from {self.layout.state_dir} ({', '.join(live)}); "
                "`drs dev down` first, or use another --state-dir and --port-base"
            )

    def _check_ports(self) -> None:
        for name, port in self.layout.ports.items():
            processes.check_port_free("127.0.0.1", port, name)

    def _write_files(self) -> None:
        lay = self.layout
        for d in (lay.state_dir, lay.log_dir, lay.etcd_dir):
            d.mkdir(parents=True, exist_ok=True)
        extra = () if lay.apiserver_host == "127.0.0.1" else (lay.apiserver_host,)
        creds = pki.ensure_pki(lay.pki_dir, extra_ips=extra)
        config = kubeconfig_yaml(lay, creds.ca_cert.read_text(), creds.admin_token)
        lay.kubeconfig.write_text(yaml.safe_dump(config, sort_keys=False))
        lay.kubeconfig.chmod(0o600)
        stages = build.stages_dir(lay.bin_dir)
        docs = [adjust(Path(f).name, (stages / Path(f).name).read_text()).strip() for f in build.KWOK_STAGE_FILES]
        kwok_docs = [KWOK_CONFIGURATION.strip(), *docs, POD_READY_AGAIN.strip()]
        lay.kwok_config.write_text("\n---\n".join(kwok_docs) + "\n")
        lay.audit_policy.write_text(AUDIT_POLICY)
        meta = {
            "portBase": lay.port_base,
            "binDir": str(lay.bin_dir),
            "apiserverHost": lay.apiserver_host,
            "podNet": lay.pod_net,
        }
        (lay.state_dir / "meta.json").write_text(json.dumps(meta))

    def _start(self, component: str) -> processes.Tracked:
        _say(f"starting {component} (log: {self.layout.log(component)})")
        return processes.start(component, component_args(self.layout, component), self.layout.log(component))

    def _wait_healthy(self, component: str, proc: processes.Tracked) -> None:
        probe = self._probe(component)
        deadline = time.monotonic() + HEALTH_TIMEOUT_S[component]
        t0 = time.monotonic()
        while True:
            if not processes.is_running(proc):
                raise DevClusterError(
                    f"{component} exited during start-up; last lines of {proc.log}:\n{processes.log_tail(proc.log)}"
                )
            if probe():
                _say(f"{component} healthy after {time.monotonic() - t0:.1f}s")
                return
            if time.monotonic() > deadline:
                raise DevClusterError(
                    f"{component} not healthy after {HEALTH_TIMEOUT_S[component]:.0f}s; last lines of {proc.log}:\n"
                    f"{processes.log_tail(proc.log)}"
                )
            time.sleep(HEALTH_POLL_S)

    def _probe(self, component: str) -> Callable[[], bool]:
        lay = self.layout
        if component == "etcd":
            return lambda: _http_ok(f"http://127.0.0.1:{lay.port('etcd-client')}/health")
        if component == "kube-apiserver":
            return lambda: _http_ok(f"{lay.apiserver_url}/readyz", token=self._token(), ca=lay.pki_dir / "ca.crt")
        if component == "kwok":
            return lambda: _http_ok(f"http://127.0.0.1:{lay.port('kwok')}/healthz")
        port = lay.port(component)
        return lambda: _http_ok(f"https://127.0.0.1:{port}/healthz", insecure=True)

    def _token(self) -> str:
        return pki.Pki(self.layout.pki_dir).admin_token

    def create_nodes(self, nodes: list[dict[str, Any]]) -> None:
        """Create Node objects (with their status) and wait until kwok reports them Ready."""
        api = self.core_api()
        _say(f"creating {len(nodes)} simulated GPU nodes")
        for node in nodes:
            # Created with its status (capacity, addresses) in one request: a separate status
            # patch would race kwok's node-initialize stage, which fills in missing addresses.
            created = api.create_node(node)
            if not (created.status and created.status.addresses):
                api.patch_node_status(node["metadata"]["name"], {"status": node["status"]})
        deadline = time.monotonic() + NODES_READY_TIMEOUT_S
        names = {n["metadata"]["name"] for n in nodes}
        while True:
            ready = {n.metadata.name for n in api.list_node().items if _node_ready(n)}
            if names <= ready:
                return
            if time.monotonic() > deadline:
                missing = sorted(names - ready)
                raise DevClusterError(
                    f"nodes not Ready after {NODES_READY_TIMEOUT_S:.0f}s: {', '.join(missing[:5])}…; "
                    f"see {self.layout.log('kwok')}"
                )
            time.sleep(HEALTH_POLL_S)

    def core_api(self) -> Any:
        """A sync CoreV1Api on this cluster's kubeconfig."""
        from kubernetes import client, config

        return client.CoreV1Api(config.new_client_from_config(config_file=str(self.layout.kubeconfig)))

    # ------------------------------------------------------------------ down / status
    def down(self) -> list[str]:
        """Stop every process this cluster started (by pid) and remove its state directory."""
        # Real nodes first, while the apiserver still answers (their pods are deleted through it).
        real = realnodes.stop(self.layout)
        tracked = processes.load(self.layout.pids_file)
        # What runs on top of the control plane (the pod runner and its pods, a demo's operator)
        # records its processes in ``*-pids.json`` files of the same directory: stopped first.
        extra = [t for f in sorted(self.layout.state_dir.glob("*-pids.json")) for t in processes.load(f)]
        tracked = extra + list(reversed(tracked))
        stopped = real + processes.stop(tracked)
        if self.layout.state_dir.exists():
            if hostnet.mounts_under(self.layout.state_dir):
                raise DevClusterError(
                    f"mounts are left under {self.layout.state_dir}: {hostnet.mounts_under(self.layout.state_dir)}"
                )
            shutil.rmtree(self.layout.state_dir)
        return stopped

    def status(self) -> dict[str, Any]:
        tracked = processes.load(self.layout.pids_file)
        comps = {t.name: {"pid": t.pid, "running": processes.is_running(t), "log": t.log} for t in tracked}
        info: dict[str, Any] = {"stateDir": str(self.layout.state_dir), "components": comps}
        real = processes.load(realnodes.pids_file(self.layout))
        if real:
            # kubelet, containerd, the device plugin and the mount-namespace holder of each node;
            # kube-proxy and CoreDNS of the cluster: pid and kernel state (or "exited").
            info["realNodes"] = {
                t.name: {"pid": t.pid, "running": processes.is_running(t), "state": processes.state(t), "log": t.log}
                for t in real
            }
        if tracked and all(c["running"] for c in comps.values()):
            info["kubeconfig"] = str(self.layout.kubeconfig)
            info["apiserver"] = self.layout.apiserver_url
            try:
                items = self.core_api().list_node().items
                info["nodes"] = {"total": len(items), "ready": sum(_node_ready(n) for n in items)}
            except Exception as exc:  # status reports, never raises
                info["nodes"] = {"error": str(exc)}
        return info


def _read_meta(state: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads((state / "meta.json").read_text())
        return data
    except (OSError, ValueError):
        return {}


def _node_ready(node: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))


def _http_ok(url: str, token: str | None = None, ca: Path | None = None, insecure: bool = False) -> bool:
    ctx: ssl.SSLContext | None = None
    if url.startswith("https"):
        ctx = ssl.create_default_context(cafile=str(ca) if ca else None)
        if insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=HTTP_PROBE_TIMEOUT_S, context=ctx) as resp:
            return 200 <= int(resp.status) < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False
