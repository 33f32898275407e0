"""An engine brings itself to the fleet's desired weights before it ever reports ready.

The operator gives every engine pod the desired weights (``drs_protocol.weights_state.DesiredWeights``,
stored by the trainer's sidecar as a refit starts) through :data:`drs_protocol.env.DESIRED_WEIGHTS_JSON`,
and the engines that hold them in the mounted weights ConfigMap (:class:`Peers`: read again on every
attempt; :data:`drs_protocol.env.WEIGHTS_PEERS_JSON`, as the pod started, where none is mounted).
At its start, after the backend has loaded what it starts with, the engine compares: when it
holds other weights (another version, or another digest) it is not ready (``/health`` and turns
answer 503 ``weights_pending``) until it reached them (:mod:`.catchup`): from their checkpoint
path when they have one, else from a serving peer (:mod:`.peer`). Each attempt checks the digest
it measured afterwards against the desired one. A fleet that never had a refit has no desired
weights: the engine starts as it always did.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from drs_protocol import env
from drs_protocol.weights_state import DesiredWeights
from drs_protocol.weights_stream import WeightsPeers

from drs_engine.backends.base import EngineBackend
from drs_engine.errors import WeightsLoadError
from drs_engine.weights import peer

log = logging.getLogger(__name__)


class DesiredWeightsError(ValueError):
    """``DRS_DESIRED_WEIGHTS_JSON`` or ``DRS_WEIGHTS_PEERS_JSON`` is set and not valid, or the mounted
    desired weights' file (``drs_engine.weights.follow``) cannot be read or parsed."""


def desired_from_env(environ: Mapping[str, str]) -> DesiredWeights | None:
    """The desired weights the pod was given (None: none, the variable unset or empty)."""
    return parse_desired(environ.get(env.DESIRED_WEIGHTS_JSON, ""), env.DESIRED_WEIGHTS_JSON)


def parse_desired(text: str, where: str) -> DesiredWeights | None:
    """The desired weights in ``text`` (None: empty, a fleet with none); :class:`DesiredWeightsError`
    naming ``where`` (the variable, the file) when they are not valid."""
    if not text.strip():
        return None
    try:
        return DesiredWeights.model_validate_json(text)
    except ValueError as exc:
        raise DesiredWeightsError(f"{where}: not valid desired weights: {exc}") from exc


def peers_from_env(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The peers the pod was given (empty: none, the variable unset or empty)."""
    text = environ.get(env.WEIGHTS_PEERS_JSON, "").strip()
    if not text:
        return ()
    try:
        return WeightsPeers.model_validate_json(text).root
    except ValueError as exc:
        raise DesiredWeightsError(
            f"{env.WEIGHTS_PEERS_JSON}: not a JSON list of engine base URLs (http://host:port): {exc}"
        ) from exc


@dataclass(frozen=True, slots=True)
class Peers:
    """The peers a catch-up asks, read again on every attempt (:meth:`current`): the file of the
    mounted weights ConfigMap (``file``, :data:`drs_protocol.env.WEIGHTS_DIR`) while it is there
    (the kubelet keeps it up to date, so peers placed after the start are asked), else ``given``
    (:data:`drs_protocol.env.WEIGHTS_PEERS_JSON` at the start: an engine started by hand)."""

    given: tuple[str, ...] = ()
    file: Path | None = None

    def current(self) -> tuple[str, ...]:
        """The peers now; :class:`WeightsLoadError` naming the file when it cannot be read or parsed."""
        if self.file is None:
            return self.given
        try:
            text = self.file.read_text().strip()
        except FileNotFoundError:  # not mounted, or the ConfigMap has no peers key
            return self.given
        except OSError as exc:
            raise WeightsLoadError(f"the peers file {str(self.file)!r} cannot be read: {exc}", param="peers") from exc
        if not text:
            return ()
        try:
            return WeightsPeers.model_validate_json(text).root
        except ValueError as exc:
            raise WeightsLoadError(
                f"the peers file {str(self.file)!r}: not a JSON list of engine base URLs (http://host:port): {exc}",
                param="peers",
            ) from exc


def peers_file_from_env(environ: Mapping[str, str]) -> Path | None:
    """The peers' file in the mounted weights ConfigMap (None: no directory given)."""
    directory = environ.get(env.WEIGHTS_DIR, "").strip()
    return Path(directory) / env.WEIGHTS_PEERS_KEY if directory else None


def desired_file_from_env(environ: Mapping[str, str]) -> Path | None:
    """The desired weights' file in the mounted weights ConfigMap, which a running engine follows
    (``drs_engine.weights.follow``; None: no directory given)."""
    directory = environ.get(env.WEIGHTS_DIR, "").strip()
    return Path(directory) / env.DESIRED_WEIGHTS_KEY if directory else None


class StartWeights(TypedDict):
    """What an engine is started with about the fleet's weights (``uvicorn_server``'s keywords)."""

    desired_weights: DesiredWeights | None
    weights_peers: Peers
    desired_file: Path | None


def weights_from_env(environ: Mapping[str, str]) -> StartWeights:
    """The desired weights and the peers the pod was given (:class:`DesiredWeightsError` naming the variable)."""
    return StartWeights(
        desired_weights=desired_from_env(environ),
        weights_peers=Peers(peers_from_env(environ), peers_file_from_env(environ)),
        desired_file=desired_file_from_env(environ),
    )


def holds(version: str, digest: str | None, desired: DesiredWeights) -> bool:
    """Whether weights at ``version`` with ``digest`` are the desired ones (by digest when both
    are known, else by version)."""
    if desired.digest is not None and digest is not None:
        return digest == desired.digest
    return version == desired.version


async def reach(
    backend: EngineBackend, desired: DesiredWeights, peers: Sequence[str], token: str | None
) -> tuple[str | None, str]:
    """One attempt to bring ``backend`` to ``desired``: ``(the digest it holds afterwards, where
    they came from)``. :class:`WeightsLoadError` when the load fails or leaves other bytes."""
    if desired.path is not None:
        log.info("loading the fleet's desired weights %s from %s before serving", desired.version, desired.path)
        await backend.load_weights(desired.path, desired.version)
        source = desired.path
    else:
        log.info(
            "catching up to the fleet's desired weights %s from a serving peer (%d given)", desired.version, len(peers)
        )
        source, _ = await peer.load_from_peers(backend, desired, peers, token)
    reached = await backend.measure_digest()
    if desired.digest is not None and reached is not None and reached != desired.digest:
        raise WeightsLoadError(
            f"the desired weights {desired.version} from {source!r} gave digest {reached}, not {desired.digest}",
            param="digest",
        )
    return reached, source
