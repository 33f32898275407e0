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
"""

from __future__ import annotations

from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: ``groupLookupEngines``' default: 0, the load-free placement by opening (no bound, no lookup). The
#: bounded walk with the lookup is opt-in: measured (docs/grpo-routing.md) it keeps the load bound and
#: restart affinity but costs prompt sharing between a replica's frontends and group completion time.
DEFAULT_LOOKUP_ENGINES: Final = 0
#: Engines asked, first in rendezvous order of the opening's key, when turned on (the benchmark's setting).
SUGGESTED_LOOKUP_ENGINES: Final = 4
#: Seconds one engine has to answer (``timeouts.prefixLookup``' default): a miss costs a turn at most this.
DEFAULT_LOOKUP_TIMEOUT_S: Final = 0.5


class PrefixHeldRequest(BaseModel):
    """Exactly one of ``messages`` (with ``tools``) or ``prompt_token_ids``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    messages: list[dict[str, Any]] | None = Field(default=None, min_length=1)
    tools: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _one_prompt(self) -> PrefixHeldRequest:
        if (self.messages is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of messages or prompt_token_ids")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools go with messages")
        return self


class PrefixHeld(BaseModel):
    """What the engine's prefix cache holds of the prompt: ``held_blocks`` of its ``blocks`` full
    blocks of ``tokens_per_block`` ids (``tokens``: the prompt's length)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: int = Field(ge=0)
    blocks: int = Field(ge=0)
    held_blocks: int = Field(ge=0)
    tokens_per_block: int = Field(ge=1)

    @model_validator(mode="after")
    def _held_within(self) -> PrefixHeld:
        if self.held_blocks > self.blocks:
            raise ValueError("held_blocks must not exceed blocks")
        return self

    @property
    def held_tokens(self) -> int:
        return self.held_blocks * self.tokens_per_block

    @property
    def covers(self) -> bool:
        """Every full block of the prompt is held (and it has one)."""
        return 0 < self.blocks == self.held_blocks
