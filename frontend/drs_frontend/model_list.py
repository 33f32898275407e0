"""``GET /v1/models`` on the frontend: OpenAI's model list, as an engine of this replica answers it.

The frontend does not know the served model's name; its engines do (``drs_protocol.model_list``).
It asks them in turn (prefill engines first, then decode; the usable ones, as a leg would pick
them), each within ``timeouts.models``, checks the answer against :class:`ModelList` and relays the
first valid one; 503 naming the engines it tried when none answers one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from drs_protocol import routes
from drs_protocol.errors import error_body
from drs_protocol.model_list import ModelList
from pydantic import ValidationError

from drs_frontend import wire_json
from drs_frontend.engines import EnginePool
from drs_frontend.errors import UpstreamError
from drs_frontend.upstream import UpstreamClient

log = logging.getLogger(__name__)


async def relay_model_list(pools: Sequence[EnginePool], upstream: UpstreamClient, timeout: float) -> tuple[int, bytes]:
    """``(status, body)`` of the frontend's answer."""
    tried: list[str] = []
    for pool in pools:
        for candidate in pool.candidates():
            tried.append(candidate.url)
            try:
                response = await upstream.get(candidate.url + routes.MODELS, timeout)
            except UpstreamError as exc:
                log.warning("%s engine %s: GET %s failed: %s", pool.role, candidate.url, routes.MODELS, exc)
                continue
            if response.status != 200:
                continue
            try:
                models = ModelList.model_validate_json(response.body)
            except ValidationError as exc:
                log.warning("%s engine %s answered a malformed model list: %s", pool.role, candidate.url, exc)
                continue
            return 200, wire_json.dumps(models.model_dump(mode="json"))
    detail = f"tried {', '.join(tried)}" if tried else "none is up"
    return 503, wire_json.dumps(error_body(503, f"no engine answered GET {routes.MODELS} ({detail})"))
