"""``WeightsPending``: which engines do not hold the fleet's desired weights (pure).

Computed from ``status.weights.desired`` (the ``disagg.dev/desired-weights`` annotation) and what
each engine answered the operator it holds (``GET /control/weights``,
:mod:`drs_operator.engine_observation`; shown per engine as ``weightsVersion`` /
``weightsDigest``). An engine holds the desired weights when both digests are known and equal,
else (a side without a digest) when the versions are equal; an engine that did not answer is pending. Engines of unplaced
replicas do not exist and are left out (``Placed`` says why). Separate from ``Ready``, which stays
about serving capacity: engines at other weights still serve.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from drs_operator.api.status import DesiredWeightsStatus, EngineStatus, ReplicaStatus

#: engines a message names before it only counts the rest
NAMED_ENGINES = 5


def holds_desired(engine: EngineStatus, desired: DesiredWeightsStatus) -> bool:
    """True when ``engine`` reported the desired weights: by digest when both sides have one,
    else by version; False when it reported none."""
    if engine.weights_version is None:
        return False
    if engine.weights_digest is not None and desired.digest is not None:
        return engine.weights_digest == desired.digest
    return engine.weights_version == desired.version


def pending_engines(replicas: Sequence[ReplicaStatus], desired: DesiredWeightsStatus) -> list[EngineStatus]:
    """The engines of placed replicas that do not hold ``desired``, in status order."""
    return [e for r in replicas if r.placed for e in r.engines if not holds_desired(e, desired)]


def _weights(version: str | None, digest: str | None) -> str:
    if version is None:
        return "unknown weights"
    return f"{version} ({digest[:16]}…)" if digest else version


def pending_message(
    pending: Sequence[EngineStatus],
    total: int,
    desired: DesiredWeightsStatus,
    catch_up: Mapping[str, str] | None = None,
) -> str:
    """``k/n engine(s) do not hold desired weights V (digest…): e holds W; …`` with at most
    :data:`NAMED_ENGINES` engines named and the rest counted; an engine that said why it is not
    there yet (``catch_up``: it is up, not ready, catching up) with its reason in brackets."""
    reasons = catch_up or {}

    def one(e: EngineStatus) -> str:
        why = f" ({reasons[e.name]})" if e.name in reasons else ""
        return f"{e.name} holds {_weights(e.weights_version, e.weights_digest)}{why}"

    named = "; ".join(one(e) for e in pending[:NAMED_ENGINES])
    more = f"; and {len(pending) - NAMED_ENGINES} more" if len(pending) > NAMED_ENGINES else ""
    want = _weights(desired.version, desired.digest)
    return f"{len(pending)}/{total} engine(s) do not hold the desired weights {want}: {named}{more}"
