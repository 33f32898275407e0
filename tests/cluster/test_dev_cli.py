"""`drs dev up/down/build` as a person runs them: a second control plane in its own port range."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from drs_devcluster import build, processes
from drs_devcluster.layout import PORT_OFFSETS
from drs_devcluster.testing import CLI_PORT_BASE

pytestmark = pytest.mark.cluster

DRS = str(Path(sys.executable).parent / "drs")
PORT_BASE = CLI_PORT_BASE  # in the session's range: parallel sessions keep apart by DRS_TEST_PORT_BASE
CLI_TIMEOUT_S = 300.0


def drs(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [DRS, *args], capture_output=True, text=True, timeout=CLI_TIMEOUT_S, env=env or dict(os.environ), check=False
    )


def listening_ports() -> list[int]:
    return [
        PORT_BASE + off for off in PORT_OFFSETS.values() if processes.port_is_listening("127.0.0.1", PORT_BASE + off)
    ]


def test_gb200_profile_up_shows_cliques_and_down_leaves_nothing_running(tmp_path: Path) -> None:
    state = tmp_path / "dev"
    flags = ["--state-dir", str(state)]
    up = drs("dev", "up", "--profile", "gb200", "--nodes", "36", *flags, "--port-base", str(PORT_BASE))
    try:
        assert up.returncode == 0, up.stderr
        assert f"export KUBECONFIG={state.resolve() / 'kubeconfig'}" in up.stdout
        kubectl = build.bin_dir() / "kubectl"
        env = {**os.environ, "KUBECONFIG": str(state / "kubeconfig")}
        table = subprocess.run(
            [str(kubectl), "get", "nodes", "-L", "nvidia.com/gpu.clique", "--no-headers"],
            capture_output=True,
            text=True,
            env=env,
            check=True,
            timeout=60,
        ).stdout.splitlines()
        cliques = [row.split()[-1] for row in table]
        assert len(table) == 36 and cliques.count("nvl72-0") == 18 and cliques.count("nvl72-1") == 18
        gpus = subprocess.run(
            [str(kubectl), "get", "nodes", "-o", "jsonpath={.items[*].status.allocatable.nvidia\\.com/gpu}"],
            capture_output=True,
            text=True,
            env=env,
            check=True,
            timeout=60,
        ).stdout.split()
        assert set(gpus) == {"4"}
        status = drs("dev", "status", *flags, "-o", "json")
        assert status.returncode == 0
        info = json.loads(status.stdout)
        assert all(c["running"] for c in info["components"].values()) and info["nodes"] == {"total": 36, "ready": 36}
        tracked = processes.load(state / "pids.json")
        assert {t.name for t in tracked} == {
            "etcd",
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
            "kwok",
        }
    finally:
        down = drs("dev", "down", *flags)
    assert down.returncode == 0
    assert not any(processes.is_running(t) for t in tracked)
    assert listening_ports() == []
    assert not state.exists()


def test_up_refuses_a_taken_port_naming_it_and_starts_nothing(tmp_path: Path) -> None:
    taken = PORT_BASE + PORT_OFFSETS["kube-apiserver"]
    with socket.socket() as blocker:
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the port may be in TIME_WAIT
        blocker.bind(("127.0.0.1", taken))
        blocker.listen()
        up = drs("dev", "up", "--state-dir", str(tmp_path / "dev"), "--port-base", str(PORT_BASE))
        assert up.returncode != 0
        assert f"127.0.0.1:{taken}" in up.stderr and "already in use" in up.stderr
        assert [p for p in listening_ports() if p != taken] == []
    assert not (tmp_path / "dev" / "pids.json").exists()


def test_unknown_profile_is_one_clear_message(tmp_path: Path) -> None:
    up = drs("dev", "up", "--profile", "dgx", "--state-dir", str(tmp_path / "dev"), "--port-base", str(PORT_BASE))
    assert up.returncode != 0
    assert "unknown profile 'dgx': choose one of hgx, gb200, mixed" in up.stderr
    assert listening_ports() == []


def test_missing_go_toolchain_is_named(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(Path(sys.executable).parent), "DRS_CACHE_DIR": str(tmp_path / "cache")}
    out = drs("dev", "build", env=env)
    assert out.returncode != 0
    assert "no Go toolchain: `go` is not on PATH" in out.stderr


@pytest.mark.skipif(shutil.which("go") is None, reason="needs the Go toolchain to fail a real build")
def test_a_failing_build_says_which_step_failed(tmp_path: Path) -> None:
    # An empty module cache and no proxy: the first download fails, as it would offline.
    env = {
        **os.environ,
        "DRS_CACHE_DIR": str(tmp_path / "cache"),
        "GOMODCACHE": str(tmp_path / "mod"),
        "GOPROXY": "off",
    }
    out = drs("dev", "build", env=env)
    assert out.returncode != 0
    assert "Error: resolve etcd: `go mod tidy` failed" in out.stderr
    assert "module lookup disabled by GOPROXY=off" in out.stderr
    assert not list((tmp_path / "cache").rglob("bin/etcd"))
