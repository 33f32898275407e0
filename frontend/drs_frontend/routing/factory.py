"""Routers by their configured names (``ctx_router`` / ``gen_router``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from drs_frontend.config import CtxRouterName, FrontendConfig, GenRouterName
from drs_frontend.routing.balance import LeastLoadedRouter, RoundRobinRouter
from drs_frontend.routing.base import Candidate, Decision, RouteRequest
from drs_frontend.routing.conversation import ConversationRouter


class CtxRouter(Protocol):
    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision: ...


class GenRouter(Protocol):
    def pick(self, candidates: Sequence[Candidate]) -> Decision: ...


class _Stateless:
    """A gen router used as a ctx router: it ignores the request."""

    def __init__(self, inner: GenRouter) -> None:
        self._inner = inner

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        return self._inner.pick(candidates)


def build_ctx_router(config: FrontendConfig) -> CtxRouter:
    name: CtxRouterName = config.ctx_router
    if name == "conversation":
        return ConversationRouter(
            max_sessions=config.max_sessions,
            load_factor=config.affinity_load_factor,
            match_ratio=config.prefix_match_ratio,
            block_tokens=config.prefix_block_tokens,
        )
    return _Stateless(build_gen_router("round_robin" if name == "round_robin" else "load_balancing"))


def build_gen_router(name: GenRouterName) -> GenRouter:
    if name == "round_robin":
        return RoundRobinRouter()
    return LeastLoadedRouter()
