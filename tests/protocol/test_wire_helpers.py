"""The wire helpers every process shares: token-id base64, the snowflake request id, the conversation id."""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import pytest
from drs_protocol import snowflake
from drs_protocol.control import ControlAnswer, WeightsChanged, answer_bytes, answer_json, answer_model, result_of
from drs_protocol.fields import conversation_id_from
from drs_protocol.routes import ControlOp
from drs_protocol.token_ids import TokenIdsError, decode_token_ids_b64, encode_token_ids_b64
from hypothesis import given
from hypothesis import strategies as st

int32s = st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), max_size=300)


@given(int32s)
def test_token_ids_round_trip_through_little_endian_int32_base64(ids: list[int]) -> None:
    encoded = encode_token_ids_b64(ids)
    assert decode_token_ids_b64(encoded) == ids
    assert base64.b64decode(encoded) == struct.pack(f"<{len(ids)}i", *ids)


@pytest.mark.parametrize(
    ("data", "message"),
    [("not base64!", "invalid base64"), (base64.b64encode(b"abc").decode(), "not a whole number of int32")],
    ids=["garbage is refused naming the field", "a partial int32 is refused"],
)
def test_malformed_token_id_fields_name_the_field(data: str, message: str) -> None:
    with pytest.raises(TokenIdsError, match=f"prompt_token_ids_b64: .*{message}"):
        decode_token_ids_b64(data)


def test_ids_beyond_int32_cannot_be_encoded() -> None:
    with pytest.raises(TokenIdsError, match="int32"):
        encode_token_ids_b64([2**31])


def test_snowflake_ids_are_unique_increasing_in_range_and_carry_the_node_id() -> None:
    calls = [0]

    def clock() -> int:  # a slow clock: 1500 readings per millisecond
        calls[0] += 1
        return snowflake.EPOCH_MS + 1000 + calls[0] // 1500

    minter = snowflake.SnowflakeMinter(node_id=37, clock_ms=clock)
    ids = [minter.next_id() for _ in range(2500)]  # more than 1024 in one millisecond
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)
    assert all(snowflake.MIN_ID <= i < snowflake.MAX_ID for i in ids)
    assert {snowflake.node_id_of(i) for i in ids} == {37}


def test_two_frontends_never_mint_the_same_id_in_the_same_millisecond() -> None:
    now = snowflake.EPOCH_MS + 5
    a = snowflake.SnowflakeMinter(node_id=0, clock_ms=lambda: now)
    b = snowflake.SnowflakeMinter(node_id=1, clock_ms=lambda: now)
    assert not {a.next_id() for _ in range(500)} & {b.next_id() for _ in range(500)}


@pytest.mark.parametrize("node_id", [-1, 256])
def test_node_ids_outside_8_bits_are_refused(node_id: int) -> None:
    with pytest.raises(ValueError, match="node_id"):
        snowflake.SnowflakeMinter(node_id=node_id)


@pytest.mark.parametrize(
    ("body", "headers", "expected"),
    [
        ({"conversation_params": {"conversation_id": "body"}}, {"x-session-id": "header"}, "body"),
        ({}, {"x-correlation-id": "b", "x-session-id": "a"}, "a"),
        ({}, {"x-multi-turn-session-id": "m"}, "m"),
        ({"conversation_params": {"conversation_id": ""}}, {}, None),
        ({"conversation_params": "oops"}, {"x-session-affinity": "s"}, "s"),
    ],
    ids=[
        "the body wins over headers",
        "headers in priority order",
        "the last header counts",
        "empty is none",
        "a malformed body falls to headers",
    ],
)
def test_conversation_id_lookup(body: dict[str, object], headers: dict[str, str], expected: str | None) -> None:
    assert conversation_id_from(body, headers) == expected


@pytest.mark.parametrize("told_lead_s", [None, 0.25], ids=["no announce carried", "announce carried"])
def test_a_control_answer_as_bytes_is_the_answer_json_and_parses_back(told_lead_s: float | None) -> None:
    """The engine sends :func:`answer_bytes` (one pydantic encoding); it must be exactly the JSON of
    :func:`answer_json` (defaults left out, figures kept) and parse back into the op's answer model."""
    raw = {"version": "step-2", "previous_version": "step-1", "content_hash": "ab12", "told_lead_s": told_lead_s}
    answer = ControlAnswer[Any](
        op=ControlOp.LOAD_WEIGHTS,
        result=result_of(WeightsChanged, raw),
        weights_version="step-2",
        weights_digest=None,
        waited_s=0.0,
        elapsed_s=0.001,
    )
    body = answer_bytes(answer)
    assert json.loads(body) == answer_json(answer)
    assert ("told_lead_s" in json.loads(body)["result"]) is (told_lead_s is not None)
    assert answer_model(ControlOp.LOAD_WEIGHTS).model_validate_json(body) == answer
