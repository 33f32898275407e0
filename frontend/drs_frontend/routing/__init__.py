"""Engine choice inside one replica (PROTOCOL.md section 4): pure, no I/O, no clock.

A router sees the candidates the relay hands it (engines of one role that are up and not yet
tried this turn, with their in-flight counts) and returns one of them with the reason it chose
it. Routers hold only their own caches (sticky sessions, prefix blocks), never a socket.

* ctx (prefill): :class:`ConversationRouter` (sticky + rendezvous with bounded load + prefix
  match), :class:`LeastLoadedRouter`, :class:`RoundRobinRouter`;
* gen (decode): :class:`LeastLoadedRouter`, :class:`RoundRobinRouter`.
"""

from drs_frontend.routing.balance import LeastLoadedRouter, RoundRobinRouter
from drs_frontend.routing.base import Candidate, Claim, Decision, Reason, RouteRequest
from drs_frontend.routing.conversation import ConversationRouter
from drs_frontend.routing.factory import CtxRouter, GenRouter, build_ctx_router, build_gen_router

__all__ = [
    "Candidate",
    "Claim",
    "ConversationRouter",
    "CtxRouter",
    "Decision",
    "GenRouter",
    "LeastLoadedRouter",
    "Reason",
    "RoundRobinRouter",
    "RouteRequest",
    "build_ctx_router",
    "build_gen_router",
]
