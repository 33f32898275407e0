"""On-policy token continuity: a turn's prompt ids begin with the ids the policy actually produced.

NeMo-Gym sends back, on every earlier assistant message, the ids it received for that turn
(``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs``), and may send
``required_prefix_token_ids`` on the request. Re-rendering the history as text and tokenizing it
again does not give those ids back whenever detokenize → retokenize is not the identity (merges
across a boundary, whitespace, special tokens, a ``<think>`` block the template drops from earlier
turns): the trainer would then score tokens the policy never emitted. So, as NeMo RL's own chat
servers do (``replace_prefix_tokens`` in ``nemo_rl/models/generation/openai_server_utils.py``),
the prompt is *spliced*:

* ``P``: ``required_prefix_token_ids``; without it, the last assistant message's
  ``prompt_token_ids + generation_token_ids`` (no splice when that message carries neither);
* ``T``: the template tokenization of the whole request (:func:`drs_protocol.chat.render_prompt_ids`);
* ``k``: the number of end-of-turn (EOS) tokens in the template tokenization of the history
  through the last assistant message (``add_generation_prompt=False``; all messages when there
  is no assistant message);
* ``ids = P[:-1 if P ends with EOS] + T[c:]``, where ``c`` is the position of the ``k``-th EOS
  token in ``T``.

So ``P`` appears verbatim (a final EOS of ``P`` is the EOS at ``T[c]``), followed by the
end-of-turn token the template writes after the assistant message, the new messages and the
generation prompt: turn n's ids extend turn n−1's prompt + generated ids. Counting EOS tokens
rather than positions finds the same boundary when the template drops earlier reasoning.

``P`` *covers the history* when it holds exactly ``k − 1`` EOS tokens before its final one (one
per block the template renders before the assistant reply). When it does not, the ids of ``P``
belong to another rendering of the history (a client that rewrote or dropped turns): the splice
still happens, as NeMo RL does, and the outcome is :attr:`PrefixOutcome.DIVERGENT`, which every
caller logs (``token prefix diverges from the rendered history``) and counts. A malformed field
(not a list of ids within the vocabulary) is a :class:`TokenPrefixError` naming it (a 400), as is a
conversation whose template renders fewer than ``k`` EOS tokens (no boundary to splice at).

The frontend (with ``tokenize`` on) and the engine (when it renders the prompt itself) both call
:func:`find_prefix` and :func:`splice`; :func:`render_spliced_ids` is the whole reference path.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Final

import numpy

from drs_protocol.chat import render_prompt_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: The request field (NeMo-Gym's and NeMo RL's name) holding the required prefix.
PREFIX_FIELD: Final = "required_prefix_token_ids"
#: The assistant-message fields whose concatenation is the prefix when the request has none.
PROMPT_IDS_FIELD: Final = "prompt_token_ids"
GENERATION_IDS_FIELD: Final = "generation_token_ids"
#: The log line of a divergent prefix (one place, so tests and operators can grep for it).
DIVERGENT_LOG: Final = "token prefix diverges from the rendered history"


class PrefixOutcome(StrEnum):
    """What became of a prefix (the ``outcome`` label of the token-prefix metrics)."""

    SPLICED = "spliced"  #: the prefix covers the history; it is kept verbatim
    DIVERGENT = "divergent"  #: spliced all the same, but its EOS count does not match the history


class TokenPrefixError(ValueError):
    """A prefix field is malformed, or the conversation has no boundary to splice it at."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class TokenPrefix:
    """The ids a turn's prompt must begin with, and the field they came from."""

    ids: array[int]
    param: str  #: ``required_prefix_token_ids`` or ``messages[i]``
    keep: int  #: how many of ``ids`` are kept: all but a final EOS
    eos_count: int  #: EOS tokens among the kept ids
    #: the first id field's JSON text, when the reader had it (the frontend keeps it: the next
    #: turn's text of that field begins with it, :class:`KnownText`)
    text: KnownText | None = None


@dataclass(frozen=True, slots=True)
class Spliced:
    ids: array[int]
    outcome: PrefixOutcome
    history_eos: int  #: ``k``
    prefix_eos: int  #: EOS tokens among the kept ids of the prefix


def last_assistant_index(messages: Sequence[Mapping[str, Any]]) -> int | None:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant":
            return i
    return None


