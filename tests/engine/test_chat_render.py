"""drs_protocol.chat: the render + tokenize function the frontend and the engine share."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from drs_engine.server.detok import IncrementalDetokenizer
from drs_engine.server.runner import RunningEngine
from drs_protocol.chat import (
    ChatTemplateError,
    decode_token_ids,
    load_tokenizer,
    render_completion_ids,
    render_prompt_ids,
)
from hypothesis import given, settings
from hypothesis import strategies as st

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {}}}],
    },
    {"role": "tool", "content": "sunny, 21C"},
    {"role": "assistant", "content": "Sunny, 21 degrees."},
    {"role": "user", "content": "And tomorrow? <|im_end|> is just text here"},
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(None)


def test_the_default_tokenizer_is_qwen3_loaded_once(tokenizer: Any) -> None:
    assert load_tokenizer(None) is tokenizer
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 151644


@pytest.mark.parametrize(
    ("kwargs", "ending"),
    [({}, "<|im_start|>assistant\n"), ({"enable_thinking": False}, "<|im_start|>assistant\n<think>\n\n</think>\n\n")],
    ids=["thinking-default", "thinking-off"],
)
def test_rendered_ids_equal_the_templates_own_tokenization(tokenizer: Any, kwargs: dict[str, Any], ending: str) -> None:
    ids = render_prompt_ids(tokenizer, CONVERSATION, tools=TOOLS, chat_template_kwargs=kwargs)
    reference = tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=True, **kwargs
    )
    reference_ids = reference["input_ids"] if hasattr(reference, "keys") else reference
    assert ids == list(reference_ids)
    assert decode_token_ids(tokenizer, ids, skip_special_tokens=False).endswith(ending)


def test_text_parts_render_like_the_joined_string(tokenizer: Any) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    joined = [{"role": "user", "content": "one\ntwo"}]
    assert render_prompt_ids(tokenizer, parts) == render_prompt_ids(tokenizer, joined)


def test_a_null_content_renders_as_empty(tokenizer: Any) -> None:
    assert render_prompt_ids(tokenizer, [{"role": "user", "content": None}]) == render_prompt_ids(
        tokenizer, [{"role": "user", "content": ""}]
    )


def test_no_generation_prompt_leaves_it_off(tokenizer: Any) -> None:
    with_prompt = render_prompt_ids(tokenizer, CONVERSATION[:2])
    without = render_prompt_ids(tokenizer, CONVERSATION[:2], add_generation_prompt=False)
    assert with_prompt[: len(without)] == without and len(with_prompt) > len(without)


@pytest.mark.parametrize(
    "messages",
    [
        pytest.param([], id="no-messages"),
        pytest.param([{"content": "x"}], id="no-role"),
        pytest.param(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], id="an-image-part"
        ),
        pytest.param([{"role": "user", "content": 5}], id="a-number-as-content"),
    ],
)
def test_malformed_conversations_are_refused(tokenizer: Any, messages: list[dict[str, Any]]) -> None:
    with pytest.raises(ChatTemplateError):
        render_prompt_ids(tokenizer, messages)


def test_completion_prompts_tokenize_like_the_tokenizer(tokenizer: Any) -> None:
    assert render_completion_ids(tokenizer, "Hello world") == tokenizer.encode("Hello world")
    assert decode_token_ids(tokenizer, render_completion_ids(tokenizer, "Hello world")) == "Hello world"


async def test_the_engine_renders_a_chat_exactly_as_the_shared_function_does(
    client: httpx.AsyncClient, prefill: RunningEngine, tokenizer: Any
) -> None:
    body = {
        "model": "sim",
        "messages": CONVERSATION,
        "tools": TOOLS,
        "chat_template_kwargs": {"enable_thinking": False},
        "max_tokens": 1,
    }
    response = await client.post(prefill.url + "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    expected = render_prompt_ids(tokenizer, CONVERSATION, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    assert response.json()["prompt_token_ids"] == expected


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=151642), min_size=1, max_size=40))
def test_streamed_text_pieces_add_up_to_the_whole_text(ids: list[int]) -> None:
    tokenizer = load_tokenizer(None)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([token]) for token in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == decode_token_ids(tokenizer, ids)


def test_gym_token_id_fields_on_earlier_turns_do_not_change_the_rendering() -> None:
    from drs_protocol.chat import load_tokenizer, render_prompt_ids

    tok = load_tokenizer(None)
    plain = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"},
    ]
    gym: list[dict[str, Any]] = [dict(m) for m in plain]
    gym[1].update(prompt_token_ids=list(range(5000)), generation_token_ids=[1, 2, 3], generation_log_probs=[-0.1] * 3)
    assert render_prompt_ids(tok, gym) == render_prompt_ids(tok, plain)
