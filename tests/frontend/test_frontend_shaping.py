"""Request and response shaping of one turn (PROTOCOL.md section 2), without HTTP."""

from __future__ import annotations

import json

import pytest
from drs_frontend.errors import RequestError, UpstreamProtocolError
from drs_frontend.shaping import (
    build_context_request,
    build_generation_request,
    check_context_response,
    engine_token_prefix,
    finished_context_response,
    parse_request,
    shape_response,
    sse_events,
    strip_client_fields,
)
from drs_protocol.routes import Endpoint
from drs_protocol.token_ids import encode_token_ids_b64

GYM_BODY = {
    "model": "m",
    "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "prompt_token_ids": [1, 2], "generation_token_ids": [3]},
        {"role": "user", "content": "again"},
    ],
    "logprobs": True,
    "top_logprobs": 0,
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "required_prefix_token_ids": [1, 2, 3],
    "conversation_params": {"conversation_id": "traj-1"},
    "stream": True,
    "stream_options": {"include_usage": True},
}


def ctx_response(finish_reason: str = "length", **params: object) -> dict[str, object]:
    return {
        "id": "cmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "x"},
                "finish_reason": finish_reason,
                "disaggregated_params": {
                    "request_type": "context_only",
                    "ctx_request_id": 7,
                    "disagg_request_id": 2**41,
                    "encoded_opaque_state": "b3BhcXVl",
                    "first_gen_tokens": [42],
                    "some_future_field": {"kept": True},
                    **params,
                },
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        "prompt_token_ids": None,
        "prompt_token_ids_b64": encode_token_ids_b64([1, 2, 3, 4, 5]),
    }


@pytest.mark.parametrize(
    ("raw", "endpoint", "status", "fragment"),
    [
        pytest.param(b"{not json", Endpoint.CHAT, 400, "not valid JSON", id="malformed JSON is a 400"),
        pytest.param(b"[1, 2]", Endpoint.CHAT, 400, "JSON object", id="a JSON array is a 400"),
        pytest.param(b'{"model": "m"}', Endpoint.CHAT, 400, "messages", id="missing messages is a 400"),
        pytest.param(b'{"messages": []}', Endpoint.CHAT, 400, "messages", id="empty messages is a 400"),
        pytest.param(b'{"messages": ["hi"]}', Endpoint.CHAT, 400, "messages[0]", id="a message that is not an object"),
        pytest.param(b'{"model": "m"}', Endpoint.COMPLETIONS, 400, "prompt", id="completions without a prompt"),
        pytest.param(
            b'{"messages": [{"role": "user", "content": "x"}], "conversation_params": "abc"}',
            Endpoint.CHAT,
            400,
            "conversation_params",
            id="conversation_params that is not an object",
        ),
        pytest.param(
            b'{"messages": [{"role": "user", "content": "x"}], "conversation_params": {"conversation_id": 5}}',
            Endpoint.CHAT,
            400,
            "conversation_params",
            id="a numeric conversation id",
        ),
        pytest.param(
            b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
            Endpoint.CHAT,
            400,
            "stream",
            id="a stream flag that is not a boolean",
        ),
    ],
)
def test_bad_requests_are_refused_with_a_named_reason(
    raw: bytes, endpoint: Endpoint, status: int, fragment: str
) -> None:
    with pytest.raises(RequestError) as info:
        parse_request(raw, endpoint)
    assert info.value.status == status
    assert fragment in info.value.message


def test_the_gym_only_fields_are_stripped_and_nothing_else() -> None:
    stripped = strip_client_fields(GYM_BODY)
    assert set(GYM_BODY) - set(stripped) == {"return_token_ids", "required_prefix_token_ids"}
    assert stripped["return_tokens_as_token_ids"] is True  # relayed: the engines honour it
    assert "return_token_ids" in GYM_BODY  # the caller's dict is untouched


def test_a_finished_context_response_answers_its_prompt_ids_as_the_list() -> None:
    """Gym reads top-level ``prompt_token_ids`` with ``choices[].token_ids``; the context leg
    answered them as our base64 leg field, which the client never asked for."""
    ctx = {**ctx_response("stop"), "prompt_token_ids": None, "prompt_token_ids_b64": encode_token_ids_b64([7, 8, 9])}
    answer = finished_context_response(ctx)
    assert answer["prompt_token_ids"] == [7, 8, 9]
    assert "prompt_token_ids_b64" not in answer


