"""A conversation's *opening*: what GRPO siblings share, and what every later turn starts with.

The opening of a chat request is its ``tools`` and its messages before the first ``assistant``
message. In a GRPO group every sibling (its own session, its own id) sends the same first turn, so
the same opening; every later turn of a conversation starts with that opening, whatever was said
since. :func:`opening_of` names it by a key, ``blake2b`` over a canonical JSON of the tools and of
each opening message's ``role``, ``content``, ``name`` and ``tool_call_id`` (sorted keys):

* a pure function of the request, identical in every process (no salted ``hash``), so a restarted
  frontend, or another frontend of the replica, computes the same key for a later turn as the
  first frontend did for the first turn;
* the same on tokenizing and non-tokenizing frontends (it reads text, never ids), and blind to
  Gym's id fields (only assistant messages carry them, and they are not part of the opening).

The ctx router places a new conversation by rendezvous over this key (:mod:`.conversation`), so
siblings land together and later turns find their engine after a restart. Sizes are estimated
in tokens: the frontend's ids when it tokenized, else characters / :data:`CHARS_PER_TOKEN`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

#: Characters per token, to estimate a prompt's tokens from its text (English and JSON average).
CHARS_PER_TOKEN: Final = 4
#: Message fields that make up the opening (what the chat template renders of a non-assistant turn).
OPENING_FIELDS: Final = ("role", "content", "name", "tool_call_id")
KEY_BYTES: Final = 16


@dataclass(frozen=True, slots=True)
class Opening:
    key: str  #: hex blake2b of the canonical opening
    chars: int  #: characters of the opening's text (:func:`message_chars`, tools included)
    first_turn: bool  #: no assistant message yet: the whole prompt is the opening


def _canonical(value: Any) -> bytes:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # not JSON (never from a parsed body); still a pure function of the value
        return repr(value).encode()


def opening_of(messages: Sequence[Any], tools: Any = None) -> Opening | None:
    """The opening of a chat request; None when there is nothing before the first assistant message."""
    end = len(messages)
    for i, message in enumerate(messages):
        if isinstance(message, Mapping) and message.get("role") == "assistant":
            end = i
            break
    if end == 0:
        return None
    projected = [{k: m[k] for k in OPENING_FIELDS if k in m} if isinstance(m, Mapping) else m for m in messages[:end]]
    text = _canonical([tools if tools else None, projected])
    key = hashlib.blake2b(text, digest_size=KEY_BYTES).hexdigest()
    return Opening(key=key, chars=message_chars(messages[:end], tools), first_turn=end == len(messages))


def opening_messages(messages: Sequence[Any]) -> Sequence[Any]:
    """The messages before the first assistant message (all of them on a first turn)."""
    for i, message in enumerate(messages):
        if isinstance(message, Mapping) and message.get("role") == "assistant":
            return messages[:i]
    return messages


def is_first_turn(messages: Sequence[Any]) -> bool:
    """No assistant message yet (a scan that stops at the first one: a few messages on a later turn)."""
    return not any(isinstance(m, Mapping) and m.get("role") == "assistant" for m in messages)


def tools_text(tools: Any) -> bytes:
    """The tools as the canonical text the opening and the prefix chain hash."""
    return _canonical(tools) if tools else b""


def content_text(content: Any) -> str:
    """A message's content as text: itself when a string, else its canonical JSON ("" for none)."""
    if isinstance(content, str):
        return content
    return _canonical(content).decode() if content else ""


def message_chars(messages: Sequence[Any], tools: Any = None) -> int:
    """Characters of a prompt's text: the tools, and each message's role and content plus one (a size
    estimate; the prefix chain's block weights are the same figures)."""
    total = len(tools_text(tools))
    for message in messages:
        if isinstance(message, Mapping):
            content = message.get("content")
            total += len(str(message.get("role", ""))) + 1
            total += len(content) if isinstance(content, str) else len(content_text(content))
    return total


def estimate_tokens(chars: int) -> int:
    return max(1, chars // CHARS_PER_TOKEN)
