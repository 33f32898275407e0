"""``GET /control/weights/stream``: the weights this engine holds, for a peer catching up.

Behind the control token (:func:`drs_engine.server.control.check_token`, as every control route).
The answer is one :mod:`drs_protocol.weights_stream` stream: the header (version, the digest the
engine measured, the tensors) and the bytes in the refit layout, from the backend
(``export_weights``). It does not take the control lock, so a long stream never holds up a refit;
a refit that changes the bytes in place while they stream makes the receiver's digest differ from
the header's, and the receiver takes nothing (it tries its next peer). An engine that does not
hold the desired weights it started under, or whose digest is unknown, refuses (503, 409): it has
nothing a peer can verify.
"""

from __future__ import annotations

import logging
from typing import Any

from drs_protocol.routes import CONTROL_WEIGHTS_STREAM
from drs_protocol.weights_stream import STREAM_MEDIA_TYPE, WeightsStreamHeader, stream_length
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from drs_engine.errors import EngineError, WeightsPendingError
from drs_engine.server.control import check_token
from drs_engine.server.state import EngineState
from drs_engine.weights.stream import stream_body

log = logging.getLogger(__name__)


class NoDigestError(EngineError, status=409):
    """The engine's backend measured no digest of its weights: a peer could not verify them."""


def register(app: Any, state: EngineState) -> None:
    """Add the stream route to ``app``."""

    async def stream_weights(request: Request) -> Response:
        try:
            check_token(state, request)
            backend = state.require_backend()
            if state.catch_up is not None and state.catch_up.pending:
                raise WeightsPendingError(state.catch_up.reason())
            digest = state.weights_digest
            if digest is None:
                raise NoDigestError(f"the {backend.name} backend measured no digest of its weights: nothing to stream")
            version = backend.weights_version
            export = await backend.export_weights()
            header = WeightsStreamHeader(
                version=version, digest=digest, backend=backend.name, nbytes=export.nbytes, tensors=export.tensors
            )
        except EngineError as exc:
            return JSONResponse(exc.to_body(), status_code=exc.status)
        log.info("streaming weights %s (%d bytes) to a peer", version, header.nbytes)
        return StreamingResponse(
            stream_body(header, export.pieces),
            media_type=STREAM_MEDIA_TYPE,
            headers={"content-length": str(stream_length(header))},
        )

    app.add_api_route(CONTROL_WEIGHTS_STREAM, stream_weights, methods=["GET"], name="stream_weights")
