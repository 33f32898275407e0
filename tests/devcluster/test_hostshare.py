"""The machine-wide share of real-node clusters: the first records the kernel settings and makes
the mount points, the last one out restores and removes exactly those; a holder whose state is gone
no longer counts."""

from __future__ import annotations

from pathlib import Path

import pytest
from drs_devcluster import hostshare


@pytest.fixture
def sysctls(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    values = {name: "0" for name in hostshare.KUBELET_SYSCTLS}
    monkeypatch.setattr(hostshare, "read_sysctl", values.get)
    monkeypatch.setattr(hostshare, "write_sysctl", values.__setitem__)
    return values


def holder(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name / "real-nodes-host.json"
    path.parent.mkdir()
    path.write_text("{}")
    return path


def test_the_last_holder_restores_the_settings_and_removes_the_mount_points(
    tmp_path: Path, sysctls: dict[str, str]
) -> None:
    record = tmp_path / "shared.json"
    points = [tmp_path / "var" / "lib" / "kubelet" / "device-plugins", tmp_path / "run-containerd"]
    (tmp_path / "var").mkdir()  # existed before: never removed
    a, b = holder(tmp_path, "a"), holder(tmp_path, "b")
    hostshare.acquire(a, points, record)
    sysctls["vm.overcommit_memory"] = "1"  # a kubelet started
    hostshare.acquire(b, points, record)
    assert all(p.is_dir() for p in points)
    assert hostshare.release(a, record) == []  # b still runs: nothing restored
    assert sysctls["vm.overcommit_memory"] == "1" and all(p.is_dir() for p in points)
    undone = hostshare.release(b, record)
    assert sysctls["vm.overcommit_memory"] == "0" and "vm.overcommit_memory=0" in undone
    assert not (tmp_path / "var" / "lib").exists() and not points[1].exists()
    assert (tmp_path / "var").is_dir()
    assert not record.exists()


def test_a_holder_whose_state_is_gone_does_not_keep_the_host_changed(tmp_path: Path, sysctls: dict[str, str]) -> None:
    record = tmp_path / "shared.json"
    crashed, live = holder(tmp_path, "crashed"), holder(tmp_path, "live")
    hostshare.acquire(crashed, [], record)
    sysctls["kernel.panic"] = "10"
    hostshare.acquire(live, [], record)
    crashed.unlink()  # its state directory was removed without `drs dev down`
    assert "kernel.panic=0" in hostshare.release(live, record)
    assert not record.exists()


def test_releasing_without_a_record_changes_nothing(tmp_path: Path, sysctls: dict[str, str]) -> None:
    sysctls["kernel.panic"] = "10"
    assert hostshare.release(holder(tmp_path, "a"), tmp_path / "none.json") == []
    assert sysctls["kernel.panic"] == "10"
