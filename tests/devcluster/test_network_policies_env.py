"""``DRS_DEV_NETWORK_POLICIES``: real nodes with or without kube-router (``make demo`` runs without)."""

from __future__ import annotations

from pathlib import Path

import pytest
from drs_devcluster import nodebuild, profiles


def test_enforced_by_default_and_refused_when_not_0_or_1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(profiles.NETWORK_POLICIES_ENV, raising=False)
    assert profiles.network_policies() is True
    monkeypatch.setenv(profiles.NETWORK_POLICIES_ENV, "0")
    assert profiles.network_policies() is False
    monkeypatch.setenv(profiles.NETWORK_POLICIES_ENV, "yes")
    with pytest.raises(profiles.ProfileError, match="DRS_DEV_NETWORK_POLICIES must be 0 or 1"):
        profiles.network_policies()


def test_without_enforcement_kube_router_is_not_needed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in nodebuild.NODE_BINARIES:
        if name != nodebuild.KUBE_ROUTER:
            (tmp_path / name).write_text("built")
    monkeypatch.setenv(profiles.NETWORK_POLICIES_ENV, "1")
    assert nodebuild.KUBE_ROUTER in nodebuild.node_binaries()
    assert not nodebuild.is_built(tmp_path)  # enforcement needs kube-router
    monkeypatch.setenv(profiles.NETWORK_POLICIES_ENV, "0")
    assert nodebuild.KUBE_ROUTER not in nodebuild.node_binaries()
    assert nodebuild.is_built(tmp_path)
