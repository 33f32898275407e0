"""Rotating a fleet's token Secrets without refusing a caller (pure).

A rotation is asked for by writing any new value into the DisaggReplicaSet's
``disagg.dev/rotate-tokens`` annotation (``kubectl annotate drs NAME disagg.dev/rotate-tokens=$(date
+%s) --overwrite``). Both Secrets, ``<drs>-serving`` and ``<drs>-control``, then go through two
phases of ``window`` seconds each (``disagg.dev/token-rotation-window-seconds``, default
:data:`WINDOW_S`, bounds :data:`MIN_WINDOW_S`-:data:`MAX_WINDOW_S`):

=====================  ==========================================  =============================
phase (annotation)     Secret keys                                 every pod (``token_source``)
=====================  ==========================================  =============================
idle                   ``token: A``                                presents A, accepts A
``next`` (1)           ``token: A``, ``next: B``                   presents A, accepts A and B
``previous`` (2)       ``token: B``, ``previous: A``               presents B, accepts B and A
idle                   ``token: B``                                presents B, accepts B
=====================  ==========================================  =============================

Why two phases: pods read a changed Secret at different moments (the kubelet refreshes each pod's
mounted Secret on its own sync, within about a minute by default, then the token source within a
second). A presenter must never switch to B before every acceptor accepts B, and an acceptor must
not drop A before every presenter has switched: phase 1 makes B accepted everywhere before anyone
presents it; phase 2 keeps A accepted while presenters switch. Each phase lasts the window, which
may end early: every write of the Secret bumps its key ``generation`` (not a token), each process
reports the generation it read in its ``/health`` answer (``token_source.GENERATIONS_HEADER``),
and once every pod that mounts the Secret reports the current one the phase is done
(``lagging`` of :func:`rotation_step` empty). The window stays the upper bound: a pod that does
not answer, or lags, holds the phase until the window ends, and the Event then names it. While a
phase waits, ``status.tokenRotations`` names the Secret, its phase and the pods it waits on
(:func:`rotation_status`). A token two rotations old is refused (401).

The state lives on the Secret itself (annotations :data:`ANNOTATION_ROTATION_PHASE`, ``-since``,
``-request``), so an operator restarted mid-rotation resumes it. A request that arrives during a
rotation starts the next one after it ends.

A Secret deleted while pods that read it run is re-created in phase 1 with no ``token`` key
(:func:`recreated_secret`): the pods keep presenting the token they hold (the mounted files keep
the last version while the Secret is gone; the source keeps its token when ``token`` is absent)
and accept the new one; after the window the new token becomes ``token`` and each pod keeps
accepting the one it held for ``token_source.HELD_GRACE_S`` seconds.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from drs_protocol.token_source import KEY_GENERATION, KEY_NEXT, KEY_PREVIOUS, KEY_TOKEN

from drs_operator.api.constants import (
    ANNOTATION_ROTATE_TOKENS,
    ANNOTATION_ROTATION_PHASE,
    ANNOTATION_ROTATION_REQUEST,
    ANNOTATION_ROTATION_SINCE,
    ANNOTATION_ROTATION_WINDOW,
    EventReason,
    EventType,
)
from drs_operator.api.objects import Manifest
from drs_operator.api.status import MAX_LAGGING_PODS, TokenRotationStatus
from drs_operator.status_events import EventNote

#: Seconds each phase lasts by default: above the kubelet's default sync period (60 s) for a
#: mounted Secret, plus the token source's second.
WINDOW_S: Final = 120
MIN_WINDOW_S: Final = 2
MAX_WINDOW_S: Final = 86_400
TOKEN_BYTES: Final = 32
#: How often a phase under way asks the pods which generation they read (the window stays the bound).
CONFIRM_POLL_S: Final = 2.0
#: Pods named in an Event at most (the rest counted).
NAMED_PODS: Final = 5


@dataclass(frozen=True)
class Step:
    """What one pass does to one Secret: the Secret to write (None: nothing), an Event, and the
    seconds until the next phase is due (None: no rotation under way)."""

    secret: Manifest | None = None
    note: EventNote | None = None
    due_in_s: float | None = None


def rotation_window(annotations: Mapping[str, str]) -> tuple[int, str | None]:
    """The window in seconds, and the problem with the annotation (the default is used then)."""
    raw = annotations.get(ANNOTATION_ROTATION_WINDOW)
    if raw is None:
        return WINDOW_S, None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not MIN_WINDOW_S <= value <= MAX_WINDOW_S:
        return WINDOW_S, (
            f"annotation {ANNOTATION_ROTATION_WINDOW}={raw!r}: must be a whole number of seconds from "
            f"{MIN_WINDOW_S} to {MAX_WINDOW_S}; using {WINDOW_S}"
        )
    return value, None


def secret_keys(secret: Manifest) -> dict[str, str]:
    """The token keys of a live Secret (``data`` is base64; unreadable values are left out)."""
    found: dict[str, str] = {}
    for key, raw in (secret.get("data") or {}).items():
        try:
            found[str(key)] = base64.b64decode(str(raw), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            continue
    found.update({str(k): str(v) for k, v in (secret.get("stringData") or {}).items()})
    return found


def generation(secret: Manifest) -> int | None:
    """The Secret's ``generation`` key (None: not written, or not a number)."""
    number = secret_keys(secret).get(KEY_GENERATION, "")
    return int(number) if number.isdigit() else None


