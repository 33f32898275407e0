"""Render + tokenize a chat turn at a cost in proportion to what is new, bit-identical to a full run.

NeMo RL's path re-renders and re-tokenizes the whole conversation every turn. Here a bounded
LRU (by conversation id, capped in entries and bytes) keeps, per conversation, the last turn's
messages, rendered text, ids and cut points. A new turn then

1. compares its messages with the cached ones (a client may rewrite history: only the common
   leading messages count);
2. re-renders only a window at the end (:mod:`.window`) when the template passed the window
   probe, else renders the whole conversation;
3. checks the rendered text against the cached text: everything up to the last added token
   inside the common text keeps its cached ids (:mod:`.splice`); the rest is tokenized anew.

Every check that fails falls back to the full path, :func:`drs_protocol.chat.render_prompt_ids`,
the function the engine itself uses. A configurable share of turns (the shadow rate) is also run
in full and compared; a mismatch is counted, logged, and the full ids are used.
"""

from __future__ import annotations

import logging
import sys
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Final

from drs_protocol.chat import ChatTemplateError, render_prompt_ids, render_prompt_text
from drs_protocol.token_prefix import (
    KnownIds,
    KnownText,
    Spliced,
    TokenPrefix,
    TokenPrefixError,
    find_prefix,
    history_end,
    join,
    last_assistant_index,
    render_spliced_ids,
    splice,
)

