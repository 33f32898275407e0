"""The trainer sidecar: refit every engine of a DisaggReplicaSet, straight to the engine pods.

It runs in the trainer's pod (DESIGN.md, "Control path"): it reads the resource's status for
the engines' URLs and readiness, and fans control calls out to every engine of every replica,
never through the frontends. The trainer talks to it on localhost (:mod:`.app`).

:mod:`.fleet` the engines, from status or from flags (pure parsing + a Kubernetes reader);
:mod:`.control` the engines' control API client; :mod:`.refit` the fan-out, the desired weights
and the loop that brings a restarted engine back to them; :mod:`.app` the trainer-facing HTTP
API; :mod:`.cli` ``drs sidecar``.
"""
