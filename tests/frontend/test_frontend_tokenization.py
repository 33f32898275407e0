"""Frontend tokenization: the incremental path gives exactly the ids of a full render + tokenize.

Every comparison is against :func:`drs_protocol.chat.render_prompt_ids` on the client's raw
messages, the function the engine itself runs, with the real Qwen3 tokenizer and chat template.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Iterator
from typing import Any

import pytest
from drs_frontend.gym_ids import RawIds
from drs_frontend.tokenization import ChatTokenizer, Path
from drs_frontend.tokenization.splice import SpliceTokenizer, common_prefix_length, splice_safe
from drs_frontend.tokenization.window import cached_form, kept_messages, message_view, same_message
from drs_protocol.chat import default_tokenizer_dir, render_prompt_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        },
    }
]
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "—",
    "naïve",
    "café",
    "数学",
    "😀",
    "\t",
    "tabs",
    "",
    "spaces\n\nnewlines",
]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def grow(rng: random.Random, turns: int, *, system: bool, style: str) -> Iterator[list[dict[str, Any]]]:
    """Requests of one conversation, turn by turn, as a client (NeMo-Gym) would send them."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful agent."}] if system else []
    for turn in range(turns):
        if style == "agent" and turn % 3:
            messages.append({"role": "tool", "content": words(rng, 12)})
            if rng.random() < 0.3:
                messages.append({"role": "tool", "content": words(rng, 5)})
        else:
            messages.append({"role": "user", "content": words(rng, rng.randint(1, 40))})
        yield messages
        reply: dict[str, Any] = {"role": "assistant", "content": words(rng, rng.randint(0, 60))}
        if style in ("reasoning", "agent") and rng.random() < 0.7:
            reply["reasoning_content"] = words(rng, 20)
        if style == "think_in_content":
            reply["content"] = f"<think>\n{words(rng, 10)}\n</think>\n\n{reply['content']}"
        if style == "agent" and rng.random() < 0.8:
            reply["tool_calls"] = [
                {"type": "function", "function": {"name": "search", "arguments": {"q": words(rng, 3)}}}
            ]
        reply["prompt_token_ids"] = list(range(turn * 5))  # Gym's annotations ride along
        reply["generation_token_ids"] = [1, 2, 3]
        messages = [*messages, reply]


CORPUS = [
    pytest.param(1, True, "chat", None, id="one turn with a system prompt"),
    pytest.param(100, True, "chat", None, id="a hundred plain chat turns"),
    pytest.param(30, False, "chat", None, id="thirty turns without a system prompt"),
    pytest.param(40, True, "reasoning", None, id="reasoning content that earlier turns drop"),
    pytest.param(25, True, "think_in_content", None, id="think tags inside assistant content"),
    pytest.param(60, True, "agent", TOOLS, id="an agent with tools, tool calls and grouped tool results"),
    pytest.param(20, False, "agent", TOOLS, id="an agent with tools and no system prompt"),
    pytest.param(15, True, "reasoning", {"enable_thinking": False}, id="thinking disabled in the template kwargs"),
]


@pytest.mark.parametrize(("turns", "system", "style", "extra"), CORPUS)
def test_incremental_ids_equal_full_tokenization_turn_by_turn(
    chat: ChatTokenizer, tokenizer: Any, turns: int, system: bool, style: str, extra: Any
) -> None:
    tools = extra if isinstance(extra, list) else None
    kwargs = extra if isinstance(extra, dict) else None
    rng = random.Random(f"{turns}-{style}-{system}")
    cid = f"corpus-{turns}-{system}-{style}-{bool(extra)}"
    paths = []
    for messages in grow(rng, turns, system=system, style=style):
        got = chat.prompt_ids(cid, messages, tools=tools, chat_template_kwargs=kwargs)
        assert got.ids.tolist() == render_prompt_ids(tokenizer, messages, tools=tools, chat_template_kwargs=kwargs)
        paths.append(got.path)
    assert paths[0] is Path.FULL
    if turns > 1:
        assert paths[1:].count(Path.INCREMENTAL) >= len(paths[1:]) * 0.9


