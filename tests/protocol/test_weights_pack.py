"""The collective refit's packing plan (pure; both trainer and engine compute it)."""

from __future__ import annotations

import pytest
from drs_protocol.weights_pack import ALIGN_BYTES, PackError, TensorSpec, parse_state_dict_info, plan_buckets
from hypothesis import given
from hypothesis import strategies as st

shapes = st.lists(st.integers(0, 64), min_size=1, max_size=3)
specs = st.lists(st.tuples(shapes, st.sampled_from(["bfloat16", "float32", "int8"])), min_size=1, max_size=30).map(
    lambda items: [TensorSpec(f"t{i}", tuple(s), d) for i, (s, d) in enumerate(items)]
)


@given(specs, st.integers(1, 40_000))
def test_every_tensor_lands_once_in_order_aligned_and_without_overlap(tensors: list[TensorSpec], size: int) -> None:
    buckets = plan_buckets(tensors, size)
    placed = [slot for bucket in buckets for slot in bucket.slots]
    assert [slot.spec for slot in placed] == tensors
    for bucket in buckets:
        end = 0
        for slot in bucket.slots:
            assert slot.offset % ALIGN_BYTES == 0 and slot.offset >= end
            end = slot.offset + slot.spec.nbytes
        assert bucket.nbytes == end
        assert bucket.nbytes <= size or len(bucket.slots) == 1  # only a lone oversized tensor exceeds it


def test_state_dict_info_accepts_nemo_pairs_and_objects_and_names_what_is_wrong() -> None:
    parsed = parse_state_dict_info({"a": [[2, 3], "torch.bfloat16"], "b": {"shape": [4], "dtype": "float32"}})
    assert [(s.name, s.shape, s.dtype, s.nbytes) for s in parsed] == [
        ("a", (2, 3), "bfloat16", 12),
        ("b", (4,), "float32", 16),
    ]
    with pytest.raises(PackError, match=r"state_dict_info\.c: dtype 'complex7'"):
        parse_state_dict_info({"c": [[1], "complex7"]})
    with pytest.raises(PackError, match=r"state_dict_info\.d: shape must be a list of integers"):
        parse_state_dict_info({"d": ["x", "float32"]})
