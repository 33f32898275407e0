"""Render only the end of a conversation: which messages a new turn must re-render.

A chat template is a program over the whole message list, but ChatML templates (Qwen2.5,
Qwen3 and their kin) render each message as one block that depends on little context: the first
message (a system prompt, or the tools header), whether an assistant turn comes after the *last
user query* (Qwen3 shows ``<think>`` reasoning only there and drops it from earlier turns), whether
it is the last message, and whether neighbouring messages are tool results (grouped into one
user block). For such templates

    render(M') == render(M)[:pos(j)] + tail(render([M'[0]] + skeleton + M'[j:]))

when the new conversation ``M'`` keeps the first ``j`` messages of the cached ``M``, and:

* message ``j`` is not a tool result in either (tool grouping looks at neighbours);
* no assistant turn before ``j`` changes side of the last user query: either both conversations
  have the same last query, or ``j <= min(q, q') + 1``;
* the first message is a system or user message (rendered the same at the head of any window);
* ``skeleton`` is ``[M'[q']]``, the last user query, when it lies strictly between the first
  message and ``j``, so that the window has the same last query as the whole conversation.

``tail(x)`` is ``x`` without the rendering of ``[M'[0]] + skeleton`` (checked to be a prefix).
:func:`plan_window` applies these rules; whether a given template obeys them is tested once per
template at load time (:func:`~drs_frontend.tokenization.probes.probe_windowing`) and on a sample
of turns (the shadow check), and a template that does not is rendered in full every turn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from drs_protocol import chat

Message = Mapping[str, Any]

#: Keys NeMo-Gym adds to prior assistant messages; templates ignore them, so do comparisons.
GYM_MESSAGE_FIELDS: Final = frozenset(chat.GYM_MESSAGE_FIELDS)

TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"


def message_view(message: Message) -> dict[str, Any]:
    """The parts of a message a template may read (everything but Gym's token fields)."""
    if GYM_MESSAGE_FIELDS.isdisjoint(message):
        return dict(message)
    return {k: v for k, v in message.items() if k not in GYM_MESSAGE_FIELDS}


class _GymIds:
    """What a cached message holds in place of Gym's id fields: equal to anything, since the
    template never reads them (:func:`message_view` drops them before rendering)."""

    __slots__ = ()
    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        return True

    def __repr__(self) -> str:
        return "<Gym ids>"


GYM_IDS: Final = _GymIds()


def cached_form(message: Message) -> dict[str, Any]:
    """A message as the per-conversation cache keeps it: a copy, Gym's fields as :data:`GYM_IDS`
    (the ids are not kept; the next turn's echo of the message compares equal to this)."""
    if GYM_MESSAGE_FIELDS.isdisjoint(message):
        return dict(message)
    return {k: GYM_IDS if k in GYM_MESSAGE_FIELDS else v for k, v in message.items()}


def same_message(message: Message, other: Mapping[str, Any]) -> bool:
    """``message_view(message) == message_view(other)``: equal but for Gym's fields."""
    return message == other or message_view(message) == message_view(other)


def kept_messages(messages: Sequence[Message], cached: Sequence[Mapping[str, Any]]) -> int:
    """How many leading ``messages`` equal the ``cached`` forms but for Gym's fields (a client may
    rewrite history). Runs every turn over every earlier message, so the whole lists are
    compared first, in C (:data:`GYM_IDS` equals whatever the client echoed); only when that
    fails is each message compared on its own."""
    n = min(len(messages), len(cached))
    if messages[:n] == cached[:n]:
        return n
    kept = 0
    for a, b in zip(messages, cached, strict=False):
        if not same_message(a, b):
            break
        kept += 1
    return kept


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return ""


def is_query(message: Message) -> bool:
    """A user message that is not a tool result wrapped in ``<tool_response>`` tags."""
    if message.get("role") != "user":
        return False
    text = _text(message.get("content"))
    return not (text.startswith(TOOL_RESPONSE_OPEN) and text.endswith(TOOL_RESPONSE_CLOSE))


def last_query_index(messages: Sequence[Message]) -> int:
    """The index of the last user query, or ``len - 1`` when there is none (as Qwen3 computes it)."""
    for i in range(len(messages) - 1, -1, -1):
        if is_query(messages[i]):
            return i
    return len(messages) - 1


def has_query(messages: Sequence[Message], index: int) -> bool:
    return 0 <= index < len(messages) and is_query(messages[index])


@dataclass(frozen=True, slots=True)
class Window:
    """Re-render from message ``start``; ``skeleton`` indices go between the head and the window."""

    start: int
    skeleton: tuple[int, ...]

    def messages(self, conversation: Sequence[Message]) -> tuple[list[Message], list[Message]]:
        """(head, head + window): the head's rendering is cut off the window's."""
        head = [conversation[0], *(conversation[i] for i in self.skeleton)]
        return head, [*head, *conversation[self.start :]]


def skeleton_for(conversation: Sequence[Message], start: int) -> tuple[int, ...]:
    q = last_query_index(conversation)
    return (q,) if 0 < q < start and has_query(conversation, q) else ()


def plan_window(cached: Sequence[Mapping[str, Any]], new: Sequence[Message], kept: int) -> int | None:
    """The largest message index ``j`` from which ``new`` can be re-rendered, given that the
    first ``kept`` messages of ``new`` equal those of ``cached``; None when there is none."""
    m = len(cached)
    if m < 2 or not new or new[0].get("role") not in ("system", "user"):
        return None
    q_old = last_query_index(cached)
    q_new = last_query_index(new)
    limit = min(kept, m - 1, len(new) - 1)
    if q_old != q_new:
        limit = min(limit, min(q_old, q_new) + 1)
    for j in range(limit, 0, -1):
        if cached[j].get("role") != "tool" and new[j].get("role") != "tool":
            return j
    return None