def _written(live: Manifest, keys: Mapping[str, str], annotations: Mapping[str, str]) -> Manifest:
    """``live`` with exactly ``keys`` (base64 ``data``), its ``generation`` bumped, and
    ``annotations`` (for a replace)."""
    keys = {**keys, KEY_GENERATION: str((generation(live) or 0) + 1)}
    meta = live.get("metadata") or {}
    kept = {k: meta[k] for k in ("name", "namespace", "labels", "ownerReferences") if k in meta}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {**kept, "annotations": dict(annotations)},
        "type": live.get("type", "Opaque"),
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in keys.items()},
    }


def _time(text: str | None) -> datetime.datetime | None:
    try:
        return datetime.datetime.fromisoformat(text) if text else None
    except ValueError:
        return None


def _phase(
    live: Manifest,
    keys: Mapping[str, str],
    annotations: Mapping[str, str],
    phase: str,
    now: datetime.datetime,
    window_s: float,
    reason: EventReason,
    message: str,
) -> Step:
    """The step into ``phase`` (``next`` or ``previous``): ``live`` with ``keys``, the phase and
    its start marked, a Normal Event ``reason`` (``message`` after the Secret's name), due in the window."""
    name = (live.get("metadata") or {}).get("name", "")
    marks = {**annotations, ANNOTATION_ROTATION_PHASE: phase, ANNOTATION_ROTATION_SINCE: now.isoformat()}
    note = EventNote(EventType.NORMAL, reason, f"Secret {name}: {message}")
    return Step(_written(live, keys, marks), note, window_s)


def _pods(names: Sequence[str]) -> str:
    shown = ", ".join(names[:NAMED_PODS])
    return shown + (f" and {len(names) - NAMED_PODS} more" if len(names) > NAMED_PODS else "")