def test_a_rewritten_history_is_still_tokenized_exactly(chat: ChatTokenizer, tokenizer: Any) -> None:
    rng = random.Random(7)
    requests = list(grow(rng, 8, system=True, style="chat"))
    for messages in requests[:6]:
        chat.prompt_ids("rewritten", messages)
    edited = [dict(m) for m in requests[7]]
    edited[3]["content"] = "an earlier message the client changed"
    got = chat.prompt_ids("rewritten", edited)
    assert got.ids.tolist() == render_prompt_ids(tokenizer, edited)


def test_a_new_query_after_tool_rounds_rerenders_the_changed_reasoning(chat: ChatTokenizer, tokenizer: Any) -> None:
    call = [{"type": "function", "function": {"name": "search", "arguments": {"q": "x"}}}]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "find it"},
        {"role": "assistant", "content": "", "reasoning_content": "I should search", "tool_calls": call},
        {"role": "tool", "content": "found"},
    ]
    first = chat.prompt_ids("think-drop", messages, tools=TOOLS)
    assert "I should search" in tokenizer.decode(first.ids.tolist())
    messages = [
        *messages,
        {"role": "assistant", "content": "done", "reasoning_content": "ok"},
        {"role": "user", "content": "next"},
    ]
    second = chat.prompt_ids("think-drop", messages, tools=TOOLS)
    assert second.ids.tolist() == render_prompt_ids(tokenizer, messages, tools=TOOLS)
    assert "I should search" not in tokenizer.decode(second.ids.tolist())
    assert second.path is Path.INCREMENTAL


def test_switching_the_generation_prompt_off_and_on_stays_exact(chat: ChatTokenizer, tokenizer: Any) -> None:
    rng = random.Random(3)
    for i, messages in enumerate(grow(rng, 6, system=True, style="reasoning")):
        agp = i % 2 == 0
        got = chat.prompt_ids("agp", messages, add_generation_prompt=agp)
        assert got.ids.tolist() == render_prompt_ids(tokenizer, messages, add_generation_prompt=agp)


EDGE_PIECES = ["<|im_end|>", "<|im_start|>", "<think>", "</think>", "<tool_call>", " ", "\n", "\r\n", "\t"]
EDGE_PIECES += ["\u0338", "\u00a0", "\u200b", "\u3000", "'s", "<", ">", "e\u0301", "\ufeff", "  \n\n  "]
EDGE_TEXT = st.lists(
    st.one_of(st.characters(exclude_categories=["Cs"]), st.sampled_from(EDGE_PIECES)), max_size=30
).map("".join)


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(EDGE_TEXT)})
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["user", "tool", "tool_response_user"]))
        if kind == "tool" and messages and messages[-1]["role"] == "assistant":
            messages.append({"role": "tool", "content": draw(EDGE_TEXT)})
        elif kind == "tool_response_user":
            messages.append({"role": "user", "content": f"<tool_response>{draw(EDGE_TEXT)}</tool_response>"})
        else:
            messages.append({"role": "user", "content": draw(EDGE_TEXT)})
        reply: dict[str, Any] = {"role": "assistant", "content": draw(EDGE_TEXT)}
        if draw(st.booleans()):
            reply["reasoning_content"] = draw(EDGE_TEXT)
        messages.append(reply)
    return messages


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(conversation=conversations(), agp=st.booleans())
def test_hypothesis_conversations_with_unicode_and_whitespace_edges_tokenize_exactly(
    chat: ChatTokenizer, tokenizer: Any, conversation: list[dict[str, Any]], agp: bool
) -> None:
    chat.forget("hyp")
    for end in range(1, len(conversation) + 1):
        prefix = conversation[:end]
        if prefix[-1]["role"] == "assistant":
            continue  # clients send a turn that ends with the user's or the tool's message
        got = chat.prompt_ids("hyp", prefix, add_generation_prompt=agp)
        assert got.ids.tolist() == render_prompt_ids(tokenizer, prefix, add_generation_prompt=agp)


