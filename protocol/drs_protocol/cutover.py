"""The scheduled cut-over of a refit: one instant from which the new weights are desired.

A refit's desired weights take effect at ``effective_at`` (wall clock, epoch seconds), an instant
the sidecar picks slightly in the future (:func:`cutover_margin`: more than its announce round),
announces to every engine (:class:`drs_protocol.control.WeightsTarget`) and stores with the desired
weights (:class:`drs_protocol.weights_state.DesiredWeights`); no engine serves them before it (a
checkpoint load, :class:`drs_protocol.control.LoadWeights`, may be sent and read earlier, once every
engine has been told, and is swapped in at ``effective_at`` by the engine's clock).

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

#: Seconds of margin a cut-over gets at least beyond the refit's start (the floor).
DEFAULT_CUTOVER_MARGIN_S: Final = 0.3
#: The margin is this multiple of the last measured announce round (when that is more than the floor).
CUTOVER_MARGIN_ROUNDS: Final = 2.0
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


def cutover_margin(floor_s: float, last_round_s: float | None) -> float:
    """Seconds from a refit's start to its cut-over: ``max(floor_s, 2 x last_round_s)``, at most
    :data:`MAX_CUTOVER_MARGIN_S` (and never below ``floor_s``)."""
    margin = floor_s if last_round_s is None else max(floor_s, CUTOVER_MARGIN_ROUNDS * last_round_s)
    return max(floor_s, min(margin, MAX_CUTOVER_MARGIN_S))


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