def history_end(messages: Sequence[Mapping[str, Any]]) -> int:
    """How many leading messages form the history that ``k`` counts the EOS tokens of."""
    a = last_assistant_index(messages)
    return len(messages) if a is None else a + 1


#: Ids past a known head are bounded and counted with builtins (``max``, ``list.count``) up to this
#: many, with numpy beyond: a numpy call costs ~0.1 ms with cold CPU caches whatever the length,
#: which only long lists pay back (bench/tokenization.py, ``prefix_check``).
SMALL_IDS: Final = 2048


@dataclass(frozen=True, slots=True)
class KnownIds:
    """Ids this process has already checked, packed as :func:`token_ids` packs them (little-endian
    uint32), and how many are EOS: a conversation's previous prompt, which the next turn echoes
    back at the head of its prefix."""

    raw: bytes
    eos_count: int


@dataclass(frozen=True, slots=True)
class KnownText:
    """The JSON text of an id array this process has read, without its ``]`` (and the blanks
    before it), with the ids it holds and how many are EOS. The next turn's array of the same
    field begins with this text when the client writes the ids the same way: then only the
    text after it is parsed (``drs_frontend.tokenization.cache``)."""

    head: bytes
    ids: array[int]
    eos_count: int
    reused: int = 0  #: how many of ``ids`` came from the previous turn's text (0: read in full)


#: Reads one id field of the prefix: ``(value, param, first) -> (ids, EOS count, text)``, ``first``
#: for the field the conversation's known ids head (the required prefix, or ``prompt_token_ids``).
#: The caller does not change the ids returned (a reader may keep them).
IdsReader = Callable[[Any, str, bool], "tuple[array[int], int, KnownText | None]"]


def token_ids(
    value: Any, param: str, vocab_size: int, eos_id: int, known: KnownIds | None = None
) -> tuple[array[int], int]:
    """``value`` as int32 ids, each in ``[0, vocab_size)``, and how many are ``eos_id``; a
    TokenPrefixError naming ``param`` else.

    Exact: every id is read, in C. The list is packed as uint32 by a :class:`struct.Struct`
    (which refuses anything but integers in ``[0, 2**32)``; a ``Struct``'s own ``pack`` is ~25%
    cheaper than ``struct.pack(fmt, *value)``). When the packed bytes begin with ``known``'s
    (compared byte for byte), those ids are not bounded or counted again: only the ids after them
    are. Reading each Python int once is the floor of any exact check, so ``known`` saves the
    bounding and counting (numpy's per-call cost, mostly), not the per-id packing."""
    if not isinstance(value, list):
        raise TokenPrefixError(f"{param}: must be a list of token ids", param)
    try:
        raw = struct.Struct(f"<{len(value)}I").pack(*value)
    except struct.error:
        raise TokenPrefixError(
            f"{param}: every element must be a token id, an integer in [0, {vocab_size})", param
        ) from None
    start, eos_count = 0, 0
    if known is not None and known.raw and raw.startswith(known.raw):
        start, eos_count = len(known.raw) // 4, known.eos_count
    eos_count += _bound_and_count(value, raw, start, param, vocab_size, eos_id)
    ids = array("i")
    ids.frombytes(raw)
    if sys.byteorder != "little":  # pragma: no cover - every platform this runs on is little-endian
        ids.byteswap()
    return ids, eos_count


def _bound_and_count(value: list[Any], raw: bytes, start: int, param: str, vocab_size: int, eos_id: int) -> int:
    """Check ``value[start:]`` (already packed into ``raw``: integers in ``[0, 2**32)``) against the
    vocabulary; return how many of them are ``eos_id``."""
    if start == len(value):
        return 0
    bad: int | None = None
    if len(value) - start <= SMALL_IDS:
        rest = value[start:] if start else value
        if max(rest) >= vocab_size:
            bad = next(int(t) for t in rest if t >= vocab_size)
        count = rest.count(eos_id) if eos_id >= 0 else 0
    else:
        packed = numpy.frombuffer(raw, dtype="<u4", offset=4 * start)
        if int(packed.max()) >= vocab_size:
            bad = int(packed[int(numpy.argmax(packed >= vocab_size))])
        count = int(numpy.count_nonzero(packed == eos_id)) if eos_id >= 0 else 0
    if bad is not None:
        raise TokenPrefixError(f"{param}: token id {bad} is outside the vocabulary [0, {vocab_size})", param)
    return count


