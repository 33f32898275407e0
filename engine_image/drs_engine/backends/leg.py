"""The ``generate`` skeleton every backend that runs its own model follows (``sim``, ``torch``).

A leg is one of three request types, and the order of its steps is the same whatever computes
the tokens:

1. ``generation_only``: fetch the context a prefill engine left (:meth:`LegSteps.receive`);
   otherwise prefill the prompt after its cached prefix (:meth:`LegSteps.prefill`).
   Either gives a :class:`Prefilled`: the backend's own state and the first token.
2. ``context_and_generation`` and ``generation_only``: decode from there
   (:meth:`LegSteps.decode`, which yields the first token too and ends with the
   :class:`~drs_engine.backends.base.LegFinished`).
3. ``context_only``: the first token, then either the turn ended on it (nothing to hand over:
   :meth:`LegSteps.discard`) or the state is left for the decode engine (:meth:`LegSteps.leave`).

A backend passes an object with these steps (composition: the steps own the backend's state;
this module owns only the order).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from drs_engine.backends.base import (
    ContextHandoff,
    LegEvent,
    LegFinished,
    LegRequest,
    Picked,
    finish_after,
    token_step,
)
from drs_engine.backends.handoff import context_request_id
from drs_engine.wire import RequestType

S = TypeVar("S")
P = TypeVar("P", bound=Picked)


@dataclass(slots=True)
class Prefilled(Generic[S, P]):
    """A leg's state after its prompt (prefilled here, or received), and the first token."""

    state: S
    first: P
    cached_tokens: int
    #: tokens looked up in the prefix cache (0: a received context, no lookup)
    prefix_query_tokens: int
    weights_version: str | None = None

    def finished(
        self,
        leg: LegRequest,
        finish_reason: str,
        stop_reason: int | str | None,
        *,
        weights_version: str | None,
        weights_boundary: int | None = None,
        handoff: ContextHandoff | None = None,
    ) -> LegFinished:
        """The leg's :class:`LegFinished`, with this state's usage counts."""
        return LegFinished(
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            prompt_tokens=len(leg.prompt_token_ids),
            cached_tokens=self.cached_tokens,
            prefix_query_tokens=self.prefix_query_tokens,
            handoff=handoff,
            weights_version=weights_version,
            weights_boundary=weights_boundary,
        )


class LegSteps(Protocol[S, P]):
    """What a backend does at each step of a leg (see the module docstring)."""

    @property
    def eos_token_id(self) -> int: ...
    @property
    def endpoint(self) -> str: ...
    async def receive(self, leg: LegRequest) -> Prefilled[S, P]: ...
    async def prefill(self, leg: LegRequest) -> Prefilled[S, P]: ...
    def decode(self, leg: LegRequest, prefilled: Prefilled[S, P]) -> AsyncGenerator[LegEvent, None]: ...
    def leave(self, leg: LegRequest, prefilled: Prefilled[S, P]) -> ContextHandoff: ...
    def discard(self, prefilled: Prefilled[S, P]) -> None: ...


async def run_leg(leg: LegRequest, steps: LegSteps[S, P]) -> AsyncGenerator[LegEvent, None]:
    """Run one leg through ``steps``: token steps, then exactly one :class:`LegFinished`."""
    if leg.request_type is RequestType.GENERATION_ONLY:
        prefilled = await steps.receive(leg)
    else:
        prefilled = await steps.prefill(leg)
    if leg.request_type is not RequestType.CONTEXT_ONLY:
        async for event in steps.decode(leg, prefilled):
            yield event
        return
    first = prefilled.first
    yield token_step(first, leg)
    finish, stop_reason = finish_after(leg, [first.token_id], steps.eos_token_id)
    if finish == "stop":  # the turn ended on the prefill engine: nothing to hand over
        steps.discard(prefilled)
        handoff = ContextHandoff(
            ctx_request_id=context_request_id(leg), first_gen_tokens=[first.token_id], ctx_info_endpoint=steps.endpoint
        )
    else:
        finish = finish or "not_finished"
        handoff = steps.leave(leg, prefilled)
    yield prefilled.finished(leg, finish, stop_reason, weights_version=prefilled.weights_version, handoff=handoff)
