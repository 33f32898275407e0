"""Paths and small helpers of the chart tests (fixtures are in conftest.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from drs_devcluster import build

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "drs-operator"
#: The project's helm is built without release ldflags and assumes Kubernetes v1.20 when it has no
#: cluster to ask (``helm lint``, ``helm template``): tell it the version the project builds.
KUBE_VERSION = build.KUBERNETES_VERSION
HELM_TIMEOUT_S = 180.0

Manifest = dict[str, Any]


def set_args(values: Mapping[str, Any]) -> list[str]:
    """``--set-json key=<json>`` for every entry (keys may be dotted paths)."""
    args: list[str] = []
    for key, value in values.items():
        args += ["--set-json", f"{key}={json.dumps(value)}"]
    return args


def only(objects: list[Manifest], kind: str, name: str | None = None) -> Manifest:
    """The one object of ``kind`` (and ``name``) among ``objects``."""
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def container(objects: list[Manifest]) -> Manifest:
    """The operator container of the chart's Deployment."""
    (c,) = only(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    container: Manifest = c
    return container
