"""The one name of a Kubernetes object as the operator handles it: a JSON object.

Children are built, read from the watch caches and written as plain dicts (what the Kubernetes
client sends and answers); a function that only reads one takes a :data:`ManifestView`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

#: A Kubernetes object (a child the operator builds, a live object it read, an API answer).
Manifest: TypeAlias = dict[str, Any]
#: A Kubernetes object that is only read.
ManifestView: TypeAlias = Mapping[str, Any]
