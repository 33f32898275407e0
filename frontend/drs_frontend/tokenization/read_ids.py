"""The token prefix's ids read from their JSON text, at a cost in proportion to what is new.

:func:`drs_frontend.gym_ids.loads_chat` leaves Gym's id arrays as :class:`~drs_frontend.gym_ids.RawIds`
(unparsed JSON text). Turn n's ``prompt_token_ids`` (or ``required_prefix_token_ids``) holds
turn n−1's ids of the same field followed by a few hundred new ones, and a client writes the
same ids the same way every time. So the cache keeps the text of the field it read last turn
(:class:`~drs_protocol.token_prefix.KnownText`: without its ``]``), and when this turn's text
begins with it, byte for byte, only the text after it is parsed and checked: ~130 kB compared
(≈10 µs) instead of 21,813 ids parsed, packed and bounded (≈1.7 ms cold) at turn 100.

Exact: ``head + rest`` is a JSON array of ``head``'s ids and then those of ``[0`` + ``rest``
(with ``rest`` starting, past blanks, with a comma): ``head`` is a valid array's text up to its
last element. Anything else (a client that wrote the ids otherwise, a changed id) is parsed in
full and checked as before (:func:`drs_protocol.token_prefix.token_ids`).
"""

from __future__ import annotations

from array import array
from typing import Any

from drs_protocol.token_prefix import IdsReader, KnownIds, KnownText, TokenPrefixError, token_ids

from drs_frontend import wire_json
from drs_frontend.gym_ids import RawIds


def reader(vocab_size: int, eos_id: int, known: KnownIds | None, text: KnownText | None) -> IdsReader:
    """An :data:`~drs_protocol.token_prefix.IdsReader` for a request from ``loads_chat``: ``known``
    the ids the conversation's last turn returned, ``text`` the first field's text it read."""

    def read(value: Any, param: str, first: bool) -> tuple[array[int], int, KnownText | None]:
        if not isinstance(value, RawIds):
            return (*token_ids(value, param, vocab_size, eos_id, known if first else None), None)
        if first and text is not None:
            after = _after_head(value, text, param, vocab_size, eos_id)
            if after is not None:
                return after
        try:
            parsed = value.parse()
        except ValueError:
            raise TokenPrefixError(f"{param}: must be a list of token ids", param) from None
        ids, eos_count = token_ids(parsed, param, vocab_size, eos_id, known if first else None)
        return ids, eos_count, _known_text(value, ids, eos_count) if first else None

    return read


def _after_head(
    value: RawIds, text: KnownText, param: str, vocab_size: int, eos_id: int
) -> tuple[array[int], int, KnownText | None] | None:
    """The ids of ``value`` when its text begins with ``text.head``; None when it does not."""
    if not value.startswith(text.head):
        return None
    rest = value.body[value.start + len(text.head) : value.end]
    if rest.lstrip()[:1] != b",":
        return None
    try:
        parsed = wire_json.loads(b"[0" + rest)
    except ValueError:
        return None
    if not isinstance(parsed, list):
        return None
    new, new_eos = token_ids(parsed[1:], param, vocab_size, eos_id)
    ids = text.ids + new
    eos_count = text.eos_count + new_eos
    return ids, eos_count, _known_text(value, ids, eos_count, len(text.ids))


def _known_text(value: RawIds, ids: array[int], eos_count: int, reused: int = 0) -> KnownText | None:
    """What to keep of this field's text for the next turn (one copy of it: ~130 kB at turn 100)."""
    body, end = value.body, value.end - 1  # the "]"
    while end > value.start and body[end - 1] in b" \t\r\n":
        end -= 1
    if end - value.start < 2:  # "[": no element to continue after
        return None
    return KnownText(body[value.start : end], ids, eos_count, reused)
