"""The DisaggReplicaSet operator.

``api`` holds the resource's models, constants and child names (the one schema source); the pure
core (``validation``, ``plan``, ``placement``, ``crd``) turns a spec into decisions and imports
neither kopf nor a Kubernetes client; the Kubernetes layer and the kopf wiring sit on top.
"""
