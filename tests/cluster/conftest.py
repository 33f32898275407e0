"""Fixtures the cluster tests share: the CRD installed once per module, an operator process
against the dev cluster, and ``stack`` (the CRD, the pod runner and an operator: pods run) (a module that needs another kind defines its own, which takes precedence)."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from drs_devcluster.testing import RunningCluster
from operator_harness import OperatorProcess, running_operator


@pytest.fixture(scope="module")
def crd(devcluster: RunningCluster) -> None:
    devcluster.install_crd()


@pytest.fixture(scope="module")
def operator(
    devcluster: RunningCluster, crd: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    op = OperatorProcess(devcluster, tmp_path_factory.mktemp("operator") / "operator.log").start()
    yield op
    op.kill(signal.SIGTERM)


@pytest.fixture(scope="module")
def stack(
    devcluster: RunningCluster, pod_runner: None, crd: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """The CRD, the pod runner and an operator, for tests whose fleets must serve."""
    with running_operator(devcluster, tmp_path_factory.mktemp("stack") / "operator.log") as op:
        yield op
