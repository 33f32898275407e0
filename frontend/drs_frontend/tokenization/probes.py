"""The load-time probes: does this chat template obey the rules the incremental path relies on?

:class:`~drs_frontend.tokenization.cache.ChatTokenizer` runs both when it is made (this module
never imports it: the window probe renders with a scratch instance it is given), on
conversations that exercise what ChatML-family templates special-case, and falls back to the
full path for a template that fails one (logged once).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from drs_protocol.chat import ChatTemplateError, render_prompt_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# -- the window probe ----------------------------------------------------------------------------

ProbeConversation = list[dict[str, Any]]


class _Ids(Protocol):
    @property
    def ids(self) -> array[int]: ...


class WindowedChat(Protocol):
    """What the window probe renders with: a windowed ``ChatTokenizer`` of its own (a scratch one,
    whose cache carries the probe's turns)."""

    def forget(self, conversation_id: str) -> None: ...

    def prompt_ids(
        self,
        conversation_id: str | None,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> _Ids: ...


def probe_conversations() -> list[tuple[ProbeConversation, list[dict[str, Any]] | None]]:
    """Conversations that exercise what ChatML-family templates special-case: system prompts,
    tools, reasoning, tool calls and grouped tool results, several queries, a lone user turn."""
    tool = {"type": "function", "function": {"name": "lookup", "description": "d", "parameters": {"type": "object"}}}
    call = [{"type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}]
    convs: list[tuple[ProbeConversation, list[dict[str, Any]] | None]] = []
    for system in (True, False):
        for tools in (None, [tool]):
            msgs: ProbeConversation = [{"role": "system", "content": "You are terse."}] if system else []
            msgs.append({"role": "user", "content": "First question?"})
            msgs.append({"role": "assistant", "content": "Answer one.", "reasoning_content": "think one"})
            msgs.append({"role": "user", "content": "Use the tool."})
            msgs.append({"role": "assistant", "content": "", "reasoning_content": "plan", "tool_calls": call})
            msgs.append({"role": "tool", "content": "result a"})
            msgs.append({"role": "tool", "content": "result b"})
            msgs.append({"role": "assistant", "content": "<think>\nmore\n</think>\n\nCalling.", "tool_calls": call})
            msgs.append({"role": "tool", "content": "result c"})
            msgs.append({"role": "assistant", "content": "Done.", "reasoning_content": "wrap up"})
            msgs.append({"role": "user", "content": "<tool_response>\nwrapped\n</tool_response>"})
            msgs.append({"role": "assistant", "content": "Noted."})
            msgs.append({"role": "user", "content": "Last one."})
            convs.append((msgs, tools))
    return convs


def _passes(probe: str, otherwise: str, check: Callable[[], bool]) -> bool:
    """Run one probe; a failure (or a template error) is logged once, saying what is done instead."""
    try:
        if check():
            return True
        log.warning("chat template failed the %s probe; %s", probe, otherwise)
    except ChatTemplateError as exc:
        log.warning("chat template failed the %s probe (%s); %s", probe, exc, otherwise)
    return False


def probe_windowing(
    tokenizer: PreTrainedTokenizerBase,
    scratch: WindowedChat,
    kwargs_variants: Sequence[Mapping[str, Any] | None] = (None, {"enable_thinking": False}),
) -> bool:
    """Does windowed rendering (``scratch``) reproduce full rendering for this template? Every prefix
    of every probe conversation is rendered both ways (``scratch``'s cache carries the turns)."""

    def check() -> bool:
        for kwargs in kwargs_variants:
            for n, (conversation, tools) in enumerate(probe_conversations()):
                cid = f"probe-{n}"
                scratch.forget(cid)
                for end in range(1, len(conversation) + 1):
                    prefix = conversation[:end]
                    for agp in (True, False):
                        got = scratch.prompt_ids(
                            cid, prefix, tools=tools, chat_template_kwargs=kwargs, add_generation_prompt=agp
                        )
                        want = render_prompt_ids(
                            tokenizer, prefix, tools=tools, chat_template_kwargs=kwargs, add_generation_prompt=agp
                        )
                        if got.ids.tolist() != want:
                            return False
        return True

    return _passes("window", "rendering whole conversations", check)


def probe_history_eos(
    tokenizer: PreTrainedTokenizerBase,
    kwargs_variants: Sequence[Mapping[str, Any] | None] = (None, {"enable_thinking": False}),
) -> bool:
    """Does the history through an assistant reply hold one EOS token more than the request
    before it (rendered with the generation prompt)? Then a cached turn gives the splice point
    ``k`` without rendering the history again. Checked on every reply of the probe conversations."""
    eos_id = tokenizer.eos_token_id
    if not isinstance(eos_id, int):
        return False

    def eos_count(messages: ProbeConversation, tools: Any, kwargs: Any, agp: bool) -> int:
        ids = render_prompt_ids(
            tokenizer, messages, tools=tools, chat_template_kwargs=kwargs, add_generation_prompt=agp
        )
        return ids.count(eos_id)

    def check() -> bool:
        for kwargs in kwargs_variants:
            for conversation, tools in probe_conversations():
                for a, message in enumerate(conversation):
                    if message["role"] != "assistant" or a == 0:
                        continue
                    before = eos_count(conversation[:a], tools, kwargs, True)
                    if eos_count(conversation[: a + 1], tools, kwargs, False) != before + 1:
                        return False
        return True

    return _passes("history", "rendering the history to splice at", check)