def find_prefix(
    required: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    vocab_size: int,
    eos_id: int,
    known: KnownIds | None = None,
    read: IdsReader | None = None,
) -> TokenPrefix | None:
    """The prefix of a chat request: ``required`` (the request's ``required_prefix_token_ids``)
    when not None, else the last assistant message's prompt + generation ids; None when there
    is none or it is empty (NeMo RL splices nothing then either). ``known``: the conversation's
    previous prompt ids, which the prefix (or the message's ``prompt_token_ids``) should begin
    with (:func:`token_ids`); the result is the same with or without it. ``read`` reads each
    field (:data:`IdsReader`; the frontend's reads fields it left as JSON text)."""
    if read is None:

        def read(value: Any, param: str, first: bool) -> tuple[array[int], int, KnownText | None]:
            return (*token_ids(value, param, vocab_size, eos_id, known if first else None), None)

    if required is not None:
        ids, eos_count, text = read(required, PREFIX_FIELD, True)
        param = PREFIX_FIELD
    else:
        a = last_assistant_index(messages)
        if a is None:
            return None
        message = messages[a]
        if PROMPT_IDS_FIELD not in message and GENERATION_IDS_FIELD not in message:
            return None
        param = f"messages[{a}]"
        for name in (PROMPT_IDS_FIELD, GENERATION_IDS_FIELD):
            if name not in message:
                raise TokenPrefixError(
                    f"{param}.{name}: required when the message carries "
                    f"{GENERATION_IDS_FIELD if name == PROMPT_IDS_FIELD else PROMPT_IDS_FIELD}",
                    f"{param}.{name}",
                )
        ids, eos_count, text = read(message[PROMPT_IDS_FIELD], f"{param}.{PROMPT_IDS_FIELD}", True)
        generated, generated_eos, _ = read(message[GENERATION_IDS_FIELD], f"{param}.{GENERATION_IDS_FIELD}", False)
        ids = ids + generated  # a new array: the reader may keep the one it returned
        eos_count += generated_eos
    if not ids:
        return None
    keep = len(ids) - 1 if ids[-1] == eos_id else len(ids)
    return TokenPrefix(ids, param, keep, eos_count - (len(ids) - keep), text)


def splice(prefix: TokenPrefix, template_ids: array[int], eos_positions: Sequence[int], history_eos: int) -> Spliced:
    """``prefix`` (all but a final EOS) + ``template_ids`` from its ``history_eos``-th EOS token on.

    ``eos_positions`` are the indices of the EOS tokens in ``template_ids``, ascending."""
    if history_eos < 1 or history_eos > len(eos_positions):
        raise TokenPrefixError(
            f"{prefix.param}: cannot splice the token prefix: the history renders {history_eos} end-of-turn "
            f"tokens, the whole conversation {len(eos_positions)}",
            prefix.param,
        )
    return join(prefix, template_ids[eos_positions[history_eos - 1] :], history_eos)


def join(prefix: TokenPrefix, tail: array[int], history_eos: int) -> Spliced:
    """``prefix`` (all but a final EOS) + ``tail``, the template ids from the ``history_eos``-th
    EOS token on (so ``tail[0]`` is that EOS)."""
    ids = prefix.ids[: prefix.keep]
    ids.extend(tail)
    outcome = PrefixOutcome.SPLICED if prefix.eos_count == history_eos - 1 else PrefixOutcome.DIVERGENT
    return Spliced(ids, outcome, history_eos, prefix.eos_count)


def eos_positions(ids: Sequence[int], eos_id: int) -> list[int]:
    return [i for i, t in enumerate(ids) if t == eos_id]


def render_spliced_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    prefix: TokenPrefix,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> Spliced:
    """The reference path: render and tokenize the whole request and its history, then splice."""
    eos_id = require_eos(tokenizer, prefix.param)
    template = render_prompt_ids(
        tokenizer,
        messages,
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
        add_generation_prompt=add_generation_prompt,
    )
    history = render_prompt_ids(
        tokenizer,
        messages[: history_end(messages)],
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
        add_generation_prompt=False,
    )
    return splice(prefix, array("i", template), eos_positions(template, eos_id), history.count(eos_id))


def require_eos(tokenizer: PreTrainedTokenizerBase, param: str) -> int:
    eos_id = tokenizer.eos_token_id
    if not isinstance(eos_id, int):
        raise TokenPrefixError(f"{param}: this tokenizer has no EOS token to splice a token prefix at", param)
    return eos_id
