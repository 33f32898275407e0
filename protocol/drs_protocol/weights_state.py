"""The fleet's weights as state on the DisaggReplicaSet (annotations, ``drs_operator.api.constants``).

- ``disagg.dev/desired-weights``: :class:`DesiredWeights`, JSON: the weights the fleet must hold
  (version, the checkpoint path to get them from, their digest). The trainer's sidecar writes it as
  soon as a refit starts (and puts the previous one back when the refit loaded nowhere); it outlives
  the sidecar, the trainer pod and the operator. The operator copies it into
  ``status.weights.desired`` and into the fleet's weights ConfigMap, which every engine pod reads
  at its start through :data:`drs_protocol.env.DESIRED_WEIGHTS_JSON` (a ``configMapKeyRef``: a new
  value rolls nothing).
- ``disagg.dev/engine-weights``: JSON ``{engine name: {"version": str, "digest": str | null}}``,
  every entry as the engine itself answered ``GET /control/weights``
  (:class:`drs_protocol.control.WeightsInfo`). An older sidecar wrote ``{engine name: version}``;
  :func:`parse_engine_weights` reads both.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from drs_protocol.control import Digest, Version

#: Longest engine name kept (a pod name).
MAX_ENGINE_NAME_CHARS = 253


class HeldWeights(BaseModel):
    """What one engine holds: the version it serves and the digest of its bytes (None: its backend
    computes none)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Version
    digest: Digest | None = None


class DesiredWeights(BaseModel):
    """The weights the fleet must hold: ``version``; ``path``, a checkpoint every engine can load
    them from (None: they came by broadcast or CUDA IPC); ``digest``, of their bytes (None: not
    known yet); ``effective_at``, the refit's cut-over (epoch seconds, :mod:`drs_protocol.cutover`:
    turns that started from then on are the new weights'; None: desired at once, an older sidecar)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Version
    path: str | None = Field(None, min_length=1)
    digest: Digest | None = None
    effective_at: float | None = Field(None, gt=0, allow_inf_nan=False)

    def dump(self) -> str:
        """As the annotation and the ConfigMap hold it: compact JSON."""
        return self.model_dump_json(exclude_none=True)


def parse_desired_weights(text: str | None) -> DesiredWeights | None:
    """The desired weights in ``text`` (None: empty, or not a valid :class:`DesiredWeights`)."""
    if not text:
        return None
    try:
        return DesiredWeights.model_validate_json(text)
    except ValidationError:
        return None


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
