"""What a frontend learns from its engines rather than from its config: their prefix-cache block size.

The operator renders ``prefixBlockTokens`` from the prefill engines' own config. A frontend
started by hand without it asks its prefill engines (``GET /server_info``, field
:data:`drs_protocol.fields.SERVER_INFO_TOKENS_PER_BLOCK`) once one answers, and hashes prompts in
their blocks from then on, so prefix routing scores hits at the granularity the engines cache.
Until then, and when no engine reports a usable size, it keeps the default (logged).
"""

from __future__ import annotations

import asyncio
import json
import logging

from drs_protocol import fields, routes

from drs_frontend.engines import EnginePool
from drs_frontend.errors import UpstreamError
from drs_frontend.routing.conversation import ConversationRouter
from drs_frontend.upstream import UpstreamClient

log = logging.getLogger(__name__)


async def engine_block_tokens(upstream: UpstreamClient, urls: list[str], timeout: float) -> int | None:
    """The block size the first answering engine of ``urls`` reports, or None (none answered a usable one)."""
    for url in urls:
        try:
            answer = await upstream.get(url + routes.SERVER_INFO, timeout)
        except UpstreamError:
            continue
        if answer.status != 200:
            continue
        try:
            value = json.loads(answer.body).get(fields.SERVER_INFO_TOKENS_PER_BLOCK)
        except (ValueError, AttributeError):
            log.warning("engine %s: /server_info is not a JSON object", url)
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        log.warning("engine %s: /server_info has no usable %s (%r)", url, fields.SERVER_INFO_TOKENS_PER_BLOCK, value)
    return None


async def adopt_block_tokens(
    router: ConversationRouter, pool: EnginePool, upstream: UpstreamClient, *, interval: float, timeout: float
) -> int:
    """Wait until an engine of ``pool`` (the prefill engines, own ones first) reports its block
    size, set it on ``router`` and return it; retried every ``interval`` seconds."""
    while True:
        up = [e.url for e in pool.engines.values() if e.probe_ok]
        size = await engine_block_tokens(upstream, up, timeout) if up else None
        if size is not None:
            if size != router.block_tokens:
                log.info(
                    "prefix routing in blocks of %d tokens, as the prefill engines cache (was %d)",
                    size,
                    router.block_tokens,
                )
            router.block_tokens = size
            return size
        await asyncio.sleep(interval)