@pytest.mark.parametrize(
    ("tokenized", "continuity", "gym_ids", "prefix"),
    [(True, True, False, False), (True, False, False, False), (False, True, True, True), (False, False, False, False)],
)
def test_gym_ids_go_to_the_engine_only_when_it_splices(
    tokenized: bool, continuity: bool, gym_ids: bool, prefix: bool
) -> None:
    body = engine_token_prefix(GYM_BODY, strip_client_fields(GYM_BODY), tokenized=tokenized, continuity=continuity)
    assistant = body["messages"][1]
    assert ("prompt_token_ids" in assistant and "generation_token_ids" in assistant) is gym_ids
    assert assistant["content"] == "hello" and [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert ("required_prefix_token_ids" in body) is prefix
    assert "prompt_token_ids" in GYM_BODY["messages"][1]  # type: ignore[index]  # the caller's dict is untouched


def test_the_context_leg_is_a_non_streamed_context_only_copy() -> None:
    body = strip_client_fields(GYM_BODY)
    ctx = build_context_request(
        body,
        disagg_request_id=2**41 + 5,
        conversation_id="traj-1",
        tokids_ctxbytes=True,
        prompt_token_ids_b64="AQAAAA==",
    )
    assert ctx["stream"] is False
    assert ctx["stream_options"] is None
    assert ctx["disaggregated_params"] == {
        "request_type": "context_only",
        "disagg_request_id": 2**41 + 5,
        "conversation_id": "traj-1",
        "return_prompt_token_ids_b64": True,
    }
    assert ctx["conversation_params"] == {"conversation_id": "traj-1"}
    assert ctx["prompt_token_ids_b64"] == "AQAAAA=="
    assert ctx["messages"] == body["messages"]
    assert body["stream"] is True  # not mutated


def test_an_unfinished_context_response_goes_on_to_generation() -> None:
    assert check_context_response(ctx_response("length")) is False
    assert check_context_response(ctx_response("not_finished")) is False


def test_a_finished_context_response_is_the_answer_without_disaggregated_params() -> None:
    ctx = ctx_response("stop")
    assert check_context_response(ctx) is True
    answer = finished_context_response(ctx)
    assert "disaggregated_params" not in answer["choices"][0]
    assert "disaggregated_params" in ctx["choices"][0]  # type: ignore[index]


@pytest.mark.parametrize(
    ("response", "fragment"),
    [
        pytest.param({"choices": []}, "no choices", id="no choices"),
        pytest.param({"choices": [{"finish_reason": "length"}]}, "disaggregated_params", id="no disaggregated params"),
        pytest.param(ctx_response("length", ctx_request_id=None), "ctx_request_id", id="no ctx request id"),
    ],
)
def test_a_context_response_that_breaks_the_protocol_is_an_upstream_error(
    response: dict[str, object], fragment: str
) -> None:
    with pytest.raises(UpstreamProtocolError, match=fragment):
        check_context_response(response)


def test_the_generation_leg_carries_the_context_params_as_generation_only() -> None:
    body = strip_client_fields(GYM_BODY)
    ctx = ctx_response()
    gen = build_generation_request(body, ctx, endpoint=Endpoint.CHAT, strip_history=True)
    params = gen["disaggregated_params"]
    assert params["request_type"] == "generation_only"
    assert params["ctx_request_id"] == 7
    assert params["some_future_field"] == {"kept": True}
    assert params["ctx_usage"] == ctx["usage"]
    assert gen["prompt_token_ids_b64"] == ctx["prompt_token_ids_b64"]
    assert "prompt_token_ids" not in gen
    assert gen["messages"] == [body["messages"][-1]]
    assert gen["stream"] is True
    assert gen["stream_options"] == {"include_usage": True}
    assert ctx["choices"][0]["disaggregated_params"]["request_type"] == "context_only"  # type: ignore[index]


def test_the_generation_leg_relays_plain_prompt_ids_and_keeps_history_when_asked() -> None:
    body = strip_client_fields(GYM_BODY)
    ctx = {**ctx_response(), "prompt_token_ids": [9, 8], "prompt_token_ids_b64": None}
    gen = build_generation_request(body, ctx, endpoint=Endpoint.CHAT, strip_history=False)
    assert gen["prompt_token_ids"] == [9, 8]
    assert gen["messages"] == body["messages"]


def test_token_ids_and_log_probs_land_where_gym_reads_them() -> None:
    response = {
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ab"},
                "token_ids": [11, 12],
                "logprobs": {"content": [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.5}]},
                "finish_reason": "stop",
            }
        ],
        "prompt_token_ids_b64": encode_token_ids_b64([1, 2, 3]),
    }
    message = shape_response(response)["choices"][0]["message"]
    assert message["prompt_token_ids"] == [1, 2, 3]
    assert message["generation_token_ids"] == [11, 12]
    assert message["generation_log_probs"] == [-0.5, -1.5]


def test_generated_ids_are_read_from_token_id_logprob_tokens_when_token_ids_are_absent() -> None:
    response = {
        "choices": [
            {
                "message": {"role": "assistant", "content": "ab"},
                "logprobs": {
                    "content": [{"token": "token_id:5", "logprob": -0.1}, {"token": "token_id:6", "logprob": -0.2}]
                },
            }
        ],
        "prompt_token_ids": [1],
    }
    message = shape_response(response, prompt_ids=[99])["choices"][0]["message"]
    assert message["generation_token_ids"] == [5, 6]
    assert message["prompt_token_ids"] == [1]


def test_a_complete_response_streams_as_chunks_ending_with_done() -> None:
    response = finished_context_response(ctx_response("stop"))
    events = list(sse_events(response, include_usage=True))
    assert events[-1] == b"data: [DONE]\n\n"
    first = json.loads(events[0][len(b"data: ") :])
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "x"}
    assert first["choices"][0]["finish_reason"] == "stop"
    usage = json.loads(events[1][len(b"data: ") :])
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 6
