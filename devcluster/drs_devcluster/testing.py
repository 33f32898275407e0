"""pytest support: one real control plane per test session, a fresh namespace per test, the CRD,
the pod runner for a module's tests, and waiting on a condition with a bounded timeout.

The session cluster lives in its own state directory and port range (``DRS_TEST_PORT_BASE``,
default 27300; the session takes :data:`TEST_PORT_SPAN` ports from there, all below the kernel's
ephemeral range, see ``portrange``), so it never collides with a person's ``drs dev up``. It is torn down at the end of
the session whether tests passed or not; leftovers of a killed earlier run are stopped first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from drs_operator.api.constants import CRD_NAME

from . import build, nodeconfig, portrange, profiles, runner_daemon
from .cluster import DevCluster

TEST_PORT_ENV = "DRS_TEST_PORT_BASE"
TEST_PORT_BASE = int(os.environ.get(TEST_PORT_ENV, "27300"))
TEST_STATE_DIR = Path(os.environ.get("DRS_TEST_STATE_DIR", Path.home() / ".cache" / "drs" / "test-cluster"))
#: The session cluster: HGX nodes first, then two NVL72 cliques of GB200 nodes.
TEST_HGX_NODES = 8
TEST_GB200_NODES = 2 * profiles.GB200_NODES_PER_CLIQUE
KUBECTL_TIMEOUT_S = 120.0
#: How long :func:`wait_for` waits unless told, and how often it looks.
WAIT_S = 90.0
POLL_S = 0.3
#: The committed CRD (``make crd`` writes it).
CRD_DIR = Path(__file__).resolve().parents[2] / "crds"


@dataclasses.dataclass
class RunningCluster:
    """What a test gets from the ``devcluster`` fixture."""

    cluster: DevCluster

    @property
    def kubeconfig(self) -> Path:
        return self.cluster.layout.kubeconfig

    @property
    def bin_dir(self) -> Path:
        return self.cluster.layout.bin_dir

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PATH": f"{self.bin_dir}:{os.environ['PATH']}"}

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = KUBECTL_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        """Run the cluster's kubectl; with ``check`` a non-zero exit raises with its stderr."""
        proc = subprocess.run(
            [str(self.bin_dir / "kubectl"), *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def install_crd(self) -> None:
        """Apply the committed CRD and return once it is Established (served)."""
        self.kubectl("apply", "-f", str(CRD_DIR))
        # `kubectl wait` fails at once ("status.conditions accessor error") while the apiserver has
        # written no condition yet, so it is asked again until it answers Established.
        wait_for(
            f"crd/{CRD_NAME} to be Established",
            lambda: (
                self.kubectl(
                    "wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=10s", check=False
                ).returncode
                == 0
            ),
            60,
        )

    def api_client(self) -> Any:
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))


def check_test_ports(base: int = TEST_PORT_BASE) -> None:
    """Refuse a ``DRS_TEST_PORT_BASE`` whose session ports leave 1024-65535 or meet the machine's
    ephemeral port range (``portrange``), before any cluster starts."""
    portrange.check_here(TEST_PORT_ENV, base, TEST_PORT_SPAN)


def start_session_cluster() -> RunningCluster:
    check_test_ports()
    cluster = DevCluster.at(TEST_STATE_DIR, TEST_PORT_BASE, bin_dir=build.bin_dir())
    cluster.down()  # a killed earlier run may have left processes behind
    cluster = DevCluster.at(TEST_STATE_DIR, TEST_PORT_BASE, bin_dir=build.bin_dir())
    cluster.up("hgx", TEST_HGX_NODES)
    cluster.create_nodes(profiles.build_nodes("gb200", TEST_GB200_NODES, first_index=TEST_HGX_NODES))
    return RunningCluster(cluster)


def session_cluster() -> Iterator[RunningCluster]:
    running = start_session_cluster()
    try:
        yield running
    finally:
        running.cluster.down()


#: The real-node cluster: its own ports and state, beside the session's kwok cluster.
REAL_PORT_BASE = TEST_PORT_BASE + 40
#: ``bench/chaos_realnodes.py``'s cluster, and the second cluster of ``tests/realnodes/test_two_nodes.py``.
BENCH_REAL_PORT_BASE = TEST_PORT_BASE + 60
SECOND_REAL_PORT_BASE = TEST_PORT_BASE + 80
#: ``tests/cluster/test_dev_cli.py``'s cluster (``drs dev up --port-base``), after the second real one.
CLI_PORT_BASE = SECOND_REAL_PORT_BASE + nodeconfig.CLUSTER_PORT_SPAN
#: The session's ports: ``DRS_TEST_PORT_BASE`` to the end of the last cluster above.
TEST_PORT_SPAN = CLI_PORT_BASE - TEST_PORT_BASE + nodeconfig.CLUSTER_PORT_SPAN
REAL_STATE_DIR = TEST_STATE_DIR.with_name(TEST_STATE_DIR.name + "-real")
REAL_NODES = 2


def real_node_cluster(
    state_dir: Path = REAL_STATE_DIR, port_base: int = REAL_PORT_BASE, nodes: int = REAL_NODES, net_offset: int = 0
) -> Iterator[RunningCluster]:
    """A control plane with ``nodes`` real nodes and no simulated ones (builds the image if needed),
    on the test session's pod network (``nodeconfig.test_network``) plus ``net_offset``."""
    check_test_ports()
    net = (nodeconfig.test_network(profiles.node_net()) + net_offset) % nodeconfig.NETWORKS
    cluster = DevCluster.at(state_dir, port_base, bin_dir=build.bin_dir())
    cluster.down()
    cluster = DevCluster.at(state_dir, port_base, bin_dir=build.bin_dir())
    cluster.up("hgx", 0, real_nodes=nodes, pod_net=net)
    try:
        yield RunningCluster(cluster)
    finally:
        cluster.down()


def namespace_for(test_name: str) -> str:
    """A DNS-1123 namespace name unique to one test run."""
    stem = re.sub(r"[^a-z0-9-]+", "-", test_name.lower()).strip("-")[:40].strip("-")
    return f"t-{stem}-{uuid.uuid4().hex[:6]}"


def wait_for(what: str, check: Callable[[], Any], timeout: float = WAIT_S, poll_s: float = POLL_S) -> Any:
    """``check()``'s first truthy value, asked every ``poll_s``; after ``timeout`` an
    AssertionError naming ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {str(last)[:2000]}")


@contextlib.contextmanager
def pod_runner(cluster: DevCluster) -> Iterator[None]:
    """The pod runner of ``cluster`` while the block runs: started unless one runs already, and then
    stopped afterwards only when started here."""
    started = runner_daemon.running_runner(cluster) is None
    if started:
        runner_daemon.start_runner(cluster)
    try:
        yield
    finally:
        if started:
            runner_daemon.stop_runner(cluster)
