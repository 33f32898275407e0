"""The real-node chaos bench's status sampler judges a sample against the version desired at the
sample's time as the engines do (``bench.chaos_realnodes_weights.desired_in``): the status's own
desired weights once their cut-over has passed, else the refits so far. Before, it learned a
refit's version only when the trainer pod ended, so samples between the cut-over and that end
counted engines already at the new version as stale (4 of 32 in a run of refit_operator_killed)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from bench import chaos_realnodes_weights as weights

CUT_OVER = 1_800_000_000.0  # 2027-01-15T08:00:00Z
CUT_OVER_ISO = "2027-01-15T08:00:00.000000Z"


@pytest.fixture(autouse=True)
def one_refit_so_far() -> Iterator[None]:
    weights.REFITS[:] = [(CUT_OVER - 600, "step-1")]
    yield
    weights.REFITS.clear()


def status(engine_version: str, desired: dict[str, Any] | None) -> dict[str, Any]:
    engine = {"name": "p-0", "ready": True, "weightsVersion": engine_version}
    st: dict[str, Any] = {"replicaStatuses": [{"engines": [engine]}], "conditions": []}
    if desired is not None:
        st["weights"] = {"desired": desired}
    return st


def test_a_refit_counts_from_its_cut_over_not_from_its_trainer_pods_end() -> None:
    st = status("step-2", {"version": "step-2", "effectiveAt": CUT_OVER_ISO})
    assert weights.desired_in(st, CUT_OVER + 0.5) == "step-2"
    watch = weights.StatusWatch.__new__(weights.StatusWatch)
    watch.samples = watch.stale = watch.untrue = watch.pending = 0
    watch.first_untrue = watch.first_stale = None
    watch.look(st, weights.desired_in(st, CUT_OVER + 0.5))
    assert (watch.samples, watch.stale, watch.untrue) == (1, 0, 0)


def test_before_the_cut_over_the_previous_refit_is_still_desired() -> None:
    st = status("step-2", {"version": "step-2", "effectiveAt": CUT_OVER_ISO})
    assert weights.desired_in(st, CUT_OVER - 0.5) == "step-1"


def test_without_desired_weights_in_status_the_refits_so_far_decide() -> None:
    assert weights.desired_in(status("step-1", None), CUT_OVER) == "step-1"
    assert weights.desired_in(status("step-1", {"version": "step-2"}), CUT_OVER) == "step-2"  # no cut-over: at once
