"""kwok's stage files, adjusted where kwok's simulation departs from what a kubelet does.

**pod-ready**: a pod the pod runner runs is never Ready before its process is.

kwok's ``pod-ready`` stage marks every pod on a simulated node Running **and Ready** the instant
it is bound. For our own pods (host network, first container's command ``drs``) the pod runner
starts a real process and writes readiness from its real probe, but until its first write the pod
said Ready for a process that did not exist yet: a freshly replaced engine pod looked ready during
a roll, and the operator's status with it. Here that stage writes ``Ready``, ``ContainersReady``
and the containers' ``ready`` as False for those pods (everything else as kwok ships it); the
runner turns them True when the probe passes, as a kubelet would.

**node-not-ready** (the chaos stage a node label turns on): kwok writes the Ready condition's
``lastTransitionTime`` as the node's creation time, so a node that just went NotReady looked
NotReady for as long as it had existed, and anything timed from that transition (the operator's
``topology.notReadyTolerationSeconds``, as a kubelet's node would report it) expired at once.
Here it is the moment Ready turned False, kept while it stays False.

**pod-ready-again** (ours, added): the node lifecycle controller marks every pod of a node that
stops being Ready ``Ready=False`` (``ContainersReady`` stays True); a kubelet posts its pods'
readiness again once its node is back, but kwok's pod-ready stage only plays for Pending pods,
so a pod of a node that blipped stayed not Ready for ever (at 1,000 pods on the loaded machine
three nodes blipped and their 24 pods never came back). This stage sets ``Ready`` True again on a
Running pod whose containers are ready (a pod the runner runs with a failing probe has both
False and is left alone), after ``READY_AGAIN_DELAY_MS``. While the node is still not Ready the
controller marks the pod again, so such a pod flips back to ready briefly once per delay until
its node returns.
"""

from __future__ import annotations

from typing import Final

POD_READY_STAGE: Final = "pod-ready.yaml"
NODE_NOT_READY_STAGE: Final = "node-not-ready.yaml"
#: How long after the node lifecycle controller marked a pod not ready kwok marks it ready again.
READY_AGAIN_DELAY_MS: Final = 5000
#: The added stage (see the module docstring).
POD_READY_AGAIN: Final = f"""apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-ready-again
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.phase'
      operator: 'In'
      values:
      - 'Running'
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: 'In'
      values:
      - 'False'
    - key: '.status.conditions.[] | select( .type == "ContainersReady" ) | .status'
      operator: 'In'
      values:
      - 'True'
  delay:
    durationMilliseconds: {READY_AGAIN_DELAY_MS}
  next:
    statusTemplate: |
      {{{{ $now := Now }}}}
      conditions:
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "True"
        type: Ready
"""

#: Template prologue: ``$ready`` is "False" for a host-network pod whose first container runs ``drs``.
_PROLOGUE: Final = (
    '      {{ $ready := "True" }}\n'
    "      {{ if .spec.hostNetwork }}{{ with (index .spec.containers 0).command }}"
    '{{ if eq (index . 0) "drs" }}{{ $ready = "False" }}{{ end }}{{ end }}{{ end }}\n'
)
_REPLACEMENTS: Final = (
    ('        status: "True"\n        type: Ready\n', "        status: {{ $ready | Quote }}\n        type: Ready\n"),
    (
        '        status: "True"\n        type: ContainersReady\n',
        "        status: {{ $ready | Quote }}\n        type: ContainersReady\n",
    ),
    ("        ready: true\n        restartCount: 0\n        state:\n          running:", None),
)


class StageFormatError(ValueError):
    """kwok's stage file does not have the shape this adjustment expects (a kwok upgrade changed it)."""


#: node-not-ready: when the Ready condition turned False (now, or kept from the last write).
_READY_SINCE: Final = (
    "      {{ $readySince := $now }}\n"
    '      {{ range .status.conditions }}{{ if and (eq .type "Ready") (eq .status "False") }}'
    "{{ $readySince = .lastTransitionTime }}{{ end }}{{ end }}\n"
)
_NOT_READY_OLD: Final = (
    '      {{ if eq .type "Ready" }}\n'
    "      - lastHeartbeatTime: {{ $now | Quote }}\n"
    "        lastTransitionTime: {{ $lastTransitionTime | Quote }}\n"
)


def adjust(name: str, text: str) -> str:
    """``text`` of the stage file ``name``, with this module's adjustments."""
    if name == POD_READY_STAGE:
        return runner_aware(name, text)
    if name == NODE_NOT_READY_STAGE:
        return ready_transition_time(name, text)
    return text


def ready_transition_time(name: str, text: str) -> str:
    """kwok's node-not-ready stage with a real ``lastTransitionTime`` on its Ready condition."""
    anchor = "      {{ $now := Now }}\n"
    if anchor not in text or _NOT_READY_OLD not in text:
        raise StageFormatError(f"{name}: no {anchor.strip()!r} line or Ready condition to adjust")
    text = text.replace(anchor, anchor + _READY_SINCE, 1)
    return text.replace(_NOT_READY_OLD, _NOT_READY_OLD.replace("$lastTransitionTime", "$readySince"), 1)


def runner_aware(name: str, text: str) -> str:
    """``text`` of the stage file ``name``, adjusted when it is kwok's pod-ready stage."""
    if name != POD_READY_STAGE:
        return text
    anchor = "      {{ $now := Now }}\n"
    if anchor not in text:
        raise StageFormatError(f"{name}: no {anchor.strip()!r} line to follow")
    text = text.replace(anchor, anchor + _PROLOGUE, 1)
    for old, new in _REPLACEMENTS:
        if old not in text:
            raise StageFormatError(f"{name}: expected {old.strip()!r}")
        replacement = new if new is not None else old.replace("ready: true", 'ready: {{ eq $ready "True" }}', 1)
        text = text.replace(old, replacement, 1)
    return text
