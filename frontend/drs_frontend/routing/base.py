"""The values routers exchange with the relay."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from drs_protocol.prefix_lookup import PrefixHeld

from drs_frontend.routing.groups import Opening


class Reason(StrEnum):
    """Why an engine was chosen (the ``reason`` label of ``drs_frontend_routes_total``)."""

    STICKY = "sticky"  #: the conversation's pinned engine
    REPINNED = "repinned"  #: the conversation was pinned to an engine that is now unavailable
    RENDEZVOUS = (
        "rendezvous"  #: a new conversation: first engine in HRW order (under the load bound without an opening)
    )
    GROUP = "group"  #: a new conversation whose opening this frontend placed already: the group's engine
    LOOKUP = "lookup"  #: a conversation and opening unknown here: the engine a prefix-held lookup found holding it
    PREFIX = "prefix"  #: no conversation id; the engine that holds most of this prompt
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


class Sibling(StrEnum):
    """Where a new conversation went relative to its group (the ``placed`` label of
    ``drs_frontend_group_siblings_total``)."""

    FIRST = "first"  #: the first of its opening here: it placed the group (on its first engine)
    MOVED = "moved"  #: the first of its opening here, placed past its first engine by the load bound
    FOUND = "found"  #: the first of its opening here, sent where a lookup found the opening held
    WITH_GROUP = "with_group"  #: on the engine its group was placed on
    APART = "apart"  #: elsewhere: the pool changed since (the group's engine gone, or another one first now)


@dataclass(frozen=True, slots=True)
class Candidate:
    """An engine the relay may use now, with the requests it has in flight from this frontend and
    the prompt tokens those requests are expected to compute (``pending``, from :attr:`Decision.cost`)."""

    url: str
    in_flight: int = 0
    pending: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    url: str
    reason: Reason
    #: prompt tokens this leg is expected to compute there (the relay adds it to ``pending``)
    cost: int = field(default=0, compare=False)
    #: where a new conversation placed by its opening went relative to its group
    sibling: Sibling | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a ctx router may look at: the conversation id, the prompt and its opening.

    ``prompt_ids`` are the frontend's token ids (tokenization on); else ``messages`` and ``tools``
    (chat) or ``prompt`` (completions) stand in for them as text. ``opening``
    (:func:`.groups.opening_of`, what the conversation's every turn starts with) when the relay
    computed it already (a first turn); else the router computes it from the messages if it needs it.
    ``held``: the answers of a prefix-held lookup (engine URL -> what it holds of the opening),
    when the router asked for one (:meth:`.ConversationRouter.lookup_targets`); None: not asked.
    ``claimed``: where a claim sent with that lookup counted a new group (the router places it there).
    """

    conversation_id: str | None = None
    prompt_ids: Sequence[int] | None = None
    messages: Sequence[Mapping[str, Any]] | None = None
    prompt: str | None = None
    tools: Any = None
    opening: Opening | None = None
    held: Mapping[str, PrefixHeld] | None = None
    #: the engine a claim sent with the lookup counted this new group on, and it stands (:meth:`.ConversationRouter.claim_kept`)
    claimed: str | None = None


@dataclass(frozen=True, slots=True)
class Claim:
    """A new group's placement to count on its engine before its leg is sent (:meth:`.ConversationRouter.claim_target`)."""

    url: str
    tokens: int
    limit: int | None  #: the most work the engine may hold with it (the walk's bound); None: whatever it holds
