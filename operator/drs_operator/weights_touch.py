"""Touch the engine pods when the desired weights change, so their kubelet refreshes the mounted file.

Every engine pod mounts the fleet's weights ConfigMap (``<name>-weights``, key ``desired``) and a
running engine follows that file (``drs_engine.weights.follow``). The kubelet rewrites a mounted
ConfigMap only when it syncs the pod: at its periodic sync (a minute by default, measured 34.9 to
46.7 s after a refit's cut-over on the real node) or at once when the pod object is updated. So
after it has written new desired weights into the ConfigMap, the reconcile sets the annotation
``disagg.dev/desired-weights-touch`` on each engine pod to a digest of what it wrote: a pod-object
update, not the pod template (no Deployment or StatefulSet holds engine pods, and the spec hash
ignores it): nothing restarts or rolls.

Which pods: every live engine pod of the fleet whose annotation is not that value yet (terminating
ones excepted). Not only the engines the operator's observations show at other weights: the
sidecar stores the desired weights before it calls any engine, so in the pass that sees the change
almost no engine holds them yet, and waiting for the observations (up to
``kube.engines.OBSERVE_BUDGET_S``) would delay every patch to save at most a few; an engine that
holds them reads the new file and does nothing. A fleet that never had a refit is never touched.
Idempotent: a pod already carrying the value is not patched again (the applier puts the patched
pod into the watch cache, so the next pass sees it at once).

:func:`touches` decides (pure); :func:`touch_pods` makes the calls, all at once within the
applier's throttle (its in-flight bound), each within the applier's request timeout; a pod gone
(404) or any failed call is logged and left to the next pass (every ``OBSERVE_INTERVAL_S`` while
the fleet has desired weights), never failing the reconcile.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Mapping

from drs_protocol.weights_state import DesiredWeights

from drs_operator.api.constants import ANNOTATION_DESIRED_WEIGHTS_TOUCH
from drs_operator.api.objects import Manifest
from drs_operator.kube.apply import Applier

log = logging.getLogger(__name__)

#: Hex digits of the annotation's value (a sha256 of the ConfigMap's ``desired`` data).
VALUE_CHARS = 16


def touch_value(desired: DesiredWeights | None) -> str | None:
    """The annotation's value for ``desired`` (None: no desired weights, nothing to touch)."""
    if desired is None:
        return None
    return hashlib.sha256(desired.dump().encode()).hexdigest()[:VALUE_CHARS]


def touches(pods: Mapping[str, Manifest], desired: DesiredWeights | None) -> dict[str, str]:
    """Engine pod name -> the value to set, for every pod whose annotation differs (pure)."""
    value = touch_value(desired)
    if value is None:
        return {}
    out: dict[str, str] = {}
    for name, pod in sorted(pods.items()):
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        if (meta.get("annotations") or {}).get(ANNOTATION_DESIRED_WEIGHTS_TOUCH) != value:
            out[name] = value
    return out


async def touch_pods(applier: Applier, namespace: str, plan: Mapping[str, str]) -> int:
    """Set the annotation on each pod of ``plan``; how many were patched (the rest are logged)."""
    if not plan:
        return 0
    results = await asyncio.gather(
        *(applier.annotate_pod(namespace, pod, {ANNOTATION_DESIRED_WEIGHTS_TOUCH: v}) for pod, v in plan.items()),
        return_exceptions=True,
    )
    done = 0
    for pod, result in zip(plan, results, strict=True):
        if isinstance(result, BaseException):
            if not isinstance(result, Exception):
                raise result  # cancellation and the like are not a failed call
            log.warning("could not touch engine pod %s/%s (the next pass tries again): %s", namespace, pod, result)
        elif not result:
            log.info("engine pod %s/%s is gone; not touched", namespace, pod)
        else:
            done += 1
    log.info("touched %d engine pods of %s for new desired weights", done, namespace)
    return done
