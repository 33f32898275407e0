"""A running engine follows the fleet's stored desired weights.

The desired weights an engine reads at its start (:mod:`.desired`) are a snapshot. When they change
while it runs and no trainer's sidecar brings it to them (its sidecar died mid-refit after storing
them: once the announced target's lease lapses, the engines it had not loaded would serve the
previous weights for good), the engine does it itself. The operator keeps the fleet's weights
ConfigMap mounted in every engine pod (:data:`drs_protocol.env.WEIGHTS_DIR`, key
:data:`drs_protocol.env.DESIRED_WEIGHTS_KEY`; the kubelet updates the file in place), and the
engine reads that file every :data:`FOLLOW_POLL_S` (:class:`DesiredFollower`).

:func:`decide` (pure) says what to do about what the file names:

* nothing there (no file, an empty one: a fleet with no desired weights): nothing;
* the engine holds them (by digest when both are known, else by version,
  :func:`drs_engine.weights.desired.holds`), or a catch-up to them already runs: nothing;
* they are older than what the engine was told since: a weights operation of the control API (the
  sidecar's load, collective or CUDA IPC update) completed after their cut-over
  (``effective_at``), or the engine follows desired weights with a later cut-over (the file lags
  the API server by the kubelet's sync period, so a file can be older than the sidecar's word or
  than the variable the pod started with): stale, ignored. Desired weights without a cut-over
  (an older sidecar) are followed only while nothing of the kind happened;
* an announced target binds the engine (:mod:`.target`, within its lease): defer, the sidecar's
  own load or broadcast is in flight;
* else: catch up, exactly as at the start (:mod:`.catchup`: ``/health`` and new legs 503
  ``weights_pending``, from the checkpoint path, else from a serving peer, retried with back-off
  for as long as they are not reached; a catch-up to older desired weights is ended in favour of
  the new one).

A file that cannot be read or parsed (half written, hand edited) is logged and ignored: the engine
keeps what it does and looks again at the next poll.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from drs_protocol.weights_state import DesiredWeights

from drs_engine.weights import desired as desired_weights

log = logging.getLogger(__name__)

#: How often a running engine reads the mounted desired weights (the kubelet itself updates the
#: file about once a minute; a read is one small file).
FOLLOW_POLL_S: Final = 2.0


class Action(enum.Enum):
    """What :func:`decide` says a running engine does about the desired weights it read."""

    NONE = "none"  #: no desired weights
    HOLDS = "holds"  #: the engine holds them
    FOLLOWING = "following"  #: a catch-up to them runs already
    STALE = "stale"  #: older than the engine's newer word: ignored
    DEFER = "defer"  #: an announced target binds the engine: the sidecar acts
    CATCH_UP = "catch_up"  #: gate the engine and catch up


@dataclass(frozen=True, slots=True)
class Held:
    """What the engine holds and knows when it decides."""

    version: str
    digest: str | None
    #: an announced target binds it (within its lease)
    target_binds: bool = False
    #: the desired weights a catch-up now pending goes to (None: none pending)
    pending: DesiredWeights | None = None
    #: the newest desired weights the engine followed or started under (None: none)
    known: DesiredWeights | None = None
    #: when (epoch seconds) a weights operation of the control API last completed (None: never)
    control_at: float | None = None


def stale(desired: DesiredWeights, held: Held) -> bool:
    """Whether ``desired`` is older than the engine's newer word (see the module docstring)."""
    known_at = None if held.known is None else held.known.effective_at
    if desired.effective_at is None:  # no cut-over to order it by
        return held.control_at is not None or known_at is not None
    if known_at is not None and desired.effective_at < known_at:
        return True
    return held.control_at is not None and desired.effective_at <= held.control_at


def decide(desired: DesiredWeights | None, held: Held) -> Action:
    """What a running engine does about the desired weights ``desired`` (pure)."""
    if desired is None:
        return Action.NONE
    if held.pending == desired:
        return Action.FOLLOWING
    if stale(desired, held):
        return Action.STALE
    if desired_weights.holds(held.version, held.digest, desired):
        return Action.HOLDS
    if held.target_binds:
        return Action.DEFER
    return Action.CATCH_UP


def read_desired_file(path: Path) -> DesiredWeights | None:
    """The desired weights in the mounted file (None: no file, or empty: the fleet has none);
    :class:`~drs_engine.weights.desired.DesiredWeightsError` naming the file when it cannot be
    read or parsed."""
    try:
        text = path.read_text()
    except FileNotFoundError:  # not mounted (an engine started by hand), or the key is gone
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise desired_weights.DesiredWeightsError(
            f"the desired weights file {str(path)!r} cannot be read: {exc}"
        ) from exc
    return desired_weights.parse_desired(text, f"the desired weights file {str(path)!r}")


class DesiredFollower:
    """Reads ``path`` every ``interval`` seconds and hands what it names to ``act`` (the engine's
    :meth:`~drs_engine.server.state.EngineState.follow_desired`, which decides and acts)."""

    def __init__(self, path: Path, act: Callable[[DesiredWeights], Action], interval: float = FOLLOW_POLL_S) -> None:
        self.path = path
        self.act = act
        self.interval = interval
        #: the last action (None: no desired weights read yet)
        self.last: Action | None = None
        self._said: tuple[object, ...] | None = None

    def tick(self) -> Action:
        """One look at the file: the action taken (:attr:`Action.NONE` for a bad file: logged, ignored)."""
        try:
            wanted = read_desired_file(self.path)
        except desired_weights.DesiredWeightsError as exc:
            self._say(("bad", str(exc)), logging.WARNING, "%s: ignored, looking again in %.1fs", exc, self.interval)
            self.last = Action.NONE
            return Action.NONE
        action = Action.NONE if wanted is None else self.act(wanted)
        if wanted is not None and action in (Action.DEFER, Action.STALE, Action.CATCH_UP):
            self._say(
                (action, wanted),
                logging.INFO,
                "the stored desired weights %s (cut-over %s): %s",
                wanted.version,
                wanted.effective_at,
                _WHY[action],
            )
        self.last = action
        return action

    def _say(self, key: tuple[object, ...], level: int, message: str, *args: object) -> None:
        """Log once per distinct situation, not on every poll."""
        if key != self._said:
            self._said = key
            log.log(level, message, *args)

    async def run(self) -> None:
        """Look every ``interval`` seconds until cancelled; never raises over the file or a decision."""
        while True:
            try:
                self.tick()
            except Exception:  # a bug must not stop the engine from serving, nor the next look
                log.exception("following the desired weights in %s failed; looking again", self.path)
            await asyncio.sleep(self.interval)  # the poll interval itself (the file has no event)


_WHY: Final = {
    Action.DEFER: "an announced target binds this engine; the sidecar brings it there (waiting for the lease)",
    Action.STALE: "older than what this engine was told since; ignored",
    Action.CATCH_UP: "this engine holds other weights and no target binds it: catching up, serving nothing meanwhile",
}
