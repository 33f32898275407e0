"""The pod runner projects ``configMap`` volumes as it does ``secret`` ones (the engines' weights
ConfigMap at ``/etc/drs/weights``): the keys as files, rewritten when the object changes, an
optional one that is missing leaves the process to start; an env value under the mount path is
rewritten to the local directory."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from drs_devcluster.runner_volumes import current_files, localize, project, secret_mounts

POD: dict[str, Any] = {
    "spec": {
        "volumes": [
            {"name": "weights", "configMap": {"name": "f-weights", "optional": True}},
            {"name": "control-token", "secret": {"secretName": "f-control"}},
        ],
        "containers": [
            {
                "volumeMounts": [
                    {"name": "weights", "mountPath": "/etc/drs/weights", "readOnly": True},
                    {"name": "control-token", "mountPath": "/etc/drs/tokens/control"},
                ]
            }
        ],
    }
}


async def test_a_configmap_volume_is_projected_and_follows_its_object(tmp_path: Path) -> None:
    objects: dict[tuple[str, str], Mapping[str, Any]] = {
        ("configmap", "f-weights"): {"data": {"desired": "{}", "peers": "[]"}},
        ("secret", "f-control"): {"data": {"token": "dG9r"}},
    }

    async def read(kind: str, name: str) -> Mapping[str, Any] | None:
        return objects.get((kind, name))

    mounts = secret_mounts(POD, tmp_path)
    weights = next(m for m in mounts if m.volume == "weights")
    assert (weights.kind, weights.secret, weights.optional) == ("configmap", "f-weights", True)
    assert await project(mounts, read, starting=True) == []
    assert current_files(weights.local) == {"desired": b"{}", "peers": b"[]"}
    assert localize("/etc/drs/weights", mounts) == str(weights.local)
    objects[("configmap", "f-weights")] = {"data": {"desired": "{}", "peers": '["http://10.0.0.2:8000"]'}}
    assert await project(mounts, read, starting=False) == ["weights"]
    assert (weights.local / "peers").read_text() == '["http://10.0.0.2:8000"]'


async def test_a_missing_optional_configmap_does_not_keep_the_process_from_starting(tmp_path: Path) -> None:
    async def read(kind: str, name: str) -> Mapping[str, Any] | None:
        return {"data": {"token": "dG9r"}} if kind == "secret" else None

    assert await project(secret_mounts(POD, tmp_path), read, starting=True) == []
