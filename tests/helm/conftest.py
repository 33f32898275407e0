"""Fixtures of the Helm chart tests: the project's own helm binary and chart rendering.

The helm binary is the one ``drs dev build`` compiles (``drs_devcluster.build.bin_dir()``); it is
built here when missing, so ``make unit`` works on a fresh machine too (slowly, once). Helm's own
state (cache, config, data) lives in a temporary directory, never in the home directory.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from drs_devcluster import build

from .chart import CHART, HELM_TIMEOUT_S, KUBE_VERSION, Manifest, set_args

Helm = Callable[..., subprocess.CompletedProcess[str]]
Render = Callable[..., list[Manifest]]


@pytest.fixture(scope="session")
def helm_bin() -> Path:
    binary = build.bin_dir() / "helm"
    if not binary.is_file():
        build.ensure_built()
    return binary


@pytest.fixture(scope="session")
def helm(helm_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """``helm(*args, env=None, check=True)``: run the project's helm; ``check`` raises with its output."""
    home = tmp_path_factory.mktemp("helm-home")
    state = {f"HELM_{part}_HOME": str(home / part.lower()) for part in ("CACHE", "CONFIG", "DATA")}

    def run(*args: str, env: Mapping[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(helm_bin), *args],
            capture_output=True,
            text=True,
            env={**(env or os.environ), **state},
            timeout=HELM_TIMEOUT_S,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    return run


@pytest.fixture(scope="session")
def render(helm: Helm) -> Render:
    """``render({"key.path": value, ...}, release=, namespace=, crds=)``: the objects ``helm template``
    prints, parsed."""

    def run(
        values: Mapping[str, Any] | None = None,
        *,
        release: str = "drs",
        namespace: str = "drs-system",
        crds: bool = False,
    ) -> list[Manifest]:
        args = ["template", release, str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION]
        if crds:
            args.append("--include-crds")
        out = helm(*args, *set_args(values or {})).stdout
        return [doc for doc in yaml.safe_load_all(out) if doc]

    return run
