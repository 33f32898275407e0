"""The scheduled cut-over of a refit: one instant from which the new weights are desired.

A refit's desired weights take effect at ``effective_at`` (wall clock, epoch seconds), an instant
the sidecar picks slightly in the future (:func:`cutover_margin`: more than the time it took, last
refit, until every engine had been told), announces to every engine
(:class:`drs_protocol.control.WeightsTarget`, or folded into the load itself:
:class:`drs_protocol.control.LoadWeights` ``announce``, one call per engine) and stores with the
desired weights (:class:`drs_protocol.weights_state.DesiredWeights`); no engine serves them before
it (a checkpoint load may be sent and read earlier, and is swapped in at ``effective_at`` by the
engine's clock).

How long "telling every engine" took is measured one way, by the engines: each load that carries
its announce answers ``told_lead_s``, the seconds from taking the target to the cut-over on the
engine's own clock (negative: told late). The refit's start to the last engine told is then
``margin - min(told_lead_s)`` (:func:`told_seconds`), and the next margin is
:data:`CUTOVER_MARGIN_FACTOR` times it. A clock ahead of the sidecar's makes that figure larger
(a larger margin: the safe side); the gate itself judges every leg by the engine's clock.

Every turn carries the instant the fleet received it (:data:`~drs_protocol.fields.HEADER_TURN_STARTED`,
stamped once by the frontend and sent on both legs; an engine called directly uses its own receipt
time). The weights desired for a turn are those in effect at its stamp: a leg stamped at or after
``effective_at`` is served only by an engine holding the target (else 503 ``weights_pending``); a leg
stamped before it is served with what the engine holds, marked ``weights_boundary`` when that is
not what was desired at its stamp (the engine had loaded the target already).

Clocks: the stamp is the frontend's wall clock, ``effective_at`` the sidecar's; a skew between them
shifts the cut-over by the skew, for the turns of that frontend (NTP keeps it to milliseconds).
"""

from __future__ import annotations

import math
from typing import Final

from drs_protocol.fields import HEADER_TURN_STARTED

#: Seconds of margin before anything was measured (a sidecar's first refit).
DEFAULT_CUTOVER_MARGIN_S: Final = 0.3
#: The least margin a measured refit gives (``drs sidecar --cutover-margin``'s default floor). It
#: stays 0.3 s, though a small fleet is told in milliseconds: an engine told after the cut-over
#: serves the turns stamped between the two at the old weights, so the floor is slack for a
#: sidecar or engine that stalls (a GC pause, a loaded node) once; lower it by the flag.
MIN_CUTOVER_MARGIN_S: Final = 0.3
#: The margin is this multiple of the last measured time until every engine was told (its one-way
#: delivery, :func:`told_seconds`; or its announce round, where the announce was a call of its own).
CUTOVER_MARGIN_FACTOR: Final = 2.0
#: The margin never exceeds this (a slow round is a sick engine, not a reason to stall every refit).
MAX_CUTOVER_MARGIN_S: Final = 5.0
#: The furthest ahead of an engine's clock a load's ``effective_at`` may be (the margin's maximum
#: plus 5 s of clock skew): the engine holds the load that long at most (400 beyond it).
MAX_SWITCH_AHEAD_S: Final = MAX_CUTOVER_MARGIN_S + 5.0
#: A stamp is accepted within these epoch seconds (2001 .. 2286): anything else is a unit mistake.
MIN_STAMP: Final = 1e9
MAX_STAMP: Final = 1e10


class BadTurnStamp(ValueError):
    """A turn stamp that is not an epoch-seconds number; its message names the header and the rule."""


def cutover_margin(floor_s: float, last_told_s: float | None) -> float:
    """Seconds from a refit's start to its cut-over: ``max(floor_s, 2 x last_told_s)`` (the last
    refit's time until every engine was told; none measured yet: at least
    :data:`DEFAULT_CUTOVER_MARGIN_S`), at most :data:`MAX_CUTOVER_MARGIN_S` (never below ``floor_s``)."""
    if last_told_s is None:
        margin = max(floor_s, DEFAULT_CUTOVER_MARGIN_S)
    else:
        margin = max(floor_s, CUTOVER_MARGIN_FACTOR * last_told_s)
    return max(floor_s, min(margin, MAX_CUTOVER_MARGIN_S))


def told_seconds(margin_s: float, leads_s: list[float]) -> float | None:
    """Seconds from a refit's start until its last engine was told, from the engines' own
    ``told_lead_s`` (seconds each had left until the cut-over when it took the target, on its
    clock) and the margin the refit gave: ``margin_s - min(leads_s)`` (None: no engine said)."""
    if not leads_s:
        return None
    return max(0.0, margin_s - min(leads_s))


def format_stamp(stamp: float) -> str:
    """A stamp as the header carries it: epoch seconds with microseconds."""
    return f"{stamp:.6f}"


def parse_stamp(value: str) -> float:
    """The stamp in a header value, or :class:`BadTurnStamp` naming the header and its rule."""
    try:
        stamp = float(value)
    except ValueError:
        stamp = math.nan
    if not math.isfinite(stamp) or not MIN_STAMP <= stamp <= MAX_STAMP:
        raise BadTurnStamp(
            f"{HEADER_TURN_STARTED}: must be the wall-clock instant in epoch seconds "
            f"(a decimal number between {MIN_STAMP:.0f} and {MAX_STAMP:.0f}), got {value[:40]!r}"
        )
    return stamp
