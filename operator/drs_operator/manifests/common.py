"""Shared pieces of the child manifests: ownership, the spec hash, node pinning, overlays.

The spec hash (``disagg.dev/spec-hash``) is a SHA-256 of the canonical JSON of a child's desired
manifest (without the annotation itself). The reconcile compares hashes, never whole objects, so
fields the apiserver defaults never look like drift and a converged fleet needs zero writes.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any, Final

from drs_operator.api.constants import API_VERSION, KIND
from drs_operator.api.objects import Manifest

SPEC_HASH_ANNOTATION: Final = "disagg.dev/spec-hash"
#: Node a child was placed on (for a person reading ``kubectl get -o yaml``).
NODE_ANNOTATION: Final = "disagg.dev/node"
#: Hash of the rendered config a pod reads: a config change rolls the pods.
CONFIG_HASH_ANNOTATION: Final = "disagg.dev/config-hash"
#: Key of the rendered config in the engine and frontend ConfigMaps (read through the pods' env).
CONFIG_KEY: Final = "config.json"


@dataclasses.dataclass(frozen=True)
class Owner:
    """The DisaggReplicaSet that owns the children."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }

    def metadata(
        self, name: str, labels: Mapping[str, str], annotations: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "name": name,
            "namespace": self.namespace,
            "labels": dict(labels),
            "ownerReferences": [self.reference()],
        }
        if annotations:
            meta["annotations"] = dict(annotations)
        return meta


def spec_hash(manifest: Mapping[str, Any]) -> str:
    """SHA-256 (hex, 16 chars) of the canonical JSON of ``manifest`` without the hash annotation."""
    body = dict(manifest)
    meta = body.get("metadata")
    if isinstance(meta, Mapping) and SPEC_HASH_ANNOTATION in (meta.get("annotations") or {}):
        annotations = {k: v for k, v in meta["annotations"].items() if k != SPEC_HASH_ANNOTATION}
        body["metadata"] = {**meta, "annotations": annotations}  # a shallow copy: dumps reads only
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def with_hash(manifest: Manifest) -> Manifest:
    """``manifest`` with its spec hash annotation set (in place; returned for chaining)."""
    h = spec_hash(manifest)
    manifest["metadata"].setdefault("annotations", {})[SPEC_HASH_ANNOTATION] = h
    return manifest


def node_affinity(node: str) -> dict[str, Any]:
    """Required node affinity to exactly ``node`` (by name, not by a label a person may change)."""
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]
            }
        }
    }


#: The uid/gid both images run as (``USER 10001:10001`` in Dockerfile and engine_image/Dockerfile).
IMAGE_UID: Final = 10001
SCRATCH_VOLUME: Final = "scratch"
SCRATCH_PATH: Final = "/tmp"


def restricted_pod_security() -> dict[str, Any]:
    """Pod securityContext of engines and frontends: non-root, the images' user, RuntimeDefault seccomp."""
    return {
        "runAsNonRoot": True,
        "runAsUser": IMAGE_UID,
        "runAsGroup": IMAGE_UID,
        "fsGroup": IMAGE_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def restricted_container_security() -> dict[str, Any]:
    """Container securityContext: read-only root filesystem, no privilege escalation, no capabilities."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def scratch() -> tuple[dict[str, Any], dict[str, Any]]:
    """What a read-only container may write: an emptyDir at /tmp (its volume and its mount)."""
    return {"name": SCRATCH_VOLUME, "emptyDir": {}}, {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_PATH}


def field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def overlay_pod_template(base: dict[str, Any], *overlays: Mapping[str, Any] | None) -> dict[str, Any]:
    """Merge user pod-template overlays (``{metadata, spec}``) into ``base``, then re-assert ``base``.

    Lists of named things (containers, env, volumes, volumeMounts) merge by name; other values
    deep-merge. What the operator must decide (node affinity, GPU count, ports, probes, labels,
    owner references, command) is taken from ``base`` again afterwards, so an overlay cannot
    break placement or the protocol.
    """
    if not any(overlays):
        return base  # nothing to merge: ``base`` is what re-asserting it onto a copy would give
    merged = copy.deepcopy(base)
    for overlay in overlays:
        if overlay:
            merged = _merge(merged, dict(overlay))
    # Re-assert the operator-owned fields.
    merged["metadata"]["name"] = base["metadata"]["name"]
    merged["metadata"]["namespace"] = base["metadata"]["namespace"]
    merged["metadata"]["labels"] = {**merged["metadata"].get("labels", {}), **base["metadata"]["labels"]}
    merged["metadata"]["ownerReferences"] = base["metadata"].get("ownerReferences", [])
    spec, bspec = merged["spec"], base["spec"]
    for key in ("affinity", "hostNetwork", "hostname", "subdomain", "restartPolicy"):
        if key in bspec:
            spec[key] = copy.deepcopy(bspec[key])
    own = bspec["containers"][0]
    for c in spec["containers"]:
        if c["name"] == own["name"]:
            for key in ("image", "command", "args", "ports", "readinessProbe"):
                if key in own:
                    c[key] = copy.deepcopy(own[key])
            limits = c.setdefault("resources", {}).setdefault("limits", {})
            limits.update(own.get("resources", {}).get("limits", {}))
            requests = c["resources"].setdefault("requests", {})
            requests.update(own.get("resources", {}).get("requests", {}))
    return merged


_NAMED_LISTS: Final = ("containers", "initContainers", "env", "volumes", "volumeMounts", "ports", "imagePullSecrets")


def _merge(base: Any, overlay: Any, key: str | None = None) -> Any:
    if isinstance(base, dict) and isinstance(overlay, dict):
        out = dict(base)
        for k, v in overlay.items():
            out[k] = _merge(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(overlay, list) and key in _NAMED_LISTS:
        by_name = {item.get("name"): i for i, item in enumerate(base) if isinstance(item, dict)}
        out_list = list(base)
        for item in overlay:
            name = item.get("name") if isinstance(item, dict) else None
            if name is not None and name in by_name:
                out_list[by_name[name]] = _merge(base[by_name[name]], item)
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    if isinstance(base, list) and isinstance(overlay, list):
        return [*base, *(copy.deepcopy(i) for i in overlay if i not in base)]
    return copy.deepcopy(overlay)
