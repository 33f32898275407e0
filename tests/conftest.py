"""Fixtures shared by every test.

* ``devcluster`` (session): the real control plane (etcd, kube-apiserver, kube-scheduler,
  kube-controller-manager, kwok) started once, torn down at the end even when tests fail.
* ``namespace``: a fresh namespace per test, deleted afterwards.
Tests that use them carry ``@pytest.mark.cluster`` (``make unit`` deselects them).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from drs_devcluster.testing import RunningCluster, namespace_for, session_cluster


@pytest.fixture(scope="session")
def devcluster() -> Iterator[RunningCluster]:
    yield from session_cluster()


@pytest.fixture
def namespace(devcluster: RunningCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    name = namespace_for(request.node.name)
    devcluster.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        devcluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
