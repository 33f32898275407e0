"""The prefix-held lookup: a frontend asks a prefill engine how much of a prompt its cache holds.

A frontend that does not know a conversation (it restarted, or the replica's other frontend placed
it) and does not know its opening either asks the first few prefill engines in rendezvous order of
the opening's key (``groupLookupEngines``), each within ``timeouts.prefixLookup``, and follows the
one that holds the longest prefix (frontend/drs_frontend/routing/conversation.py,
docs/grpo-routing.md). Only then: a routing hit asks nobody.

``POST`` :data:`drs_protocol.routes.PREFIX_HELD` on the serving API (the serving token, as every turn): the body is a
:class:`PrefixHeldRequest`, the opening's ``messages`` (and ``tools``) that the engine renders with
its chat template and no generation prompt (:func:`drs_protocol.chat.render_prompt_ids`, the
function the frontend tokenizes with: rendered so, the opening is a prefix of every turn of the
conversation), or the ids themselves. The answer, :class:`PrefixHeld`, counts the leading full
blocks its prefix cache holds *now* (stored when a context phase ended; a block still being
computed is not held), looked up without touching the cache's LRU order or its hit counters. An
engine whose backend cannot answer says 501 (``not_implemented``); the frontend treats that, a
timeout and any other error as no answer.

A *claim* (:class:`PrefixClaim`, the request's ``claim``) counts a new group's placement on the
engine the moment a frontend decides it, not when its first leg arrives: the engine adds the
claim's ``tokens`` to its recent work at once, and atomically, only if that work would then stay
within the claim's ``limit`` (the walk's bound; none: the walk had no room anywhere and takes the
least loaded engine). The answer's ``claimed`` says whether it did; a refusal carries the engine's
live ``recent_work`` (not the quote), and the frontend asks the engines again for theirs as they
stand now (``live``) and walks on with those. So
groups placed at once, from one snapshot of the loads, by any frontend of the replica, spread. A
claim lasts until a leg of its prompt arrives or :data:`CLAIM_TTL_S`; an engine that already
counts a claim or a leg in flight for every full block of the prompt (a sibling's) accepts without
counting it twice. An engine from before claims refuses the field (400): no claim, as before.

One round trip (since 2026-12-06): a frontend that has the engines' figures from earlier answers
sends a new group's claim *with* its lookup (the claim on the engine its walk chooses from those
figures, the lookup alone to the others, all at once). So the answer to a claim gives
``pending_blocks`` as they stood *before* the claim (the frontend must see whether another
frontend's sibling is there, not its own claim). Where the answers show the group held or pending
elsewhere (the replica's other frontend placed it a moment ago), the frontend follows that engine
and takes its claim back (``release``: the claims of exactly this prompt that no leg has taken are
dropped; off the turn's path).
"""

from __future__ import annotations

from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: ``groupLookupEngines``' default: the first 4 engines in rendezvous order of the opening's key (every
#: engine of a replica of up to 4): the bounded walk with the lookup and claims, the placement that keeps
#: the load bound, prompt sharing and restart affinity (the default since 2026-12-07; 0 before: the
#: load-free placement by opening, no bound, no lookup). Measured (docs/grpo-routing.md): about the
#: load-free placement's group completion at ~970 shared tokens (0.95-1.09x), 0.82x at ~1,900.
DEFAULT_LOOKUP_ENGINES: Final = 4
#: Seconds a frontend asks no lookups of an engine that said it cannot answer them (501: ``trtllm``).
CANNOT_ANSWER_S: Final = 300.0
#: Seconds of an engine's recent prefill work (:attr:`PrefixHeld.recent_work`): the prompt tokens it
#: computed in this window, plus those its context legs in flight are expected to compute.
RECENT_WORK_WINDOW_S: Final = 60.0
#: Seconds an engine answers every ask about one prompt with the ``recent_work`` it gave the first:
#: the siblings of a group reach a replica's frontends within this, and each frontend asks about
#: the group when it first sees it, so all of them walk with the same figures and place it alike.
WORK_QUOTE_S: Final = 5.0
#: Seconds a claim counts on its engine when no leg of its prompt arrives (the frontend gave up).
CLAIM_TTL_S: Final = 10.0
#: Seconds one engine has to answer (``timeouts.prefixLookup``' default): a miss costs a turn at most this.
DEFAULT_LOOKUP_TIMEOUT_S: Final = 0.5


class PrefixClaim(BaseModel):
    """Count ``tokens`` of prefill work for this prompt here now, if the engine's recent work with
    them added stays within ``limit`` (None: whatever it is)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: int = Field(ge=1)
    limit: int | None = Field(default=None, ge=1)


class PrefixHeldRequest(BaseModel):
    """Exactly one of ``messages`` (with ``tools``) or ``prompt_token_ids``; optionally a ``claim``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    messages: list[dict[str, Any]] | None = Field(default=None, min_length=1)
    tools: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = Field(default=None, min_length=1)
    claim: PrefixClaim | None = None
    #: answer ``recent_work`` as it stands now, not quoted (a frontend whose claim was refused walks on with these)
    live: bool = False
    #: drop this prompt's claims here that no leg has taken (a claim sent with a lookup that found the group elsewhere)
    release: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> PrefixHeldRequest:
        if (self.messages is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of messages or prompt_token_ids")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools go with messages")
        if self.release and self.claim is not None:
            raise ValueError("release goes without a claim")
        return self


class PrefixHeld(BaseModel):
    """What the engine's prefix cache holds of the prompt: ``held_blocks`` of its ``blocks`` full
    blocks of ``tokens_per_block`` ids (``tokens``: the prompt's length); ``pending_blocks``: the
    leading full blocks a context leg in flight here will store when its context phase ends (a
    sibling placed by another frontend a moment ago; 0 from an engine that does not say);
    ``recent_work``: the engine's own recent prefill work, the prompt tokens it computed in the last
    :data:`RECENT_WORK_WINDOW_S` seconds plus those its context legs in flight are expected to
    compute, as it stood when the engine was first asked about this prompt within the last
    :data:`WORK_QUOTE_S` seconds (None from an engine that does not say). So every frontend that
    asks about a group reads the same figures, and a replica's frontends place it alike
    (docs/grpo-routing.md). An answer to a claim: ``claimed``, and ``recent_work`` live, the
    claim included when counted; its ``pending_blocks`` as they stood before the claim."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: int = Field(ge=0)
    blocks: int = Field(ge=0)
    held_blocks: int = Field(ge=0)
    tokens_per_block: int = Field(ge=1)
    pending_blocks: int = Field(default=0, ge=0)
    recent_work: int | None = Field(default=None, ge=0)
    #: the request's claim was counted (None: no claim asked)
    claimed: bool | None = None

    @model_validator(mode="after")
    def _held_within(self) -> PrefixHeld:
        if self.held_blocks > self.blocks:
            raise ValueError("held_blocks must not exceed blocks")
        if self.pending_blocks > self.blocks:
            raise ValueError("pending_blocks must not exceed blocks")
        return self

    @property
    def held_tokens(self) -> int:
        return self.held_blocks * self.tokens_per_block

    @property
    def covers(self) -> bool:
        """Every full block of the prompt is held (and it has one)."""
        return 0 < self.blocks == self.held_blocks

    @property
    def will_hold(self) -> int:
        """Leading full blocks held now or once the context legs in flight here end."""
        return max(self.held_blocks, self.pending_blocks)

    @property
    def will_cover(self) -> bool:
        """Every full block of the prompt is held, or will be when a leg in flight here ends."""
        return 0 < self.blocks == self.will_hold
