"""The trainer pod killed mid-refit on a real node (issue 22: "kill the sidecar mid-refit, then
restart it: the desired weights are still known and reached").

Under Gym-shaped load from a client pod over the status URLs, the trainer's refit step as a pod
refits by checkpoint path, its sidecar loading one engine at a time; as soon as the sidecar has
stored the new desired weights, its process is SIGKILLed from the host and the pod deleted, with
engines still at the old weights. A new trainer pod's sidecar reads the desired weights back from
the resource and loads them on the engines behind. Every turn is at the weights desired at its
stamp (the refit's from its cut-over), none lost, and every engine ends at the desired digest.
What would break it: desired weights a sidecar keeps only in memory. Shown by
``sidecar_killed_forgotten`` of ``bench/chaos_realnodes.py`` (not by this test): the operator
stopped before the refit (``bench.chaos_realnodes_sidecar.operator_stopped``), so the store
reaches no engine's mounted file, the stored annotation removed after the kill (``unstore``),
then the operator back: the new trainer pod fails, the engines the dead sidecar had not loaded
serve their previous weights once its target's lease and the lapsed hold are over. (Removing the
annotation with the operator running, as this docstring once described, no longer fails: the
operator touches the engine pods on the store, so their files already named the weights.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from drs_devcluster.testing import RunningCluster

from bench import chaos_realnodes_sidecar as cut_short

from .load import load_answers, off_policy, start_load
from .test_weights_on_real_node import EXAMPLE, NAME, checkpoint_fleet, drs, engines, wait

pytestmark = [pytest.mark.cluster, pytest.mark.realnode]

#: the client's load: long enough to span the kill, the new pod's start and its catch-up
LOAD_S = 90


@pytest.fixture
def fleet(realcluster: RunningCluster, operator: str, realns: str, tmp_path: Path) -> Iterator[None]:
    yield from checkpoint_fleet(realcluster, realns, tmp_path, EXAMPLE)


def test_a_trainer_pod_killed_mid_refit_leaves_desired_weights_a_new_trainer_pod_brings_every_engine_to(
    realcluster: RunningCluster, fleet: None, realns: str
) -> None:
    start_load(realcluster, realns, "load-killed", LOAD_S)
    cut = cut_short.kill_trainer_mid_refit(realcluster, realns, NAME, "trainer")
    desired = cut.desired
    # the kill came mid-refit: some engine had not been loaded by the dead sidecar
    assert any(v != desired.version for v in cut.held_after_kill.values()), cut
    assert cut_short.stored(realcluster, realns, NAME) == desired  # nothing took it back
    phase, out = cut_short.resume(realcluster, realns, NAME, "trainer-resumed", desired.version)
    assert phase == "Succeeded", out

    def all_at_desired() -> bool:
        shown = engines(drs(realcluster, realns)["status"])
        return len(shown) == 4 and all(e.get("weightsDigest") == desired.digest for e in shown)

    wait("every engine's status digest the desired one", all_at_desired, timeout=60)
    assert drs(realcluster, realns)["status"]["weights"]["desired"]["digest"] == desired.digest
    load, answers = load_answers(realcluster, realns, "load-killed", LOAD_S)
    assert load["lost"] == 0 and load["turns"] > 0, load
    assert desired.effective_at is not None
    # the load outlasted the catch-up: turns after the cut-over were answered, all at the refit's weights
    after = [a for a in answers if a[0] is not None and a[0] >= desired.effective_at]
    assert after and not off_policy(answers, desired.version, desired.effective_at), (load, cut.held_after_kill)
