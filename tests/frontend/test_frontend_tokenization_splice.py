"""The frontend's incremental tokenizer with a token prefix: the spliced ids equal the reference
path's (:func:`drs_protocol.token_prefix.render_spliced_ids`, a full render of the request and of
its history) turn after turn, with the real Qwen3 tokenizer and chat template."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from drs_frontend.tokenization import ChatTokenizer, Path
from drs_frontend.tokenization.probes import probe_history_eos
from drs_protocol.chat import decode_token_ids
from drs_protocol.token_prefix import PrefixOutcome, TokenPrefixError, render_spliced_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=30) | st.sampled_from(
    ["<think>\nx\n</think>\n\n", " spaced  ", "数学 😀", "<tool_call>\n{}\n</tool_call>"]
)
REPLY = st.sampled_from(["plain", "reasoning", "inline_think", "tool_call"])


def gym_reply(style: str, text: str, ids: list[int], generated: list[int], tokenizer: Any) -> list[dict[str, Any]]:
    content = decode_token_ids(tokenizer, generated)
    echo = {"prompt_token_ids": ids, "generation_token_ids": generated}
    if style == "reasoning":
        return [{"role": "assistant", "content": text, "reasoning_content": content, **echo}]
    if style == "inline_think":
        return [{"role": "assistant", "content": f"<think>\n{content}\n</think>\n\n{text}", **echo}]
    if style == "tool_call":
        call = {"type": "function", "function": {"name": "f", "arguments": json.dumps({"q": content[:20]})}}
        return [
            {"role": "assistant", "content": content, "tool_calls": [call], **echo},
            {"role": "tool", "content": text},
        ]
    return [{"role": "assistant", "content": content, **echo}]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    turns=st.lists(st.tuples(REPLY, TEXT, st.integers(0, 2**32 - 1), st.booleans()), min_size=1, max_size=12),
    system=st.booleans(),
    thinking=st.sampled_from([None, {"enable_thinking": False}]),
)
def test_incremental_spliced_ids_equal_the_reference_and_extend_the_last_turn(
    chat: ChatTokenizer, tokenizer: Any, turns: list[tuple[str, str, int, bool]], system: bool, thinking: Any
) -> None:
    cid = f"splice-{random.random()}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": "sys"}] if system else []
    messages.append({"role": "user", "content": "go"})
    previous: list[int] | None = None
    for style, text, seed, ends_with_eos in turns:
        prefix = chat.find_prefix(None, messages, cid)
        assert prefix == chat.find_prefix(None, messages)  # the cached turn changes nothing but the cost
        got = chat.prompt_ids(cid, messages, chat_template_kwargs=thinking, prefix=prefix)
        ids = got.ids.tolist()
        known = chat._entries[cid].known
        assert known is not None and known.raw == got.ids.tobytes()
        assert known.eos_count == ids.count(tokenizer.eos_token_id)
        if prefix is not None:
            want = render_spliced_ids(tokenizer, messages, prefix, chat_template_kwargs=thinking)
            assert ids == want.ids.tolist()
            assert got.spliced is not None and got.spliced.outcome is PrefixOutcome.SPLICED
        if previous is not None:
            assert ids[: len(previous)] == previous
        rng = random.Random(seed)
        generated = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 12))]
        generated = [t for t in generated if t != tokenizer.eos_token_id] or [0]
        if ends_with_eos:
            generated.append(tokenizer.eos_token_id)
        previous = ids + generated
        messages = messages + gym_reply(style, text, ids, generated, tokenizer)
        if messages[-1]["role"] == "assistant":
            messages.append({"role": "user", "content": text or "next"})
    chat.forget(cid)


def test_the_splice_point_comes_from_the_cache_in_a_gym_conversation(chat: ChatTokenizer, tokenizer: Any) -> None:
    assert chat.history_eos_cached  # Qwen3's template passed the probe
    messages: list[dict[str, Any]] = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]
    first = chat.prompt_ids("cached-k", messages)
    generated = [9707, tokenizer.eos_token_id]
    messages += [
        {
            "role": "assistant",
            "content": "Hello",
            "prompt_token_ids": first.ids.tolist(),
            "generation_token_ids": generated,
        },
        {"role": "user", "content": "b"},
    ]
    prefix = chat.find_prefix(None, messages)
    calls: list[int] = []
    original = chat._history_eos

    def counted(messages: Any, tools: Any, kwargs: Any) -> int:
        calls.append(1)
        return original(messages, tools, kwargs)

    chat._history_eos = counted  # type: ignore[method-assign]
    try:
        second = chat.prompt_ids("cached-k", messages, prefix=prefix, shadow=True)
    finally:
        del chat._history_eos
    assert calls == []  # k came from the cached turn, no history render
    assert second.path is Path.INCREMENTAL and second.shadowed
    assert second.ids.tolist()[: len(first.ids) + 2] == first.ids.tolist() + generated
    # only the tail from the reply's end-of-turn token on was tokenized: the reply is the policy's
    assert second.new_ids == len(second.ids) - len(first.ids) - len(generated) + 1


def test_a_template_without_one_eos_per_reply_fails_the_probe_and_renders_the_history(tokenizer: Any) -> None:
    from drs_protocol.chat import default_tokenizer_dir
    from transformers import AutoTokenizer

    odd = AutoTokenizer.from_pretrained(str(default_tokenizer_dir()), local_files_only=True)
    # an assistant turn closes with two end-of-turn tokens: the history count is not "one more"
    odd.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>"
        "{% if m.role == 'assistant' %}<|im_end|>{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert not probe_history_eos(odd)
    chat = ChatTokenizer(odd)
    assert not chat.history_eos_cached
    messages: list[dict[str, Any]] = [{"role": "user", "content": "a"}]
    first = chat.prompt_ids("odd", messages).ids.tolist()
    messages += [
        {"role": "assistant", "content": "b", "prompt_token_ids": first, "generation_token_ids": [65]},
        {"role": "user", "content": "c"},
    ]
    prefix = chat.find_prefix(None, messages)
    assert prefix is not None
    got = chat.prompt_ids("odd", messages, prefix=prefix)
    assert got.ids.tolist() == render_spliced_ids(odd, messages, prefix).ids.tolist()


def test_a_malformed_prefix_is_refused_before_any_rendering(chat: ChatTokenizer) -> None:
    with pytest.raises(TokenPrefixError) as caught:
        chat.find_prefix([0, chat.vocab_size], [{"role": "user", "content": "a"}])
    assert caught.value.param == "required_prefix_token_ids"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    turns=st.integers(1, 6),
    field=st.sampled_from(["prompt_token_ids", "generation_token_ids"]),
    data=st.data(),
)
def test_a_prefix_changed_anywhere_is_used_as_sent_not_as_cached(
    chat: ChatTokenizer, tokenizer: Any, turns: int, field: str, data: Any
) -> None:
    """The conversation's cache holds the ids of the turn before; the client echoes them back with
    one id changed (anywhere): the turn begins with the ids as sent, exactly as the reference path."""
    cid = f"changed-{random.random()}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"}]
    for turn in range(turns + 1):
        prefix = chat.find_prefix(None, messages, cid)
        ids = chat.prompt_ids(cid, messages, prefix=prefix).ids.tolist()
        generated = [9707 + turn, 11, tokenizer.eos_token_id]
        reply = {"role": "assistant", "content": "Hello", "prompt_token_ids": ids, "generation_token_ids": generated}
        messages = [*messages, reply, {"role": "user", "content": f"turn {turn}"}]
    echoed = list(messages[-2][field])
    at = data.draw(st.integers(0, len(echoed) - 2), label="position")  # the final EOS stays
    echoed[at] = data.draw(st.integers(0, len(tokenizer) - 1).filter(lambda t: t != echoed[at]), label="id")
    messages[-2] = {**messages[-2], field: echoed}
    prefix = chat.find_prefix(None, messages, cid)  # the cache holds the ids as they were
    assert prefix is not None and prefix == chat.find_prefix(None, messages)
    got = chat.prompt_ids(cid, messages, prefix=prefix).ids.tolist()
    sent = messages[-2]["prompt_token_ids"] + messages[-2]["generation_token_ids"]
    assert got[: len(sent) - 1] == sent[:-1]
    assert got == render_spliced_ids(tokenizer, messages, prefix).ids.tolist()
    chat.forget(cid)
