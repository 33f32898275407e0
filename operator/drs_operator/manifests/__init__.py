"""Pure builders of every child object of a DisaggReplicaSet (dicts in the Kubernetes shape).

One module per child kind; each ``build_*`` takes the plan, the placement and a
:class:`~drs_operator.manifests.common.Owner` and returns manifests with the spec-hash annotation
set. Nothing here talks to Kubernetes. ``desired_children`` is the one entry point the reconcile
uses.
"""

from drs_operator.manifests.children import Children, desired_children
from drs_operator.manifests.common import SPEC_HASH_ANNOTATION, Owner, spec_hash

__all__ = ["SPEC_HASH_ANNOTATION", "Children", "Owner", "desired_children", "spec_hash"]
