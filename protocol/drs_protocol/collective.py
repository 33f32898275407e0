"""A collective refit step that cannot hang: the one budget split, and the error types of its failures.

The trainer's call to the sidecar for one collective step (``/v1/collective/init`` or
``/v1/collective/update``) returns within the sidecar's ``--collective-timeout`` (``total_s``,
:data:`~drs_protocol.limits.DEFAULT_COLLECTIVE_TIMEOUT_S` by default). :func:`step_deadlines` cuts
that budget in three, in order:

1. ``engine_s`` (:data:`ENGINE_SHARE` of it): the ``timeout_s`` each engine is given. The engine's
   step waits at most that long for the group's other ranks (the store, the group's creation, every
   batch's broadcast under the time left), then answers 502 :data:`COLLECTIVE_ERROR_TYPE`.
2. ``call_s`` (up to :data:`CALL_SHARE`): how long the sidecar waits for an engine's answer. An
   engine that has not answered by then is hung (a stopped process, a wedged GPU): it is the culprit.
3. ``abort_s`` (the rest): the group's abort on every member, all at once, each call bounded by it.

An engine whose update failed after bytes of it had landed answers turns and ``/health`` with 503
:data:`WEIGHTS_INCOMPLETE_ERROR_TYPE` until a load completes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

#: ``error.type`` of an engine's 502 when its collective step failed or ran past ``timeout_s``.
COLLECTIVE_ERROR_TYPE: Final = "collective_error"
#: ``error.type`` of the 503 of an engine holding part of an update that did not finish.
WEIGHTS_INCOMPLETE_ERROR_TYPE: Final = "weights_incomplete"
#: Shares of the step's budget: the engines' own deadline, then the sidecar's wait for their answers.
ENGINE_SHARE: Final = 0.8
CALL_SHARE: Final = 0.9


@dataclass(frozen=True, slots=True)
class StepDeadlines:
    engine_s: float  #: ``timeout_s`` sent to every engine
    call_s: float  #: the sidecar's wait for each engine's answer
    abort_s: float  #: each abort call, after a failed step

    @property
    def total_s(self) -> float:
        return self.call_s + self.abort_s


def step_deadlines(total_s: float) -> StepDeadlines:
    """The budget of one collective step cut as the module says (``total_s`` > 0)."""
    if not total_s > 0:
        raise ValueError(f"total_s: must be > 0, got {total_s}")
    return StepDeadlines(
        engine_s=total_s * ENGINE_SHARE, call_s=total_s * CALL_SHARE, abort_s=total_s * (1 - CALL_SHARE)
    )
