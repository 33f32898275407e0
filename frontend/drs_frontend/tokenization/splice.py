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

    ``ids`` (and the cuts, and ``eos_at``, the positions of the EOS tokens in ``ids``) cover
    ``text[:valid]``: all of it, unless a token prefix was spliced, when the ids of the history are
    the policy's and only the tail after it was tokenized. ``eos_chars`` are where the EOS tokens
    of the whole text start (where a token prefix is spliced)."""

    text: str
    ids: array[int]
    cut_chars: list[int] = field(default_factory=list)
    cut_ids: list[int] = field(default_factory=list)
    eos_at: list[int] = field(default_factory=list)
    eos_chars: list[int] = field(default_factory=list)
    valid: int = -1  #: ``len(text)`` when left at -1

    def __post_init__(self) -> None:
        if self.valid < 0:
            self.valid = len(self.text)

    def last_cut_within(self, chars: int) -> tuple[int, int]:
        """The last cut at or before ``chars`` characters (and within the tokenized part), as
        (chars, ids); (0, 0) if none."""
        i = bisect.bisect_right(self.cut_chars, min(chars, self.valid)) - 1
        if i < 0:
            return 0, 0
        return self.cut_chars[i], self.cut_ids[i]

    @property
    def nbytes(self) -> int:
        width = 1 if self.text.isascii() else 4
        return (
            width * len(self.text)
            + self.ids.itemsize * len(self.ids)
            + 16 * (len(self.cut_chars) + len(self.eos_at) + len(self.eos_chars))
        )


class SpliceTokenizer:
    """Encode text with cut points; encode a new text reusing the ids of a known prefix."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._backend = tokenizer.backend_tokenizer
        self.cut_after = splice_safe(tokenizer)
        eos = tokenizer.eos_token_id
        self.eos_id: int | None = eos if isinstance(eos, int) else None
        self.eos_text = eos_text(tokenizer, self.cut_after, self.eos_id)

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
            eos_hits = [i for i in hits if ids[i] == eos]
        else:
            eos_hits = [i for i, t in enumerate(ids) if t == eos] if eos is not None else []
        # Only the cut tokens' offsets: ``encoding.offsets`` would build a tuple for every token.
        chars = encoding.token_to_chars
        return Tokenized(
            text,
            array("i", ids),
            [chars(i)[1] + char_offset for i in hits],
            [i + 1 + id_offset for i in hits],
            [i + id_offset for i in eos_hits],
            [chars(i)[0] + char_offset for i in eos_hits],
        )

    def extend(self, known: Tokenized, text: str, common_chars: int) -> tuple[Tokenized, int]:
        """``text`` tokenized, reusing ``known``'s ids up to its last cut within the first
        ``common_chars`` characters (which ``text`` and ``known.text`` share). Returns the result
        and how many ids were newly computed."""
        chars, n_ids = known.last_cut_within(common_chars) if self.enabled else (0, 0)
        tail = self.encode(text[chars:], char_offset=chars, id_offset=n_ids)
        if n_ids == 0:
            return tail_only(text, tail), len(tail.ids)
        k = bisect.bisect_right(known.cut_chars, chars)
        e = bisect.bisect_left(known.eos_at, n_ids)
        ids = known.ids[:n_ids]
        ids.extend(tail.ids)
        cut_chars, cut_ids = known.cut_chars[:k] + tail.cut_chars, known.cut_ids[:k] + tail.cut_ids
        eos_chars = known.eos_chars[:e] + tail.eos_chars
        return Tokenized(text, ids, cut_chars, cut_ids, known.eos_at[:e] + tail.eos_at, eos_chars), len(tail.ids)

    def after_eos(
        self, known: Tokenized | None, text: str, common_chars: int, k: int
    ) -> tuple[Tokenized, Tokenized] | None:
        """``text`` tokenized from its ``k``-th EOS token on only (where a token prefix is spliced:
        the ids before it are the policy's), and what to cache of ``text``: ``known``'s ids up to
        its last cut within the first ``common_chars`` characters, and where every EOS starts.

        EOS tokens are found in the text (an added token is matched exactly, so each occurrence
        of its text is one, when no other added token contains it): those of ``known`` within the
        common part, then the text after it. None when that does not apply to this tokenizer,
        or the text holds fewer than ``k``."""
        needle = self.eos_text
        if needle is None or k < 1:
            return None
        found = known.eos_chars[: bisect.bisect_right(known.eos_chars, common_chars - len(needle))] if known else []
        at = found[-1] + len(needle) if found else 0
        found = found[:k]
        while len(found) < k:
            at = text.find(needle, at)
            if at < 0:
                return None
            found.append(at)
            at += len(needle)
        cut = found[k - 1]
        tail = self.encode(text[cut:], char_offset=cut)
        if not tail.eos_at or tail.eos_at[0] != 0:
            return None
        eos_chars = found[: k - 1] + tail.eos_chars
        if known is None:
            return tail, Tokenized(text, array("i"), eos_chars=eos_chars, valid=0)
        chars, n_ids = known.last_cut_within(common_chars)
        c = bisect.bisect_right(known.cut_chars, chars)
        e = bisect.bisect_left(known.eos_at, n_ids)
        keep = Tokenized(
            text, known.ids[:n_ids], known.cut_chars[:c], known.cut_ids[:c], known.eos_at[:e], eos_chars, chars
        )
        return tail, keep


def tail_only(text: str, tail: Tokenized) -> Tokenized:
    return Tokenized(text, tail.ids, tail.cut_chars, tail.cut_ids, tail.eos_at, tail.eos_chars)


def eos_text(tokenizer: PreTrainedTokenizerBase, cut_after: frozenset[int], eos_id: int | None) -> str | None:
    """The EOS token's text, when each occurrence of it in a text is one EOS token: it is a safe
    added token (:func:`splice_safe`) and no other added token's text contains it."""
    if eos_id is None or eos_id not in cut_after:
        return None
    decoder: dict[int, Any] = dict(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    text = str(decoder[eos_id].content)
    if any(text in str(t.content) for i, t in decoder.items() if i != eos_id):
        return None
    return text


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
