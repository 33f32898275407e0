"""Token ids on the wire: JSON lists of ints, or base64 of little-endian int32 (``*_b64``).

The base64 form is what TensorRT-LLM's ``gen_tokids_ctxbytes`` relays between the legs of a
turn: a 30k-token prompt is 160 kB of base64 instead of a 30k-element JSON array to parse.
"""

from __future__ import annotations

import base64
import binascii
import sys
from array import array
from collections.abc import Sequence


class TokenIdsError(ValueError):
    """A token-id field is malformed; the message names the field and the rule."""


def encode_token_ids_b64(ids: Sequence[int]) -> str:
    """Base64 of the ids as little-endian int32."""
    try:
        arr = array("i", ids)
    except OverflowError as exc:
        raise TokenIdsError(f"token ids must fit in int32: {exc}") from exc
    if sys.byteorder != "little":
        arr.byteswap()
    return base64.b64encode(arr.tobytes()).decode("ascii")


def decode_token_ids_b64(data: str, field: str = "prompt_token_ids_b64") -> list[int]:
    """Inverse of :func:`encode_token_ids_b64`; raises TokenIdsError naming ``field``."""
    if not isinstance(data, str):
        raise TokenIdsError(f"{field}: must be a base64 string")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise TokenIdsError(f"{field}: invalid base64 ({exc})") from exc
    if len(raw) % 4:
        raise TokenIdsError(f"{field}: {len(raw)} bytes is not a whole number of int32 values")
    arr = array("i")
    arr.frombytes(raw)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tolist()
