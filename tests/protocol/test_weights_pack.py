"""The one packed refit layout (pure; trainer and engines, torch and trtllm, compute it alike)."""

from __future__ import annotations

import itertools

from drs_protocol.nemo_rl_refit import TensorSpec, packed_batches
from drs_protocol.weights_pack import batch_ranges, flat_slots
from hypothesis import given
from hypothesis import strategies as st

shapes = st.lists(st.integers(0, 64), min_size=1, max_size=3)
specs = st.lists(st.tuples(shapes, st.sampled_from(["bfloat16", "float32", "int8"])), min_size=1, max_size=30).map(
    lambda items: [TensorSpec(f"t{i}", tuple(s), d) for i, (s, d) in enumerate(items)]
)


@given(specs, st.integers(1, 40_000))
def test_batches_are_consecutive_ranges_of_one_unpadded_concatenation(tensors: list[TensorSpec], target: int) -> None:
    flat = flat_slots(tensors)
    assert [s.offset for s in flat] == [sum(t.nbytes for t in tensors[:i]) for i in range(len(tensors))]
    ranges = batch_ranges(tensors, target)
    assert ranges[0][0] == 0 and ranges[-1][1] == sum(t.nbytes for t in tensors)
    for (_, end, _), (start, _, _) in itertools.pairwise(ranges):
        assert end == start  # no gap, no overlap
    placed = [(start + slot.offset, slot.spec) for start, _, batch in ranges for slot in batch]
    assert placed == [(s.offset, s.spec) for s in flat]  # the same bytes as the flat layout
    nemo = packed_batches(tensors, target)  # and exactly NeMo RL's batches (what trtllm engines receive)
    assert [[slot.spec.name for slot in b] for b in nemo] == [[s.spec.name for s in b] for _, _, b in ranges]
    for start, end, _ in ranges[:-1]:
        assert end - start > target  # a batch closes right after it first exceeds the target


def test_a_bfloat16_then_float32_layout_has_no_padding() -> None:
    tensors = [TensorSpec("a", (3,), "bfloat16"), TensorSpec("b", (2,), "float32")]
    assert [s.offset for s in flat_slots(tensors)] == [0, 6]
    assert [(a, b) for a, b, _ in batch_ranges(tensors, 4)] == [(0, 6), (6, 14)]