from drs_frontend.gym_ids import materialize
from drs_frontend.tokenization.probes import probe_history_eos, probe_windowing
from drs_frontend.tokenization.read_ids import reader
from drs_frontend.tokenization.splice import SpliceTokenizer, Tokenized, common_prefix_length
from drs_frontend.tokenization.window import (
    Window,
    cached_form,
    kept_messages,
    message_view,
    plan_window,
    skeleton_for,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

#: Openings kept for the siblings that follow: every turn tokenized in full (a new conversation's
#: first turn, and a turn with no cache entry to extend: no conversation id, a restart, rewritten
#: history), by rendered text; and the largest kept (``Tokenized.nbytes``): at most 32 MiB.
OPENINGS: Final = 64
OPENING_BYTES: Final = 512 * 1024

Message = Mapping[str, Any]


class Path(StrEnum):
    """How a turn's ids were made (the ``path`` label of the tokenization metrics)."""

    FULL = "full"  #: no usable cache entry
    INCREMENTAL = "incremental"  #: cached ids reused, a window re-rendered
    RERENDERED = "rerendered"  #: cached ids reused, the whole conversation re-rendered
    #: a new conversation whose text equals a recent one's opening (GRPO siblings): its ids reused
    SHARED = "shared"
    SHADOW_MISMATCH = "shadow_mismatch"  #: the incremental ids differed from the full ones


@dataclass(frozen=True, slots=True)
class TurnIds:
    ids: array[int]
    path: Path
    new_ids: int  #: ids tokenized this turn (the rest came from the cache)
    shadowed: bool = False
    spliced: Spliced | None = None  #: set when a token prefix was spliced in


@dataclass(frozen=True, slots=True)
class _Made:
    tokenized: Tokenized
    path: Path
    new_ids: int
    from_eos: bool = False  #: ``tokenized`` is the text from the splice point on (its first id an EOS)


@dataclass(slots=True)
class _Entry:
    messages: list[dict[str, Any]]  #: as :func:`~.window.cached_form` keeps them (no Gym ids)
    tools: Any
    kwargs: Any
    add_generation_prompt: bool
    tokenized: Tokenized
    nbytes: int
    #: rendered heads (first message + skeleton, by skeleton indices); valid while those messages are kept
    heads: dict[tuple[int, ...], str]
    #: the ids this turn returned (spliced or not): the head of the next turn's token prefix
    known: KnownIds | None = None
    #: the text of the prefix's first field this turn read (:mod:`.read_ids`)
    text: KnownText | None = None


@dataclass(frozen=True, slots=True)
class _Render:
    text: str
    anchor: int | None  #: the window start j, whose block starts at ``anchor_pos``
    anchor_pos: int


class ChatTokenizer:
    """One tokenizer + chat template, with the per-conversation cache."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_entries: int = 4096,
        max_bytes: int = 512 * 1024 * 1024,
        windowed: bool | None = None,
        history_eos_cached: bool | None = None,
        max_openings: int = OPENINGS,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._splicer = SpliceTokenizer(tokenizer)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        #: the last few full renders' tokens by text: the siblings of a GRPO group are each a new
        #: conversation opening with the same prompt, tokenized once (read-only: nothing here
        #: changes a ``Tokenized`` in place, every reuse slices)
        self.max_openings = max_openings
        self._openings: OrderedDict[str, Tokenized] = OrderedDict()
        if windowed is None:
            scratch = type(self)(tokenizer, max_entries=4, max_bytes=max_bytes or 1, windowed=True)
            windowed = probe_windowing(tokenizer, scratch)
        self.windowed = windowed
        self.history_eos_cached = probe_history_eos(tokenizer) if history_eos_cached is None else history_eos_cached
        self.vocab_size = len(tokenizer)  # len() of a fast tokenizer builds its whole vocabulary
        self.eos_id = self._splicer.eos_id

    def find_prefix(
        self, required: Any, messages: Sequence[Message], conversation_id: str | None = None
    ) -> TokenPrefix | None:
        """The request's token prefix (:func:`drs_protocol.token_prefix.find_prefix`), validated
        against this tokenizer; raises :class:`TokenPrefixError` naming the field. With the
        conversation's cached turn, the ids it returned are not bounded and counted again when
        the prefix begins with them byte for byte (:func:`drs_protocol.token_prefix.token_ids`);
        fields left as JSON text (``gym_ids.loads_chat``) are read by :mod:`.read_ids`."""
        entry = self._entries.get(conversation_id) if conversation_id is not None else None
        known = entry.known if entry is not None else None
        eos_id = -1 if self.eos_id is None else self.eos_id
        read = reader(self.vocab_size, eos_id, known, entry.text if entry is not None else None)
        prefix = find_prefix(required, messages, vocab_size=self.vocab_size, eos_id=eos_id, known=known, read=read)
        if prefix is not None and self.eos_id is None:
            raise TokenPrefixError(f"{prefix.param}: this tokenizer has no EOS token to splice at", prefix.param)
        return prefix

    # -- the one entry point ---------------------------------------------------------------------

    def prompt_ids(
        self,
        conversation_id: str | None,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        prefix: TokenPrefix | None = None,
        shadow: bool = False,
    ) -> TurnIds:
        """The prompt ids of a chat turn, spliced after ``prefix`` when one is given
        (:mod:`drs_protocol.token_prefix`); ``shadow`` also runs the full path and compares."""
        entry = self._entries.get(conversation_id) if conversation_id is not None else None
        made: _Made | None = None
        history_eos: int | None = None
        if entry is not None and entry.tools == tools and entry.kwargs == chat_template_kwargs:
            kept = kept_messages(messages, entry.messages)
            if prefix is not None:
                history_eos = self._history_eos_from_cache(entry, messages, kept)
            made = self._incremental(
                conversation_id, entry, messages, kept, tools, chat_template_kwargs, add_generation_prompt, history_eos
            )
        if made is None:
            if prefix is not None and history_eos is None:
                history_eos = self._history_eos(messages, tools, chat_template_kwargs)
            made = self._full(
                conversation_id, messages, tools, chat_template_kwargs, add_generation_prompt, history_eos
            )
        result = TurnIds(made.tokenized.ids, made.path, made.new_ids)
        eos_count = len(made.tokenized.eos_at)  # EOS ids in ``result.ids``
        if prefix is not None:
            if history_eos is None:  # the template failed the history probe
                history_eos = self._history_eos(messages, tools, chat_template_kwargs)
            if made.from_eos:  # only the tail from the k-th EOS token was tokenized
                spliced = join(prefix, made.tokenized.ids, history_eos)
            else:
                spliced = splice(prefix, made.tokenized.ids, made.tokenized.eos_at, history_eos)
                eos_count -= history_eos - 1  # the template's EOS ids before the splice point
            eos_count += prefix.eos_count
            result = TurnIds(spliced.ids, made.path, made.new_ids, spliced=spliced)
        self._remember(conversation_id, result.ids, eos_count, prefix.text if prefix is not None else None)
        if shadow:
            return self._shadow(
                conversation_id, result, messages, tools, chat_template_kwargs, add_generation_prompt, prefix
            )
        return result

    def _shadow(
        self,
        cid: str | None,
        result: TurnIds,
        messages: Sequence[Message],
        tools: Any,
        kwargs: Any,
        agp: bool,
        prefix: TokenPrefix | None,
    ) -> TurnIds:
        """``result`` checked against the full path (spliced the same way when there is a prefix)."""
        messages = materialize(messages)  # the full path as the engine has it: ids parsed
        spliced: Spliced | None = None
        if prefix is not None:
            spliced = render_spliced_ids(
                self.tokenizer, messages, prefix, tools=tools, chat_template_kwargs=kwargs, add_generation_prompt=agp
            )
            full = spliced.ids.tolist()
        else:
            full = render_prompt_ids(
                self.tokenizer, messages, tools=tools, chat_template_kwargs=kwargs, add_generation_prompt=agp
            )
        if result.ids.tolist() != full:
            log.warning(
                "tokenization shadow mismatch (conversation %s, path %s, %s): %d ids vs %d in full; using the full ids",
                cid,
                result.path,
                "spliced" if prefix is not None else "no prefix",
                len(result.ids),
                len(full),
            )
            self.forget(cid)
            self._openings.clear()  # a shared opening may be what went wrong
            return TurnIds(array("i", full), Path.SHADOW_MISMATCH, len(full), shadowed=True, spliced=spliced)
        return TurnIds(result.ids, result.path, result.new_ids, shadowed=True, spliced=result.spliced)

    # -- where a token prefix is spliced ---------------------------------------------------------

    def _history_eos_from_cache(self, entry: _Entry, messages: Sequence[Message], kept: int) -> int | None:
        """``k`` without rendering the history: when the cached turn is exactly the messages
        before the last assistant reply (with the generation prompt), the history holds its EOS
        tokens plus the reply's one. Only for templates that passed :func:`probe_history_eos`."""
        if not self.history_eos_cached or not entry.add_generation_prompt:
            return None
        a = last_assistant_index(messages)
        if a is None or a != len(entry.messages) or kept < a:
            return None
        return len(entry.tokenized.eos_chars) + 1

    def _history_eos(self, messages: Sequence[Message], tools: Any, kwargs: Any) -> int:
        """``k`` the reference way: the EOS tokens of the history rendered on its own (counted in
        its text when each occurrence of the EOS text is one EOS token)."""
        text = self._render(messages[: history_end(messages)], tools, kwargs, False)
        needle = self._splicer.eos_text
        return text.count(needle) if needle is not None else len(self._splicer.encode(text).eos_at)

    def _remember(self, cid: str | None, ids: array[int], eos_count: int, text: KnownText | None) -> None:
        """Keep the ids a turn returned, and the prefix text it read, with its cache entry
        (see :meth:`find_prefix`)."""
        entry = self._entries.get(cid) if cid is not None else None
        if entry is not None and sys.byteorder == "little":  # KnownIds are little-endian
            entry.known, entry.text = KnownIds(ids.tobytes(), eos_count), text
            nbytes = 4 * len(ids) + (len(text.head) + 4 * len(text.ids) if text is not None else 0)
            entry.nbytes, self._bytes = entry.nbytes + nbytes, self._bytes + nbytes
            self._evict()

    def forget(self, conversation_id: str | None) -> None:
        if conversation_id is None:
            return
        entry = self._entries.pop(conversation_id, None)
        if entry is not None:
            self._bytes -= entry.nbytes

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    # -- full ------------------------------------------------------------------------------------

    def _render(self, messages: Sequence[Message], tools: Any, kwargs: Any, agp: bool) -> str:
        # Gym's token-id lists are dropped first: templates ignore them, but transformers walks
        # every value of every message before rendering (O(n^2) ints over a conversation).
        views = [message_view(m) for m in messages]
        return render_prompt_text(
            self.tokenizer, views, tools=tools, chat_template_kwargs=kwargs, add_generation_prompt=agp
        )

    def _full(
        self, cid: str | None, messages: Sequence[Message], tools: Any, kwargs: Any, agp: bool, splice_k: int | None
    ) -> _Made:
        text = self._render(messages, tools, kwargs, agp)
        after = self._splicer.after_eos(None, text, 0, splice_k) if splice_k is not None else None
        if after is not None:
            tail, keep = after
            self._store(cid, messages, tools, kwargs, agp, keep)
            return _Made(tail, Path.FULL, len(tail.ids), from_eos=True)
        tokenized = self._openings.get(text)
        if tokenized is not None:
            self._openings.move_to_end(text)
            self._store(cid, messages, tools, kwargs, agp, tokenized)
            return _Made(tokenized, Path.SHARED, 0)
        tokenized = self._splicer.encode(text)
        self._store(cid, messages, tools, kwargs, agp, tokenized)
        if self.max_openings and tokenized.nbytes <= OPENING_BYTES:
            self._openings[text] = tokenized
            if len(self._openings) > self.max_openings:
                self._openings.popitem(last=False)
        return _Made(tokenized, Path.FULL, len(tokenized.ids))

    # -- incremental -----------------------------------------------------------------------------

    def _incremental(
        self,
        cid: str | None,
        entry: _Entry,
        messages: Sequence[Message],
        kept: int,
        tools: Any,
        kwargs: Any,
        agp: bool,
        splice_k: int | None = None,
    ) -> _Made | None:
        """The turn from the cached one; with ``splice_k``, only the text from its ``splice_k``-th
        EOS token on is tokenized (a token prefix stands for what comes before)."""
        cached = entry.messages
        try:
            rendered = self._render_windowed(entry, messages, kept, tools, kwargs, agp) if self.windowed else None
            windowed = rendered is not None
            if rendered is None:
                rendered = _Render(self._render(messages, tools, kwargs, agp), None, 0)
        except ChatTemplateError:
            return None  # the full path raises the same error with its own message
        known = entry.tokenized
        start = rendered.anchor_pos if rendered.anchor is not None else 0
        common = start + common_prefix_length(known.text[start:], rendered.text[start:])
        heads = {k: v for k, v in entry.heads.items() if max(k, default=0) < kept}
        path = Path.INCREMENTAL if windowed else Path.RERENDERED
        after = self._splicer.after_eos(known, rendered.text, common, splice_k) if splice_k is not None else None
        if after is not None:
            tail, keep = after
            self._store(cid, messages, tools, kwargs, agp, keep, reuse=(cached, kept), heads=heads)
            return _Made(tail, path, len(tail.ids), from_eos=True)
        tokenized, new_ids = self._splicer.extend(known, rendered.text, common)
        self._store(cid, messages, tools, kwargs, agp, tokenized, reuse=(cached, kept), heads=heads)
        return _Made(tokenized, path, new_ids)

    def _render_windowed(
        self, entry: _Entry, messages: Sequence[Message], kept: int, tools: Any, kwargs: Any, agp: bool
    ) -> _Render | None:
        j = plan_window(entry.messages, messages, kept)
        if j is None:
            return None
        pos = self._block_start(entry, j, tools, kwargs)
        if pos is None:
            return None
        tail = self._window_tail(entry, messages, j, tools, kwargs, agp)
        if tail is None:
            return None
        return _Render(entry.tokenized.text[:pos] + tail, j, pos)

    def _window_tail(
        self, entry: _Entry, messages: Sequence[Message], j: int, tools: Any, kwargs: Any, agp: bool
    ) -> str | None:
        """The rendering of ``messages[j:]`` in context, without the head. ``messages[:j]`` equal
        the entry's, so the head (first message + skeleton, all before ``j``) is the entry's too."""
        window = Window(j, skeleton_for(messages, j))
        head, msgs = window.messages(messages)
        head_text = entry.heads.get(window.skeleton)
        if head_text is None:
            head_text = entry.heads[window.skeleton] = self._render(head, tools, kwargs, False)
        text = self._render(msgs, tools, kwargs, agp)
        return text[len(head_text) :] if text.startswith(head_text) else None

    def _block_start(self, entry: _Entry, j: int, tools: Any, kwargs: Any) -> int | None:
        """Where message ``j``'s block starts in the cached text. The cached conversation's own
        window is rendered and must reproduce the end of the cached text exactly: a template
        whose blocks depend on more than the window rules allow fails this check."""
        tail = self._window_tail(entry, entry.messages, j, tools, kwargs, entry.add_generation_prompt)
        text = entry.tokenized.text
        if tail is None or len(tail) > len(text) or not text.endswith(tail):
            return None
        return len(text) - len(tail)

    # -- the LRU ---------------------------------------------------------------------------------

    def _store(
        self,
        cid: str | None,
        messages: Sequence[Message],
        tools: Any,
        kwargs: Any,
        agp: bool,
        tokenized: Tokenized,
        reuse: tuple[list[dict[str, Any]], int] | None = None,
        heads: dict[tuple[int, ...], str] | None = None,
    ) -> None:
        if cid is None or self.max_entries == 0:
            return
        if reuse is not None:
            cached, kept = reuse
            views = cached[:kept] + [cached_form(m) for m in messages[kept:]]
        else:
            views = [cached_form(m) for m in messages]
        nbytes = tokenized.nbytes * 2 + 64 * len(views)  # the messages hold about the text again
        self.forget(cid)
        if nbytes > self.max_bytes:
            return
        self._entries[cid] = _Entry(views, tools, kwargs, agp, tokenized, nbytes, heads or {})
        self._bytes += nbytes
        self._evict()

    def _evict(self) -> None:
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
