"""The weights each engine holds, as the sidecar records them on the DisaggReplicaSet for the
operator (annotation ``disagg.dev/engine-weights``, ``drs_operator.api.constants``).

The value is JSON ``{engine name: {"version": str, "digest": str | null}}``, every entry as the
engine itself answered ``GET /control/weights`` (:class:`drs_protocol.control.WeightsInfo`). An
older sidecar wrote ``{engine name: version}``; :func:`parse_engine_weights` reads both.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from drs_protocol.control import Digest, Version

#: Longest engine name kept (a pod name).
MAX_ENGINE_NAME_CHARS = 253


class HeldWeights(BaseModel):
    """What one engine holds: the version it serves and the digest of its bytes (None: its backend
    computes none)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Version
    digest: Digest | None = None


_ENTRY: TypeAdapter[HeldWeights | str] = TypeAdapter(HeldWeights | Version)


def dump_engine_weights(held: dict[str, HeldWeights]) -> str:
    """The annotation's value: compact JSON, engines sorted by name."""
    return json.dumps({k: held[k].model_dump(mode="json") for k in sorted(held)}, separators=(",", ":"))


def parse_engine_weights(annotation: str | None) -> dict[str, HeldWeights]:
    """The annotation's entries that parse (an entry that does not is left out: a hand-edited
    annotation never fails the status); empty for a missing or unparsable annotation."""
    if not annotation:
        return {}
    try:
        data = json.loads(annotation)
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    held: dict[str, HeldWeights] = {}
    for name, entry in data.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_ENGINE_NAME_CHARS:
            continue
        try:
            value = _ENTRY.validate_python(entry)
        except ValidationError:
            continue
        held[name] = value if isinstance(value, HeldWeights) else HeldWeights(version=value)
    return held