def test_the_cache_is_bounded_in_entries_and_bytes(tokenizer: Any) -> None:
    chat = ChatTokenizer(tokenizer, max_entries=3, max_bytes=10**9, windowed=True)
    for i in range(5):
        chat.prompt_ids(f"c{i}", [{"role": "user", "content": f"hello {i}"}])
    assert len(chat) == 3
    small = ChatTokenizer(tokenizer, max_entries=100, max_bytes=3000, windowed=True)
    for i in range(20):
        small.prompt_ids(f"c{i}", [{"role": "user", "content": "word " * 50}])
    assert 0 < small.cached_bytes <= 3000
    assert len(small) < 20


def test_siblings_opening_with_one_prompt_share_its_ids_and_each_goes_on_exactly(tokenizer: Any) -> None:
    """GRPO: a group's siblings are new conversations with the same first turn; the first is
    tokenized, the rest reuse its ids (``shared``, none tokenized), and each sibling's next turns
    (different answers) are still the full render's ids."""
    chat = ChatTokenizer(tokenizer, windowed=True)
    prompt = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "naïve 数学 " * 40}]
    opened = [chat.prompt_ids(f"sibling-{i}", prompt, tools=TOOLS) for i in range(4)]
    assert [t.path for t in opened] == [Path.FULL, Path.SHARED, Path.SHARED, Path.SHARED]
    assert [t.new_ids for t in opened[1:]] == [0, 0, 0]
    expected = render_prompt_ids(tokenizer, prompt, tools=TOOLS)
    assert all(t.ids.tolist() == expected for t in opened)
    for i in (3, 0, 2, 1):  # each sibling's own answer and a follow-up, interleaved
        turn = [
            *prompt,
            {"role": "assistant", "content": f"answer {i} " * (i + 1)},
            {"role": "user", "content": "go on"},
        ]
        got = chat.prompt_ids(f"sibling-{i}", turn, tools=TOOLS)
        assert got.path is Path.INCREMENTAL
        assert got.ids.tolist() == render_prompt_ids(tokenizer, turn, tools=TOOLS)
    assert chat.prompt_ids("sibling-4", prompt, tools=TOOLS).ids.tolist() == expected  # unchanged by the turns
    other = chat.prompt_ids("other", prompt, chat_template_kwargs={"enable_thinking": False}, tools=TOOLS)
    assert other.path is Path.FULL  # another text: tokenized
    off = ChatTokenizer(tokenizer, windowed=True, max_openings=0)
    assert [off.prompt_ids(f"s{i}", prompt).path for i in range(2)] == [Path.FULL, Path.FULL]


def test_a_shadow_mismatch_uses_the_full_ids_and_drops_the_entry(tokenizer: Any) -> None:
    chat = ChatTokenizer(tokenizer, windowed=True)
    messages = [{"role": "user", "content": "hello there"}]
    chat.prompt_ids("s", messages)
    entry = chat._entries["s"]
    entry.tokenized.ids = array("i", [0] * len(entry.tokenized.ids))  # a corrupted cache
    longer = [*messages, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]
    got = chat.prompt_ids("s", longer, shadow=True)
    assert got.path is Path.SHADOW_MISMATCH
    assert got.ids.tolist() == render_prompt_ids(tokenizer, longer)
    assert len(chat) == 0
    assert chat.prompt_ids("t", messages).path is Path.FULL  # the corrupted opening is not shared


