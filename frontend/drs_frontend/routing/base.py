"""The values routers exchange with the relay."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Reason(StrEnum):
    """Why an engine was chosen (the ``reason`` label of ``drs_frontend_routes_total``)."""

    STICKY = "sticky"  #: the conversation's pinned engine
    REPINNED = "repinned"  #: the conversation was pinned to an engine that is now unavailable
    RENDEZVOUS = "rendezvous"  #: a new conversation: first engine in HRW order under the load bound
    PREFIX = "prefix"  #: no conversation id; the engine that holds most of this prompt
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


@dataclass(frozen=True, slots=True)
class Candidate:
    """An engine the relay may use now, with the requests it has in flight from this frontend."""

    url: str
    in_flight: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    url: str
    reason: Reason


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a ctx router may look at: the conversation id, else the prompt.

    ``prompt_ids`` are the frontend's token ids (tokenization on); else ``messages`` (chat) or
    ``prompt`` (completions) stand in for them as text.
    """

    conversation_id: str | None = None
    prompt_ids: Sequence[int] | None = None
    messages: Sequence[Mapping[str, Any]] | None = None
    prompt: str | None = None
