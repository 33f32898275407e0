"""A chat request parsed without NeMo-Gym's token-id arrays: each is read only where it is used.

At turn n of a Gym rollout every earlier assistant message carries its turn's ``prompt_token_ids``
(and ``generation_token_ids``, ``generation_log_probs``): O(n²) numbers, 1.09 M ids and 6.6 MB as
``json.dumps`` writes them at turn 100 of ``bench/tokenization.py``, which orjson turns into Python
ints in 64–84 ms there. A frontend
that tokenizes reads only the last assistant message's arrays (or ``required_prefix_token_ids``),
and sends the engines none of them. So :func:`loads_chat` cuts every such array out of the
bytes before parsing, puts a :class:`RawIds` (the array's JSON text, unparsed) where it was, and
parses the rest: 2.2–3.3 ms at turn 100 (``request_parse`` in the benchmark).

The result is the body ``wire_json.loads`` gives, with those arrays as :class:`RawIds`
(:func:`materialize` turns them back), or that body itself whenever a rule below does not hold:

* an array is cut at ``"<name>" ws* : ws* [`` up to the first ``]`` after it, where ``<name>`` is
  one of :data:`MESSAGE_FIELDS` or :data:`PREFIX_FIELD`; an unescaped quote preceded by ``s``
  is a string delimiter, so that match is a key when the body is valid JSON (one that is not
  fails to parse after the cut too, and then in full, with the full parse's error);
* the array may hold no ``"``: numbers have no ``]`` in them, and a nested array makes the
  cut body fail to parse (what follows the first ``]`` is array syntax where an object goes on);
* the cut body holds no ``\\u005X``/``\\u006X``/``\\u007X`` escape: a key spelled with one (the
  same key once parsed) would not have been cut;
* each cut becomes a distinct integer placeholder, and every placeholder must come back, once,
  as the value of one of those fields on a message of ``messages`` (or of the prefix field at
  the top level): a cut anywhere else, or a duplicate key (the last one wins), and the body is
  parsed in full.

What is not checked: the text of a cut array that is never read (an earlier message's) is not
parsed, so a malformed number in it is not refused (its ``"`` / nesting are, above). Those
arrays are ignored by the template and never reach an engine from a tokenizing frontend.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from drs_protocol.chat import GYM_MESSAGE_FIELDS
from drs_protocol.token_prefix import PREFIX_FIELD

from drs_frontend import wire_json

#: Gym's fields on earlier assistant messages (the template ignores them).
MESSAGE_FIELDS: Final = frozenset(GYM_MESSAGE_FIELDS)

_NAMES = b"|".join(re.escape(n.encode()) for n in sorted({*MESSAGE_FIELDS, PREFIX_FIELD}))
#: ``"name": [`` for each field whose array is cut (the match ends at the ``[``).
_KEY: Final = re.compile(rb'"(?:' + _NAMES + rb')"[ \t\r\n]*:[ \t\r\n]*\[')
#: Escapes that can spell an ASCII letter or ``_`` (a key written with them is the same key).
_LETTER_ESCAPES: Final = (b"\\u005", b"\\u006", b"\\u007")


@dataclass(frozen=True, slots=True, eq=False)
class RawIds:
    """An id (or log-prob) array left unparsed: ``body[start:end]`` is its JSON text."""

    body: bytes
    start: int  #: the ``[``
    end: int  #: just past the ``]``

    def text(self) -> bytes:
        return self.body[self.start : self.end]

    def startswith(self, head: bytes) -> bool:
        """Does the array's text begin with ``head`` (compared in place, nothing copied)?"""
        return self.end - self.start >= len(head) and self.body.startswith(head, self.start)

    def parse(self) -> Any:
        """The array as ``wire_json.loads`` reads it (raises ``ValueError`` when malformed)."""
        return wire_json.loads(self.text())


def loads_chat(raw: bytes) -> Any:
    """``wire_json.loads(raw)`` with Gym's id arrays as :class:`RawIds` (see the module doc);
    raises what ``wire_json.loads(raw)`` raises."""
    spans = _spans(raw)
    if not spans:
        return wire_json.loads(raw)
    pieces: list[bytes] = []
    last = 0
    for n, (start, end) in enumerate(spans):
        pieces.append(raw[last:start])
        pieces.append(b"%d" % n)
        last = end
    pieces.append(raw[last:])
    cut = b"".join(pieces)
    if any(escape in cut for escape in _LETTER_ESCAPES):
        return wire_json.loads(raw)
    try:
        body = wire_json.loads(cut)
    except (ValueError, UnicodeDecodeError):
        return wire_json.loads(raw)  # raises the full body's own error (or parses it)
    if not _put_back(body, raw, spans):
        return wire_json.loads(raw)
    return body


def _spans(raw: bytes) -> list[tuple[int, int]]:
    """Where the arrays to cut lie (``[`` to just past ``]``); empty when one may hold a string."""
    spans: list[tuple[int, int]] = []
    find, search = raw.find, _KEY.search
    pos = 0
    while (match := search(raw, pos)) is not None:
        start = match.end() - 1
        end = find(b"]", start)
        if end < 0 or find(b'"', start, end) >= 0:
            return []
        spans.append((start, end + 1))
        pos = end + 1
    return spans


def _put_back(body: Any, raw: bytes, spans: list[tuple[int, int]]) -> bool:
    """Replace each placeholder with its :class:`RawIds`; False unless every one is found once,
    where a Gym field goes."""
    if not isinstance(body, dict):
        return False
    seen: set[int] = set()

    def take(holder: dict[str, Any], name: str) -> bool:
        n = holder[name]
        if type(n) is not int or not 0 <= n < len(spans) or n in seen:
            return False
        seen.add(n)
        holder[name] = RawIds(raw, *spans[n])
        return True

    if PREFIX_FIELD in body and not take(body, PREFIX_FIELD):
        return False
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict) and not MESSAGE_FIELDS.isdisjoint(message):
                for name in MESSAGE_FIELDS.intersection(message):
                    if not take(message, name):
                        return False
    return len(seen) == len(spans)


def skipped(body: Mapping[str, Any]) -> bool:
    """Does ``body`` (from :func:`loads_chat`) hold any :class:`RawIds`?"""
    if isinstance(body.get(PREFIX_FIELD), RawIds):
        return True
    messages = body.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and any(isinstance(m.get(name), RawIds) for name in MESSAGE_FIELDS) for m in messages
    )


def materialize(value: Any) -> Any:
    """``value`` with every :class:`RawIds` parsed (the body ``wire_json.loads`` would give)."""
    if isinstance(value, RawIds):
        return value.parse()
    if isinstance(value, dict):
        return {k: materialize(v) for k, v in value.items()}
    if isinstance(value, list):
        return [materialize(v) for v in value]
    return value