def tokenizer_with_template(template: str) -> Any:
    """A separate tokenizer instance (the shared one keeps the Qwen3 template)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_tokenizer_dir()), local_files_only=True)
    tok.chat_template = template
    return tok


BLOCK = "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
GEN = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
COUNT = "{{ messages|length }} messages\n"


@pytest.mark.parametrize(
    "template",
    [
        pytest.param(
            COUNT + "{% for m in messages %}" + BLOCK + "{% endfor %}" + GEN, id="a message count in the head"
        ),
        pytest.param(
            "{% for m in messages %}" + BLOCK + "{% endfor %}" + COUNT + GEN, id="a message count in the tail"
        ),
        pytest.param(
            "{% for m in messages %}<|im_start|>{{ loop.index }} {{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            + GEN,
            id="numbered messages",
        ),
    ],
)
def test_a_template_that_is_not_message_local_is_caught_per_turn_and_rerendered_exactly(template: str) -> None:
    tok = tokenizer_with_template(template)
    chat = ChatTokenizer(tok)
    rng = random.Random(5)
    paths = []
    for messages in grow(rng, 5, system=True, style="chat"):
        got = chat.prompt_ids("counting", messages)
        assert got.ids.tolist() == render_prompt_ids(tok, messages)
        paths.append(got.path)
    assert paths[1:] == [Path.RERENDERED] * 4


def test_a_template_that_breaks_the_window_rules_unseen_fails_the_probe_and_is_rendered_whole() -> None:
    # Every block but the first and the last two gets a dot: an earlier block changes when the
    # conversation grows, which neither the head check nor the cached-window check can see.
    dotted = "<|im_start|>{{ m.role }}\n{{ m.content }}{% if 0 < loop.index0 < messages|length - 2 %}.{% endif %}<|im_end|>\n"
    tok = tokenizer_with_template("{% for m in messages %}" + dotted + "{% endfor %}" + GEN)
    chat = ChatTokenizer(tok)
    assert chat.windowed is False
    rng = random.Random(6)
    for messages in grow(rng, 6, system=True, style="chat"):
        got = chat.prompt_ids("dotted", messages)
        assert got.ids.tolist() == render_prompt_ids(tok, messages)
    assert chat.windowed is False


def test_qwen_added_tokens_are_safe_cut_points(tokenizer: Any) -> None:
    safe = splice_safe(tokenizer)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in safe
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in safe


@pytest.mark.parametrize(
    ("a", "b", "n"),
    [
        pytest.param("abc", "abd", 2, id="differ at the end"),
        pytest.param("abc", "abc", 3, id="equal"),
        pytest.param("abc", "abcdef", 3, id="one is a prefix"),
        pytest.param("", "x", 0, id="empty"),
        pytest.param("x" * 1000 + "a", "x" * 1000 + "b", 1000, id="long common run"),
    ],
)
def test_common_prefix_length(a: str, b: str, n: int) -> None:
    assert common_prefix_length(a, b) == n


@pytest.mark.parametrize(
    ("message", "view", "same"),
    [
        pytest.param({"role": "user", "content": "a"}, {"role": "user", "content": "a"}, True, id="plain, equal"),
        pytest.param({"role": "user", "content": "a"}, {"role": "user", "content": "b"}, False, id="plain, content"),
        pytest.param(
            {"role": "assistant", "content": "a", "prompt_token_ids": [1], "generation_token_ids": [2]},
            {"role": "assistant", "content": "a"},
            True,
            id="Gym's fields ignored",
        ),
        pytest.param(
            {"role": "assistant", "content": "b", "prompt_token_ids": [1]},
            {"role": "assistant", "content": "a"},
            False,
            id="Gym's fields, content changed",
        ),
        pytest.param(
            {"role": "assistant", "content": "a", "prompt_token_ids": [1]},
            {"role": "assistant", "content": "a", "name": "x"},
            False,
            id="a key dropped",
        ),
        pytest.param(
            {"role": "assistant", "content": "a", "name": "x", "prompt_token_ids": [1]},
            {"role": "assistant", "content": "a"},
            False,
            id="a key added beside Gym's",
        ),
        pytest.param(
            {"role": "assistant", "content": "a", "name": "x", "prompt_token_ids": [1]},
            {"role": "assistant", "content": "a", "prompt_token_ids": [1]},
            False,
            id="a view holding a Gym field",
        ),
        pytest.param(
            {"role": "assistant", "content": "a", "x": 1, "y": 2, "z": 3, "w": 4},
            {"role": "assistant", "content": "a"},
            False,
            id="more extra keys than Gym has",
        ),
        pytest.param({"role": "user"}, {"role": "user", "content": "a"}, False, id="fewer keys than the view"),
        pytest.param(
            {"role": "assistant", "content": "a", "generation_log_probs": [0.5], "generation_token_ids": [2]},
            {"role": "assistant", "content": "a"},
            True,
            id="Gym's log-probs ignored",
        ),
    ],
)
def test_same_message_is_equality_of_the_template_view(
    message: dict[str, Any], view: dict[str, Any], same: bool
) -> None:
    assert same_message(message, view) is same
    assert (message_view(message) == view) is same


def test_cut_points_are_the_tokenizer_offsets_after_each_added_token(tokenizer: Any) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "naïve café 数学 😀"},
        {"role": "user", "content": "<tool_response>\nx\n</tool_response>"},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nok <|im_end|> inside"},
        {"role": "user", "content": "e\u0301 \ufeff again"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    splicer = SpliceTokenizer(tokenizer)
    got = splicer.encode(text, char_offset=7, id_offset=3)
    encoding = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    hits = [i for i, t in enumerate(encoding.ids) if t in splicer.cut_after]
    assert len(hits) >= 8
    assert got.ids.tolist() == encoding.ids
    assert got.cut_chars == [encoding.offsets[i][1] + 7 for i in hits]
    assert got.cut_ids == [i + 4 for i in hits]
    for chars, n_ids in zip(got.cut_chars, got.cut_ids, strict=True):  # each cut splits the ids exactly
        assert tokenizer.encode(text[: chars - 7], add_special_tokens=False) == encoding.ids[: n_ids - 3]


def test_same_message_knows_every_gym_field() -> None:
    from drs_frontend.tokenization.window import GYM_MESSAGE_FIELDS

    for field in GYM_MESSAGE_FIELDS:  # same_message spells the fields out for speed
        assert same_message({"role": "assistant", "content": "a", field: [1]}, {"role": "assistant", "content": "a"})


GYM_VALUE = st.sampled_from([[1, 2], [], [0.5]]) | st.builds(RawIds, st.just(b"[7]"), st.just(0), st.just(3))
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool"]), "content": st.sampled_from(["a", "b", ""])},
    optional={
        "prompt_token_ids": GYM_VALUE,
        "generation_token_ids": GYM_VALUE,
        "generation_log_probs": GYM_VALUE,
        "name": st.sampled_from(["x", "y"]),
    },
)


@settings(max_examples=400, deadline=None)
@given(
    before=st.lists(MESSAGE, max_size=8),
    edits=st.lists(st.tuples(st.integers(0, 7), MESSAGE), max_size=2),
    extra=st.lists(MESSAGE, max_size=2),
)
def test_kept_messages_counts_the_leading_messages_equal_but_for_gym_fields(
    before: list[dict[str, Any]], edits: list[tuple[int, dict[str, Any]]], extra: list[dict[str, Any]]
) -> None:
    """The cache compares whole lists in C (Gym's fields stand as GYM_IDS in its copies); the
    count must be the one a message-by-message comparison of template views gives."""
    now = [dict(m) for m in before] + extra
    for i, message in edits:
        if i < len(now):
            now[i] = message
    cached = [cached_form(m) for m in before]
    want = 0
    for a, b in zip(now, before, strict=False):
        if message_view(a) != message_view(b):
            break
        want += 1
    assert kept_messages(now, cached) == want
    assert all(not isinstance(v, (list, RawIds)) or k == "content" for m in cached for k, v in m.items())
