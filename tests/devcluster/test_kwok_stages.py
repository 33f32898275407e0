"""kwok's stages, adjusted: pods the runner runs start not Ready; a node turned NotReady by the chaos
stage reports when that happened (checked on kwok's own files)."""

from __future__ import annotations

import pytest
import yaml
from drs_devcluster.kwok_stages import (
    NODE_NOT_READY_STAGE,
    POD_READY_AGAIN,
    POD_READY_STAGE,
    StageFormatError,
    adjust,
    runner_aware,
)

#: kwok v0.8.0's kustomize/stage/pod/fast/pod-ready.yaml, the part this adjustment touches.
KWOK_POD_READY = """apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-ready
spec:
  next:
    statusTemplate: |
      {{ $now := Now }}

      conditions:
      - lastTransitionTime: {{ $now | Quote }}
        status: "True"
        type: Initialized
      - lastTransitionTime: {{ $now | Quote }}
        status: "True"
        type: Ready
      - lastTransitionTime: {{ $now | Quote }}
        status: "True"
        type: ContainersReady
      containerStatuses:
      {{ range .spec.containers }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        ready: true
        restartCount: 0
        state:
          running:
            startedAt: {{ $now | Quote }}
      {{ end }}
"""


def test_the_pod_ready_stage_leaves_runner_pods_not_ready() -> None:
    out = runner_aware(POD_READY_STAGE, KWOK_POD_READY)
    assert '{{ if eq (index . 0) "drs" }}{{ $ready = "False" }}' in out
    assert "status: {{ $ready | Quote }}\n        type: Ready\n" in out
    assert "status: {{ $ready | Quote }}\n        type: ContainersReady\n" in out
    assert 'ready: {{ eq $ready "True" }}' in out
    assert 'status: "True"\n        type: Initialized' in out  # the rest as kwok ships it


def test_other_stages_are_left_alone_and_an_unexpected_shape_is_refused() -> None:
    assert runner_aware("pod-delete.yaml", KWOK_POD_READY) == KWOK_POD_READY
    with pytest.raises(StageFormatError, match=r"pod-ready\.yaml"):
        runner_aware(POD_READY_STAGE, KWOK_POD_READY.replace("type: ContainersReady", "type: Other"))


#: kwok v0.8.0's kustomize/stage/node/chaos/node-not-ready.yaml, the part this adjustment touches.
KWOK_NODE_NOT_READY = """    statusTemplate: |
      {{ $now := Now }}
      {{ $lastTransitionTime := or .metadata.creationTimestamp $now }}
      conditions:
      {{ range NodeConditions }}
      {{ if eq .type "Ready" }}
      - lastHeartbeatTime: {{ $now | Quote }}
        lastTransitionTime: {{ $lastTransitionTime | Quote }}
        status: "False"
      {{ else }}
      - lastHeartbeatTime: {{ $now | Quote }}
        lastTransitionTime: {{ $lastTransitionTime | Quote }}
      {{ end }}
      {{ end }}
"""


def test_the_node_not_ready_stage_writes_when_ready_turned_false_and_keeps_it() -> None:
    out = adjust(NODE_NOT_READY_STAGE, KWOK_NODE_NOT_READY)
    assert "{{ $readySince := $now }}" in out
    assert '(eq .type "Ready") (eq .status "False") }}{{ $readySince = .lastTransitionTime }}' in out
    assert (
        'if eq .type "Ready" }}\n      - lastHeartbeatTime: {{ $now | Quote }}\n        lastTransitionTime: {{ $readySince'
        in out
    )
    assert out.count("{{ $lastTransitionTime | Quote }}") == 1  # the other conditions as kwok ships them
    assert adjust(POD_READY_STAGE, KWOK_POD_READY) == runner_aware(POD_READY_STAGE, KWOK_POD_READY)
    assert adjust("pod-delete.yaml", KWOK_NODE_NOT_READY) == KWOK_NODE_NOT_READY
    with pytest.raises(StageFormatError, match=r"node-not-ready\.yaml"):
        adjust(NODE_NOT_READY_STAGE, KWOK_NODE_NOT_READY.replace('"Ready"', '"Other"'))


def test_pod_ready_again_selects_running_pods_only_the_node_controller_marked_and_sets_ready_alone() -> None:
    stage = yaml.safe_load(POD_READY_AGAIN)
    assert stage["kind"] == "Stage" and stage["spec"]["resourceRef"] == {"apiGroup": "v1", "kind": "Pod"}
    wants = {e["key"]: (e["operator"], e.get("values")) for e in stage["spec"]["selector"]["matchExpressions"]}
    assert wants[".metadata.deletionTimestamp"] == ("DoesNotExist", None)
    assert wants[".status.phase"] == ("In", ["Running"])
    assert wants['.status.conditions.[] | select( .type == "Ready" ) | .status'] == ("In", ["False"])
    # a runner pod whose probe fails has ContainersReady False too: not ours to touch
    assert wants['.status.conditions.[] | select( .type == "ContainersReady" ) | .status'] == ("In", ["True"])
    template = stage["spec"]["next"]["statusTemplate"]
    assert "type: Ready" in template and 'status: "True"' in template
    assert "containerStatuses" not in template and "phase" not in template  # a strategic merge of Ready only
