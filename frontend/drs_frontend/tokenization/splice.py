"""Tokenize text so that a cached prefix's ids can be reused: split points at added tokens.

A Hugging Face fast tokenizer first cuts the text at every added token (``<|im_start|>``,
``<|im_end|>``, ``<think>`` …) and then normalizes, pre-tokenizes and BPE-merges each piece on
its own: no merge ever crosses an added token. So for a cut ``c`` just after an added token,
``ids(text) == ids(text[:c]) + ids(text[c:])``, provided the added token is matched exactly
(no ``lstrip``/``rstrip``/``single_word``, not normalized) and no added token is a prefix of
another (the matcher takes the longest match, which could then run past ``c``).
:func:`splice_safe` checks those conditions for a tokenizer; :class:`Tokenized` keeps, for each
added token in the ids, the character offset just after it and the number of ids up to it.
"""

from __future__ import annotations

import bisect
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def splice_safe(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids of the added tokens a cut may follow; empty when splicing is unsafe for this tokenizer."""
    decoder: dict[int, Any] = dict(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    if not decoder or getattr(tokenizer, "is_fast", False) is not True:
        return frozenset()
    contents = [str(t.content) for t in decoder.values()]
    for a in contents:
        for b in contents:
            if a != b and b.startswith(a):
                return frozenset()
    safe = {
        token_id
        for token_id, token in decoder.items()
        if not token.lstrip and not token.rstrip and not token.single_word and not token.normalized
    }
    return frozenset(safe)


@dataclass(slots=True)
class Tokenized:
    """Text, its ids, and the safe cut points: ``cut_chars[i]`` chars correspond to ``cut_ids[i]`` ids.
    ``eos_at`` are the positions of the EOS tokens in ``ids`` (where a token prefix is spliced)."""

    text: str
    ids: array[int]
    cut_chars: list[int] = field(default_factory=list)
    cut_ids: list[int] = field(default_factory=list)
    eos_at: list[int] = field(default_factory=list)

    def last_cut_within(self, chars: int) -> tuple[int, int]:
        """The last cut at or before ``chars`` characters, as (chars, ids); (0, 0) if none."""
        i = bisect.bisect_right(self.cut_chars, chars) - 1
        if i < 0:
            return 0, 0
        return self.cut_chars[i], self.cut_ids[i]

    @property
    def nbytes(self) -> int:
        width = 1 if self.text.isascii() else 4
        return (
            width * len(self.text) + self.ids.itemsize * len(self.ids) + 16 * (len(self.cut_chars) + len(self.eos_at))
        )


class SpliceTokenizer:
    """Encode text with cut points; encode a new text reusing the ids of a known prefix."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._backend = tokenizer.backend_tokenizer
        self.cut_after = splice_safe(tokenizer)
        eos = tokenizer.eos_token_id
        self.eos_id: int | None = eos if isinstance(eos, int) else None

    @property
    def enabled(self) -> bool:
        return bool(self.cut_after)

    def encode(self, text: str, *, char_offset: int = 0, id_offset: int = 0) -> Tokenized:
        """``text`` tokenized (no special tokens added), cut points shifted by the offsets."""
        encoding = self._backend.encode(text, add_special_tokens=False)
        ids = encoding.ids
        cut_after = self.cut_after
        hits = [i for i, t in enumerate(ids) if t in cut_after]
        eos = self.eos_id
        if eos in cut_after:
            eos_at = [i + id_offset for i in hits if ids[i] == eos]
        else:
            eos_at = [i + id_offset for i, t in enumerate(ids) if t == eos] if eos is not None else []
        # Only the cut tokens' offsets: ``encoding.offsets`` would build a tuple for every token.
        chars = encoding.token_to_chars
        return Tokenized(
            text,
            array("i", ids),
            [chars(i)[1] + char_offset for i in hits],
            [i + 1 + id_offset for i in hits],
            eos_at,
        )

    def extend(self, known: Tokenized, text: str, common_chars: int) -> tuple[Tokenized, int]:
        """``text`` tokenized, reusing ``known``'s ids up to its last cut within the first
        ``common_chars`` characters (which ``text`` and ``known.text`` share). Returns the result
        and how many ids were newly computed."""
        chars, n_ids = known.last_cut_within(common_chars) if self.enabled else (0, 0)
        tail = self.encode(text[chars:], char_offset=chars, id_offset=n_ids)
        if n_ids == 0:
            return Tokenized(text, tail.ids, tail.cut_chars, tail.cut_ids, tail.eos_at), len(tail.ids)
        k = bisect.bisect_right(known.cut_chars, chars)
        e = bisect.bisect_left(known.eos_at, n_ids)
        ids = known.ids[:n_ids]
        ids.extend(tail.ids)
        cut_chars, cut_ids = known.cut_chars[:k] + tail.cut_chars, known.cut_ids[:k] + tail.cut_ids
        return Tokenized(text, ids, cut_chars, cut_ids, known.eos_at[:e] + tail.eos_at), len(tail.ids)


def common_prefix_length(a: str, b: str) -> int:
    """Length of the longest common prefix, by bisection on C-speed slice comparisons."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
