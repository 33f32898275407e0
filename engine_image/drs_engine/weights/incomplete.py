"""An engine never serves half-loaded weights: the rule after every operation that changes them.

A weights operation (a load, a collective update, a CUDA IPC update) that fails may already have
written part of the new bytes into the weights (a collective update receives batch after batch in
place). After each one the control API calls :func:`settle` with what it saw:

- it succeeded: the weights are whole again (``weights_incomplete`` cleared);
- it failed, and the backend said bytes had landed (``weights_changed`` on its error) or the
  digest measured afterwards differs from the one before (or could not be measured): the engine
  holds part of an update. Until a later weights operation succeeds, every new leg and ``/health``
  answer 503 ``weights_incomplete`` (its pod is not Ready, the frontends send it nothing), and the
  sidecar's reconcile loads the desired weights on it like on any engine behind;
- it failed before changing anything: nothing changes (an earlier incomplete state stays).
"""

from __future__ import annotations

import logging
from typing import Protocol

log = logging.getLogger(__name__)


class _Holder(Protocol):
    weights_incomplete: str | None


def settle(state: _Holder, error: BaseException | None, before: str | None, after: str | None) -> None:
    """Update ``state.weights_incomplete`` after a weights operation (see the module)."""
    if error is None:
        if state.weights_incomplete is not None:
            log.info("the weights are whole again")
        state.weights_incomplete = None
        return
    changed = bool(getattr(error, "weights_changed", False)) or (before is not None and after != before)
    if changed:
        state.weights_incomplete = f"{type(error).__name__}: {error}"
        log.error("a weights update failed after it changed bytes: serving stops until a load completes (%s)", error)
