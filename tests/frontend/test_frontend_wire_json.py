"""Hot-path JSON (orjson) reads and writes the same values as the standard library, edges included."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from drs_frontend.wire_json import dumps, loads
from hypothesis import given
from hypothesis import strategies as st

EDGES = [
    pytest.param(b'{"seed": 100000000000000000000000000}', id="an integer past 64 bits stays an integer"),
    pytest.param(b'{"id": 18446744073709551616}', id="2**64 stays an integer"),
    pytest.param(b'{"id": 9223372036854775807}', id="the largest snowflake id stays exact"),
    pytest.param(b'{"x": -9223372036854775808}', id="the smallest 64-bit integer stays exact"),
    pytest.param(b'{"logprob": -Infinity, "y": NaN, "z": Infinity}', id="non-finite constants round-trip"),
    pytest.param(b'{"x": 1e400}', id="an overflowing float reads as infinity"),
    pytest.param(b'\xef\xbb\xbf{"a": 1}', id="a byte-order mark is skipped"),
    pytest.param(b'{"a": "\\ud800"}', id="a lone surrogate round-trips"),
    pytest.param('{"a": "é"}'.encode("utf-16"), id="a UTF-16 body is read"),
    pytest.param(b'{"a": "\\u00e9\\u2028", "b": [1.5, -0.0, 1e-7, 12345678901234567890]}', id="plain values"),
]


@pytest.mark.parametrize("raw", EDGES)
def test_loads_and_dumps_agree_with_the_standard_library(raw: bytes) -> None:
    value = loads(raw)
    expected = json.loads(raw)
    assert _same(value, expected)
    assert _same(json.loads(dumps(value)), expected)


@pytest.mark.parametrize(
    "raw",
    [b"{bad", b"", b"[1,]", b'{"a": 1} x', b"\xff\xfe\xfd"],
    ids=["broken", "empty", "trailing comma", "junk", "bytes"],
)
def test_invalid_json_raises_the_standard_librarys_error(raw: bytes) -> None:
    with pytest.raises(ValueError) as ours:
        loads(raw)
    with pytest.raises(ValueError) as theirs:
        json.loads(raw)
    assert str(ours.value) == str(theirs.value)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@given(JSON_VALUES)
def test_any_json_value_reads_back_as_the_standard_library_reads_it(value: Any) -> None:
    raw = json.dumps(value).encode()
    assert _same(loads(raw), json.loads(raw))
    assert _same(json.loads(dumps(loads(raw))), json.loads(raw))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if type(a) is not type(b) and not (isinstance(a, float) and isinstance(b, float)):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
