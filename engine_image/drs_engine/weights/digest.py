"""The digest of a torch engine's weights, on their device (:mod:`drs_protocol.weights_digest`).

Packed weights (one flat ``uint8`` buffer in the refit layout, ``backends.torch.weights.packed``) are
digested in place; weights kept as separate tensors (an unaligned layout) go through one
staging buffer, in their order. Blocks (device work): the backend runs it on its GPU thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from drs_protocol.weights_digest import digest_torch, digest_torch_tensors


def torch_weights_digest(flat: Any | None, params: Mapping[str, Any]) -> str:
    """The digest of ``flat`` when the weights are packed into it, else of ``params`` in order."""
    if flat is not None:
        return digest_torch(flat)
    return digest_torch_tensors(params.values())
