"""Fixtures the cluster tests share: the CRD installed once per module, and an operator process
against the dev cluster (a module that needs another kind defines its own, which takes precedence)."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from drs_devcluster.testing import RunningCluster
from operator_harness import OperatorProcess


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