def rotation_step(
    live: Manifest,
    request: str | None,
    window_s: float,
    now: datetime.datetime,
    lagging: Sequence[str] | None = None,
) -> Step:
    """The next step of ``live``'s rotation (module docstring) at ``now``. ``lagging``: the pods
    that mount the Secret and have not reported its current generation (None: not asked; the
    phase then lasts the window)."""
    name = (live.get("metadata") or {}).get("name", "")
    annotations = dict((live.get("metadata") or {}).get("annotations") or {})
    keys = secret_keys(live)
    phase = annotations.get(ANNOTATION_ROTATION_PHASE)
    if phase is None:
        if not request or request == annotations.get(ANNOTATION_ROTATION_REQUEST):
            return Step()
        new = {KEY_TOKEN: keys[KEY_TOKEN], KEY_NEXT: secrets.token_hex(TOKEN_BYTES)} if KEY_TOKEN in keys else None
        if new is None:  # nothing to rotate from: a Secret without a token is fixed by hand
            return Step(
                note=EventNote(
                    EventType.WARNING,
                    EventReason.TOKEN_ROTATION_INVALID,
                    f"Secret {name} has no key {KEY_TOKEN!r}: not rotated",
                )
            )
        message = f"rotation begun; the new token is accepted from now on and presented in {window_s:.0f}s"
        marks = {**annotations, ANNOTATION_ROTATION_REQUEST: request}
        return _phase(live, new, marks, KEY_NEXT, now, window_s, EventReason.TOKEN_ROTATION_STARTED, message)
    since = _time(annotations.get(ANNOTATION_ROTATION_SINCE)) or now
    took = (now - since).total_seconds()
    left = window_s - took
    if left > 0 and (lagging is None or lagging):
        return Step(due_in_s=left if lagging is None else min(left, CONFIRM_POLL_S))
    if left > 0:
        why = f"; every pod that mounts it read the phase, after {took:.0f}s"
    elif lagging:
        why = f"; the {window_s:.0f}s window ended before these pods reported reading the phase: {_pods(lagging)}"
    else:
        why = ""
    if phase == KEY_NEXT and KEY_NEXT in keys:
        switched = {KEY_TOKEN: keys[KEY_NEXT], **({KEY_PREVIOUS: keys[KEY_TOKEN]} if KEY_TOKEN in keys else {})}
        message = f"the new token is presented from now on; the old one stays accepted for {window_s:.0f}s at most{why}"
        return _phase(
            live, switched, annotations, KEY_PREVIOUS, now, window_s, EventReason.TOKEN_ROTATION_SWITCHED, message
        )
    done = {KEY_TOKEN: keys.get(KEY_TOKEN) or keys.get(KEY_NEXT, "")}
    marks = {k: v for k, v in annotations.items() if k not in (ANNOTATION_ROTATION_PHASE, ANNOTATION_ROTATION_SINCE)}
    message = f"Secret {name}: rotation done; the old token is refused from now on{why}"
    return Step(_written(live, done, marks), EventNote(EventType.NORMAL, EventReason.TOKEN_ROTATION_DONE, message))


def rotation_status(secret: Manifest, lagging: Sequence[str] | None) -> TokenRotationStatus | None:
    """What ``status.tokenRotations`` says of ``secret`` (as written this pass): None when no
    rotation is under way; else its phase and the pods that phase waits on, ``lagging`` (None: not
    asked yet, as for a phase that has just begun), the first :data:`MAX_LAGGING_PODS` by name."""
    meta = secret.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    phase = annotations.get(ANNOTATION_ROTATION_PHASE)
    if phase is None:
        return None
    names = sorted(lagging) if lagging is not None else None
    return TokenRotationStatus(
        secret=str(meta.get("name", "")),
        phase=str(phase),
        since=_time(annotations.get(ANNOTATION_ROTATION_SINCE)),
        lagging_pods=names[:MAX_LAGGING_PODS] if names is not None else None,
        lagging_count=len(names) if names is not None else None,
    )


def recreated_secret(built: Manifest, request: str | None, now: datetime.datetime) -> Manifest:
    """A token Secret built fresh (``secrets.build_token_secret``) turned into phase 1 of a
    rotation from a token nobody can read any more: its token under ``next`` only."""
    token = dict(built["stringData"])[KEY_TOKEN]
    marks: dict[str, Any] = {ANNOTATION_ROTATION_PHASE: KEY_NEXT, ANNOTATION_ROTATION_SINCE: now.isoformat()}
    if request:
        marks[ANNOTATION_ROTATION_REQUEST] = request
    meta = {**built["metadata"], "annotations": {**(built["metadata"].get("annotations") or {}), **marks}}
    # a generation no pod holds: the pods still hold the deleted Secret's files, whose counter may be any
    fresh = str(int(now.timestamp() * 1000))
    return {**built, "metadata": meta, "stringData": {KEY_NEXT: token, KEY_GENERATION: fresh}}


def rotation_request(annotations: Mapping[str, str]) -> str | None:
    """The DisaggReplicaSet's ``rotate-tokens`` value (None: never asked)."""
    return annotations.get(ANNOTATION_ROTATE_TOKENS) or None
