"""An engine brings itself to the fleet's desired weights before it ever reports ready.

The operator gives every engine pod the desired weights (``drs_protocol.weights_state.DesiredWeights``,
stored by the trainer's sidecar as a refit starts) through :data:`drs_protocol.env.DESIRED_WEIGHTS_JSON`.
At its start, after the backend has loaded what it starts with, the engine compares: when it
holds other weights (another version, or another digest) and the desired weights name a checkpoint
path, it loads that path before its ``/health`` answers 200, so the frontends and the pod's
readiness see it only at the desired weights, and it checks the digest it measured against the
desired one. A load that fails, or leaves another digest, stops the engine's start with a message
naming the path or the digest (the pod restarts and shows why). A fleet that never had a refit has
no desired weights: the engine starts as it always did.

Desired weights without a path (they came by broadcast or CUDA IPC) cannot be loaded here: the
engine starts at its own weights and says so (catching up from a serving peer is not built).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from drs_protocol import env
from drs_protocol.weights_state import DesiredWeights

from drs_engine.backends.base import EngineBackend
from drs_engine.errors import WeightsLoadError

log = logging.getLogger(__name__)


class DesiredWeightsError(ValueError):
    """``DRS_DESIRED_WEIGHTS_JSON`` is set and not valid desired weights."""


def desired_from_env(environ: Mapping[str, str]) -> DesiredWeights | None:
    """The desired weights the pod was given (None: none, the variable unset or empty)."""
    text = environ.get(env.DESIRED_WEIGHTS_JSON, "").strip()
    if not text:
        return None
    try:
        return DesiredWeights.model_validate_json(text)
    except ValueError as exc:
        raise DesiredWeightsError(f"{env.DESIRED_WEIGHTS_JSON}: not valid desired weights: {exc}") from exc


def holds(version: str, digest: str | None, desired: DesiredWeights) -> bool:
    """Whether weights at ``version`` with ``digest`` are the desired ones (by digest when both
    are known, else by version)."""
    if desired.digest is not None and digest is not None:
        return digest == desired.digest
    return version == desired.version


async def reach(backend: EngineBackend, digest: str | None, desired: DesiredWeights | None) -> str | None:
    """Bring ``backend`` (holding weights of ``digest``) to ``desired``; the digest it holds
    afterwards. :class:`WeightsLoadError` when the load fails or leaves other bytes."""
    if desired is None or holds(backend.weights_version, digest, desired):
        return digest
    if desired.path is None:
        log.warning(
            "the fleet's desired weights %s have no checkpoint path: this engine starts at %s (peer catch-up not built)",
            desired.version,
            backend.weights_version,
        )
        return digest
    log.info("loading the fleet's desired weights %s from %s before serving", desired.version, desired.path)
    await backend.load_weights(desired.path, desired.version)
    reached = await backend.measure_digest()
    if desired.digest is not None and reached is not None and reached != desired.digest:
        raise WeightsLoadError(
            f"the desired weights {desired.version} from {desired.path!r} gave digest {reached}, not {desired.digest}",
            param="digest",
        )
    return reached
