"""Routers by their configured names (``ctx_router`` / ``gen_router``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from drs_protocol import enums

from drs_frontend.config import FrontendConfig
from drs_frontend.routing.balance import LeastLoadedRouter, RoundRobinRouter
from drs_frontend.routing.base import Candidate, Claim, Decision, RouteRequest
from drs_frontend.routing.conversation import ConversationRouter


class CtxRouter(Protocol):
    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision: ...

    @property
    def looks_up(self) -> bool: ...

    def lookup_targets(self, request: RouteRequest, urls: Sequence[str]) -> list[str]: ...

    def claim_target(self, request: RouteRequest, urls: Sequence[str]) -> Claim | None: ...

    def claim_ahead(self, request: RouteRequest, urls: Sequence[str], work: Mapping[str, int]) -> Claim | None: ...

    def claim_kept(self, request: RouteRequest, claimed: str, urls: Sequence[str]) -> bool: ...


class GenRouter(Protocol):
    def pick(self, candidates: Sequence[Candidate]) -> Decision: ...


class _Stateless:
    """A gen router used as a ctx router: it ignores the request."""

    def __init__(self, inner: GenRouter) -> None:
        self._inner = inner

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        return self._inner.pick(candidates)

    @property
    def looks_up(self) -> bool:
        return False

    def lookup_targets(self, request: RouteRequest, urls: Sequence[str]) -> list[str]:
        return []

    def claim_target(self, request: RouteRequest, urls: Sequence[str]) -> Claim | None:
        return None

    def claim_ahead(self, request: RouteRequest, urls: Sequence[str], work: Mapping[str, int]) -> Claim | None:
        return None

    def claim_kept(self, request: RouteRequest, claimed: str, urls: Sequence[str]) -> bool:
        return False


def build_ctx_router(config: FrontendConfig) -> CtxRouter:
    name = config.ctx_router
    if name == enums.CtxRouter.CONVERSATION:
        return ConversationRouter(
            max_sessions=config.max_sessions,
            load_factor=config.affinity_load_factor,
            match_ratio=config.prefix_match_ratio,
            block_tokens=config.prefix_block_tokens,
            groups=config.group_routing,
            lookup_engines=config.group_lookup_engines,
        )
    round_robin = name == enums.CtxRouter.ROUND_ROBIN
    return _Stateless(build_gen_router(enums.GenRouter.ROUND_ROBIN if round_robin else enums.GenRouter.LOAD_BALANCING))


def build_gen_router(name: enums.GenRouter) -> GenRouter:
    if name == enums.GenRouter.ROUND_ROBIN:
        return RoundRobinRouter()
    return LeastLoadedRouter()
