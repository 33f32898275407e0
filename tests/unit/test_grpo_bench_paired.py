"""``bench/grpo.py`` compares two modes round by round: each round's latency over the other mode's
in the same round (the rounds alternate modes, so a pair ran under about the same machine load),
their median, spread and in how many pairs the first mode was slower. The medians of each mode
alone hide it: on a shared machine one loaded round moves both modes' figures more than the
difference between them."""

from __future__ import annotations

from bench import grpo_summary as grpo


def figures(completion: float) -> dict[str, float]:
    return {name: completion for name in grpo.PAIRED}


def test_pairs_are_compared_within_their_round() -> None:
    # bounded is 1.5x groups in every round, but the rounds' loads differ 4x
    bounded = [figures(1.5), figures(6.0), figures(3.0)]
    groups = [figures(1.0), figures(4.0), figures(2.0)]
    out = grpo.summarize({(2, "bounded"): bounded, (2, "groups"): groups})["M=2"]
    paired = out["bounded_over_groups_paired"]["group_completion_s"]
    assert paired == {"median": 1.5, "spread": [1.5, 1.5], "slower_in": "3/3"}
    # the medians of each mode alone: 3.0 vs 2.0, each inside the other's spread
    assert out["bounded"]["group_completion_s"]["spread"] == [1.5, 6.0]
    assert out["groups"]["group_completion_s"]["spread"] == [1.0, 4.0]


def test_a_pair_where_the_first_mode_is_faster_is_counted_so() -> None:
    out = grpo.paired([figures(1.0), figures(3.0)], [figures(2.0), figures(2.0)])
    assert out["group_completion_s"] == {"median": 1.0, "spread": [0.5, 1.5], "slower_in": "1/2"}
