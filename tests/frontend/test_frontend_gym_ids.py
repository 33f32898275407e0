"""Gym's id arrays left unparsed (``drs_frontend.gym_ids``) and read from their text
(``drs_frontend.tokenization.read_ids``): the same bodies and the same token prefixes as parsing
everything, for every way a client may write the JSON, and a full parse wherever a rule is bent."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from drs_frontend import wire_json
from drs_frontend.gym_ids import RawIds, loads_chat, materialize, skipped
from drs_frontend.tokenization import ChatTokenizer
from drs_protocol.token_prefix import TokenPrefix, TokenPrefixError, find_prefix
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# -- how clients write JSON ----------------------------------------------------------------------

WRITERS: dict[str, Callable[[Any], bytes]] = {
    "json.dumps": lambda v: json.dumps(v).encode(),  # Python's default: ", " and ": ", ASCII escapes
    "compact": lambda v: json.dumps(v, separators=(",", ":"), ensure_ascii=False).encode(),  # httpx
    "indented": lambda v: json.dumps(v, indent=2).encode(),
    "orjson": orjson.dumps,
}

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=20) | st.sampled_from(
    ['"prompt_token_ids": [1, 2]', "]", '\\"generation_token_ids\\": [', "[[", "数学 😀", "\\u005f"]
)
IDS = st.lists(st.integers(0, 200_000), max_size=30)
LOG_PROBS = st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), max_size=10)


@st.composite
def gym_body(draw: st.DrawFn) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": draw(TEXT)}]
    for _ in range(draw(st.integers(0, 4))):
        messages.append({"role": "user", "content": draw(TEXT)})
        reply: dict[str, Any] = {"role": "assistant", "content": draw(TEXT)}
        if draw(st.booleans()):
            reply |= {"prompt_token_ids": draw(IDS), "generation_token_ids": draw(IDS)}
            if draw(st.booleans()):
                reply["generation_log_probs"] = draw(LOG_PROBS)
        if draw(st.booleans()):
            reply["tool_calls"] = [{"type": "function", "function": {"name": "f", "arguments": draw(TEXT)}}]
        messages.append(reply)
    messages.append({"role": "user", "content": draw(TEXT)})
    body: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": draw(st.integers(1, 9))}
    if draw(st.booleans()):
        body["required_prefix_token_ids"] = draw(IDS)
    return body


def same_as_full_parse(raw: bytes) -> Any:
    """``loads_chat(raw)``, checked to be ``wire_json.loads(raw)`` once its RawIds are parsed."""
    got = loads_chat(raw)
    assert materialize(got) == wire_json.loads(raw)
    return got


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=gym_body(), writer=st.sampled_from(sorted(WRITERS)))
def test_a_gym_body_parses_the_same_with_its_arrays_left_as_text(body: dict[str, Any], writer: str) -> None:
    raw = WRITERS[writer](body)
    got = same_as_full_parse(raw)
    has_arrays = "required_prefix_token_ids" in body or any("prompt_token_ids" in m for m in body["messages"])
    # every Gym array is left as text, unless the body holds what could be an escaped letter (a
    # literal backslash before "u005", say), when it is parsed in full
    escapes = any(escape in raw for escape in (b"\\u005", b"\\u006", b"\\u007"))
    assert skipped(got) == (has_arrays and not escapes)
    for message in got["messages"] if skipped(got) else ():
        for name in ("prompt_token_ids", "generation_token_ids", "generation_log_probs"):
            if name in message:
                assert isinstance(message[name], RawIds)


# A rule bent: each of these is parsed in full (and equal to the full parse).
BENT = {
    "a Gym field nested in a tool schema": {
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"function": {"parameters": {"prompt_token_ids": [1, 2]}}}],
    },
    "a Gym field at the top level of a chat body": {
        "messages": [{"role": "user", "content": "x"}],
        "prompt_token_ids": [1, 2],
    },
    "an id array holding a string": {
        "messages": [{"role": "assistant", "content": "x", "prompt_token_ids": ["a]", 1], "generation_token_ids": [2]}],
    },
    "an id array of arrays": {
        "messages": [
            {"role": "assistant", "content": "x", "prompt_token_ids": [[1], [2]], "generation_token_ids": [2]}
        ],
    },
    "a null id field": {
        "messages": [{"role": "assistant", "content": "x", "prompt_token_ids": None, "generation_token_ids": [2]}],
    },
    "a Gym field inside a content part": {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "generation_token_ids": [5]}]}],
    },
}


@pytest.mark.parametrize("case", sorted(BENT))
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_body_that_bends_a_rule_is_parsed_in_full(case: str, writer: str) -> None:
    got = same_as_full_parse(WRITERS[writer](BENT[case]))
    assert not skipped(got)


def test_duplicate_keys_keep_the_last_value_as_a_full_parse_does() -> None:
    raw = b'{"messages":[{"role":"assistant","content":"x","prompt_token_ids":[1],"prompt_token_ids":[2],"generation_token_ids":[3]}]}'
    got = same_as_full_parse(raw)
    assert got["messages"][0]["prompt_token_ids"] == [2]
    assert not skipped(got)


def test_a_key_spelled_with_an_escape_is_the_same_key() -> None:
    raw = b'{"messages":[{"role":"assistant","content":"x","prompt\\u005ftoken_ids":[7],"generation_token_ids":[3]}]}'
    got = same_as_full_parse(raw)
    assert got["messages"][0]["prompt_token_ids"] == [7]


def test_a_key_ending_in_a_gym_name_inside_a_longer_key_is_left_alone() -> None:
    raw = b'{"messages":[{"role":"user","content":"x","a \\"prompt_token_ids":[7]}]}'
    got = same_as_full_parse(raw)
    assert got["messages"][0]['a "prompt_token_ids'] == [7]


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages":[{"role":"assistant","prompt_token_ids":[1,2}]}',  # the array never closes
        b'{"messages":[{"role":"assistant","prompt_token_ids":[1,2]]}',  # one ] too many
        b'{"messages":[{"role":"assistant","prompt_token_ids":[1,2]}',  # truncated
        b'{"messages":[{"role":"assistant","prompt_token_ids":[1,2]}]} x',
    ],
)
def test_invalid_json_raises_as_the_full_parse_does(raw: bytes) -> None:
    with pytest.raises(ValueError) as full:
        wire_json.loads(raw)
    with pytest.raises(ValueError) as cut:
        loads_chat(raw)
    assert str(cut.value) == str(full.value)


# -- the token prefix read from the text ---------------------------------------------------------


def conversation(tokenizer: Any, turns: int, seed: int) -> list[list[dict[str, Any]]]:
    """The requests of one Gym-shaped conversation, each assistant message echoing its ids."""
    rng = random.Random(seed)
    chat = ChatTokenizer(tokenizer)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "sys"}]
    requests = []
    for turn in range(turns):
        messages = [*messages, {"role": "user", "content": f"question {turn} " + "word " * rng.randrange(5, 40)}]
        requests.append(messages)
        prompt = chat.prompt_ids("c", messages, prefix=chat.find_prefix(None, messages, "c")).ids.tolist()
        generated = [rng.randrange(0, 151_000) for _ in range(rng.randrange(1, 30))] + [tokenizer.eos_token_id]
        reply = {
            "role": "assistant",
            "content": "answer",
            "prompt_token_ids": prompt,
            "generation_token_ids": generated,
        }
        messages = [*messages, reply]
    return requests


def reference(chat: ChatTokenizer, messages: list[dict[str, Any]], required: Any) -> TokenPrefix | None:
    eos = chat.eos_id if chat.eos_id is not None else -1
    return find_prefix(required, messages, vocab_size=chat.vocab_size, eos_id=eos)


def same_prefix(got: TokenPrefix | None, want: TokenPrefix | None) -> None:
    assert (got is None) == (want is None)
    if got is not None and want is not None:
        assert (got.ids.tolist(), got.param, got.keep, got.eos_count) == (
            want.ids.tolist(),
            want.param,
            want.keep,
            want.eos_count,
        )


class ParseSpy:
    """Records the length of every id text :class:`RawIds` parses."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lengths: list[int] = []
        parse = RawIds.parse

        def spy(raw_ids: RawIds) -> Any:
            self.lengths.append(raw_ids.end - raw_ids.start)
            return parse(raw_ids)

        monkeypatch.setattr(RawIds, "parse", spy)


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("required", [False, True], ids=["message ids", "required prefix"])
def test_the_prefix_read_from_text_equals_the_parsed_one_and_parses_only_what_is_new(
    tokenizer: Any, writer: str, required: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    chat = ChatTokenizer(tokenizer)
    spy = ParseSpy(monkeypatch)
    for n, messages in enumerate(conversation(tokenizer, 8, seed=len(writer))):
        body: dict[str, Any] = {"messages": messages}
        if required and n > 0:
            last = messages[-2]
            body["required_prefix_token_ids"] = last["prompt_token_ids"] + last["generation_token_ids"]
        raw = WRITERS[writer](body)
        parsed = loads_chat(raw)
        spy.lengths.clear()
        got = chat.find_prefix(parsed.get("required_prefix_token_ids"), parsed["messages"], "c")
        same_prefix(got, reference(chat, messages, body.get("required_prefix_token_ids")))
        chat.prompt_ids("c", parsed["messages"], prefix=got)
        first = (
            parsed["required_prefix_token_ids"]
            if required and n > 0
            else parsed["messages"][-2].get("prompt_token_ids")
        )
        if n >= 2:  # last turn's text of this field heads this one's: only the text after it is parsed
            assert isinstance(first, RawIds)
            assert first.end - first.start not in spy.lengths, spy.lengths


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_changed_id_in_the_echoed_text_is_read_as_sent(tokenizer: Any, writer: str) -> None:
    chat = ChatTokenizer(tokenizer)
    requests = conversation(tokenizer, 5, seed=3)
    for messages in requests[:4]:
        parsed = loads_chat(WRITERS[writer]({"messages": messages}))
        chat.prompt_ids("c", parsed["messages"], prefix=chat.find_prefix(None, parsed["messages"], "c"))
    messages = [dict(m) for m in requests[4]]
    echoed = dict(messages[-2])
    echoed["prompt_token_ids"] = [*echoed["prompt_token_ids"]]
    echoed["prompt_token_ids"][3] += 1  # a client that changed an early id: the head text differs
    messages[-2] = echoed
    parsed = loads_chat(WRITERS[writer]({"messages": messages}))
    got = chat.find_prefix(None, parsed["messages"], "c")
    same_prefix(got, reference(chat, messages, None))
    assert got is not None and got.ids[3] == echoed["prompt_token_ids"][3]


def test_the_client_changing_how_it_writes_ids_mid_conversation_is_read_right(tokenizer: Any) -> None:
    chat = ChatTokenizer(tokenizer)
    writers = ["compact", "json.dumps", "indented", "orjson", "json.dumps", "json.dumps"]
    for messages, writer in zip(conversation(tokenizer, 6, seed=5), writers, strict=True):
        parsed = loads_chat(WRITERS[writer]({"messages": messages}))
        got = chat.find_prefix(None, parsed["messages"], "c")
        same_prefix(got, reference(chat, messages, None))
        chat.prompt_ids("c", parsed["messages"], prefix=got)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (b"[1, 2, x]", "must be a list of token ids"),
        (b"[1, 2, 999999999]", "outside the vocabulary"),
        (b"[1, 2.5]", "every element must be a token id"),
    ],
)
def test_a_malformed_id_text_is_a_400_naming_the_field(tokenizer: Any, text: bytes, error: str) -> None:
    chat = ChatTokenizer(tokenizer)
    raw = (
        b'{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a","prompt_token_ids":'
        + text
        + b',"generation_token_ids":[1]},{"role":"user","content":"r"}]}'
    )
    messages = loads_chat(raw)["messages"]
    with pytest.raises(TokenPrefixError, match=error) as exc:
        chat.find_prefix(None, messages, "c")
    assert exc.value.param == "messages[1].prompt_token_ids"
