"""The status as the operator writes it: the stored JSON form, and the merge patch to it (pure)."""

from __future__ import annotations

import datetime
import json
from typing import Any

from drs_operator.api.status import DisaggReplicaSetStatus


def status_dict(status: DisaggReplicaSetStatus) -> dict[str, Any]:
    """The status as the API stores it (camelCase JSON, RFC 3339 times)."""
    data: dict[str, Any] = status.model_dump(mode="json", by_alias=True, exclude_none=True)
    for c in data.get("conditions", []):
        c["lastTransitionTime"] = _rfc3339(c["lastTransitionTime"])
    return data


def status_patch(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON merge patch (RFC 7386) from the stored status ``old`` to ``new`` (both
    :func:`status_dict`, which leaves no null in ``new``; None when equal): ``new`` whole, and null
    for each field ``new`` no longer has, at every depth of objects (a merge patch that leaves a
    field out keeps it: a finished ``tokenRotations``, or ``weights.desired.path`` after a refit
    from a peer). Lists are replaced whole, as merge patches do."""
    if json.dumps(new, sort_keys=True) == json.dumps(old, sort_keys=True):
        return None
    return _with_nulls(new, old)


def _with_nulls(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    patch = dict(new)
    for key, was in old.items():
        if key not in new:
            patch[key] = None
        elif isinstance(was, dict) and isinstance(new[key], dict):
            patch[key] = _with_nulls(new[key], was)
    return patch


def _rfc3339(value: str) -> str:
    dt = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    return dt.astimezone(datetime.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")
