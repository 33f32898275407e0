"""Catching up from a serving peer: the desired weights streamed from an engine of the fleet that
holds them (:mod:`drs_protocol.weights_stream`).

The peers are tried in the order given. From each: ``GET /control/weights/stream`` with the
fleet's control token; its header must announce the desired digest (or, with no desired digest
known, the desired version); the backend then takes the bytes and swaps only once their digest,
computed over what arrived, is the announced one. A peer that does not answer, answers another
status, holds other weights, dies mid-stream or sends other bytes is skipped with the reason kept,
and the next is tried; when none gives them, :class:`~drs_engine.errors.WeightsLoadError` names
every peer and why. Every call is bounded (:data:`PEER_CONNECT_S`, :data:`PEER_READ_S`: between
two pieces of the body, so a peer that stops sending mid-stream fails within it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any, Final

import httpx
from drs_protocol import fields
from drs_protocol.routes import CONTROL_WEIGHTS_STREAM
from drs_protocol.weights_state import DesiredWeights

from drs_engine.backends.base import EngineBackend
from drs_engine.errors import EngineError, WeightsLoadError
from drs_engine.weights.stream import StreamError, StreamReader

log = logging.getLogger(__name__)

#: Connecting to a peer.
PEER_CONNECT_S: Final = 5.0
#: The longest wait for the next piece of a peer's answer (its first bytes included).
PEER_READ_S: Final = 30.0
#: The longest error body read from a peer that refused.
MAX_PEER_ERROR_BYTES: Final = 4096


class PeerError(Exception):
    """One peer could not give the desired weights (the message says why)."""


async def load_from_peers(
    backend: EngineBackend, desired: DesiredWeights, peers: Sequence[str], token: str | None
) -> tuple[str, dict[str, Any]]:
    """Load ``desired`` from the first of ``peers`` that gives them: ``(its URL, the load's result)``."""
    if not peers:
        raise WeightsLoadError(
            f"the desired weights {desired.version} have no checkpoint path and no serving peer holds them",
            param="path",
        )
    failures: list[str] = []
    for url in peers:
        try:
            result = await load_from_peer(backend, desired, url, token)
        except PeerError as exc:
            log.warning("catching up from peer %s failed: %s", url, exc)
            failures.append(f"{url}: {exc}")
            continue
        return url, result
    raise WeightsLoadError(f"no peer gave the desired weights {desired.version}: " + "; ".join(failures), param="peers")


async def load_from_peer(
    backend: EngineBackend, desired: DesiredWeights, url: str, token: str | None
) -> dict[str, Any]:
    """Stream ``desired`` from the engine at ``url`` into ``backend`` (:class:`PeerError` naming why not)."""
    headers = fields.control_auth(token) if token else {}
    timeout = httpx.Timeout(PEER_READ_S, connect=PEER_CONNECT_S)
    try:
        async with (
            httpx.AsyncClient(timeout=timeout) as client,
            client.stream("GET", url.rstrip("/") + CONTROL_WEIGHTS_STREAM, headers=headers) as response,
        ):
            if response.status_code != 200:
                body = (await response.aread())[:MAX_PEER_ERROR_BYTES].decode(errors="replace")
                raise PeerError(f"answered {response.status_code}: {_message(body)}")
            reader = StreamReader(response.aiter_raw())
            header = await reader.header()
            if desired.digest is not None and header.digest != desired.digest:
                raise PeerError(f"holds {header.version} ({header.digest}), not the desired digest {desired.digest}")
            if desired.digest is None and header.version != desired.version:
                raise PeerError(f"holds {header.version}, not the desired version {desired.version}")
            result = await backend.load_weights_from_stream(header, reader.pieces(header.nbytes), desired.version)
    except httpx.HTTPError as exc:
        raise PeerError(f"{type(exc).__name__}: {exc or 'no detail'}") from exc
    except StreamError as exc:
        raise PeerError(str(exc)) from exc
    except EngineError as exc:
        raise PeerError(exc.message) from exc
    return {**result, "peer": url}


def _message(body: str) -> str:
    """The ``error.message`` of an error body, else the body itself."""
    try:
        data = json.loads(body)
        return str(data["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.strip() or "(no body)"
