"""Limits two processes must agree on: what one side sends, the other accepts."""

from __future__ import annotations

from typing import Final

#: Longest weights version (characters): the engine's control API, the sidecar's trainer API and
#: ``status.weights.version`` in the CRD all use this bound.
MAX_WEIGHTS_VERSION_CHARS: Final = 256
#: Largest control-API request body an engine accepts (bytes); larger gets 413.
MAX_CONTROL_BODY_BYTES: Final = 1024 * 1024
