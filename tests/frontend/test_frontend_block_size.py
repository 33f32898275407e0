"""A frontend started by hand (no ``prefixBlockTokens``) routes by prefix in its prefill engines'
own block size, read from their ``/server_info``; one given the size keeps it. Real sim engines
and frontends."""

from __future__ import annotations

import asyncio

from drs_frontend.routing.conversation import ConversationRouter
from drs_protocol.frontend_config import DEFAULT_PREFIX_BLOCK_TOKENS

from .conftest import Replica, ReplicaFactory

ENGINE_BLOCK = 16


def router_of(replica: Replica, index: int = 0) -> ConversationRouter:
    router = replica.frontends[index].app.relay.ctx_router
    assert isinstance(router, ConversationRouter)
    return router


async def test_a_frontend_without_prefix_block_tokens_takes_the_prefill_engines_block_size(
    replica_factory: ReplicaFactory,
) -> None:
    assert ENGINE_BLOCK != DEFAULT_PREFIX_BLOCK_TOKENS
    async with replica_factory(engine={"sim": {"tokensPerBlock": ENGINE_BLOCK}}) as replica:
        router = router_of(replica)
        async with asyncio.timeout(10):
            while router.block_tokens != ENGINE_BLOCK:
                await asyncio.sleep(0.05)


async def test_a_frontend_given_prefix_block_tokens_keeps_it(replica_factory: ReplicaFactory) -> None:
    async with replica_factory(engine={"sim": {"tokensPerBlock": ENGINE_BLOCK}}, prefix_block_tokens=64) as replica:
        await asyncio.sleep(1.0)  # several probe rounds (0.2 s apart)
        assert router_of(replica).block_tokens == 64
