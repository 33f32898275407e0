"""The ``torch`` backend's KV frame and transport choice: how a decode engine gets a context's KV.

The prefill engine keeps a finished context's KV (one tensor ``[layers, 2, kv_heads, tokens,
head_dim]`` on its GPU) under ``ctx_request_id``. The decode engine fetches it once with
``GET /v1/disagg/kv/{ctx_request_id}?transport=T``; the answer is one binary frame:
an 8-byte little-endian header length, a JSON header (:class:`KvHeader`), then the payload. The
header names the prompt by its digest when the decode engine asks so
(:data:`drs_protocol.routes.KV_PROMPT_DIGEST_PARAM`; it has the prompt's ids in its own leg), else
carries its ids.

Transports (:class:`drs_protocol.enums.KvTransport`, the spec's ``torch.kvTransport``), chosen by
the decode engine (``auto`` picks the first that works):

- ``cuda_ipc`` (same host, both GPUs visible to the decode engine): the payload is the CUDA IPC
  handle of the prefill engine's tensor (a few hundred bytes of JSON, never a pickle: the
  consumer rebuilds the tensor from plain fields), and the decode engine copies it GPU to GPU
  (NVLink peer copy). ``auto`` takes it when the prefill engine's ``encoded_opaque_state`` names
  this host and a GPU this engine can see.
  When the context lies in the prefill engine's handoff arena (named in ``encoded_opaque_state``),
  the decode engine copies it from there first and then only takes it (``?transport=cuda_ipc_arena``,
  :data:`ARENA_TAKE`: :mod:`drs_engine.backends.torch.kv.arena`), mapping the arena once for all
  handoffs.
- ``http`` (anywhere): the payload is the KV's raw bytes, staged through pinned host memory on
  both sides.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Final

from drs_protocol.enums import KvTransport

from drs_engine.backends.handoff import decode_opaque, encode_opaque
from drs_engine.backends.torch.ipc import host_id, local_gpu_uuids
from drs_engine.errors import KvTransferError

HEADER_LEN: Final = struct.Struct("<Q")
MAX_HEADER_BYTES: Final = 64 * 1024 * 1024
OPAQUE_KIND: Final = "drs-torch-kv/1"


#: ``?transport=`` of the take after a decode engine copied the KV out of the prefill engine's
#: handoff arena (:mod:`drs_engine.backends.torch.kv.arena`); the frame is the header alone. Not a
#: transport (the KV went by CUDA IPC), so not a member of ``KvTransport`` nor a ``kvTransport`` choice.
ARENA_TAKE: Final = "cuda_ipc_arena"
#: What a prefill engine's ``GET /v1/disagg/kv/{id}?transport=`` accepts (``auto`` is the decode
#: engine's preference, resolved by :func:`choose_transport` before it asks).
FETCH_TRANSPORTS: Final = (KvTransport.CUDA_IPC.value, KvTransport.HTTP.value, ARENA_TAKE)


@dataclass(frozen=True, slots=True)
class KvHeader:
    """What a KV frame carries besides the KV itself: the prompt as its ids (``prompt_token_ids_b64``)
    or, where the decode engine asked, as their digest (``prompt_digest``, the ids then empty)."""

    ctx_request_id: int
    prompt_token_ids_b64: str
    first_token: int
    first_logprob: float
    first_top_logprobs: list[list[float]]
    weights_version: str
    cached_tokens: int
    transport: str
    kv_shape: list[int]
    kv_dtype: str
    payload_bytes: int
    ipc: dict[str, Any] = field(default_factory=dict)
    prompt_digest: str = ""

    def encode(self) -> bytes:
        data = asdict(self)
        if not self.prompt_digest:  # absent, as a decode engine from before the digest reads headers
            del data["prompt_digest"]
        body = json.dumps(data, separators=(",", ":")).encode()
        return HEADER_LEN.pack(len(body)) + body

    @classmethod
    def decode(cls, raw: bytes) -> KvHeader:
        try:
            data = json.loads(raw)
            known = {f.name for f in fields(cls)}  # a newer prefill engine's extra keys are ignored
            return cls(**{k: v for k, v in data.items() if k in known})
        except (ValueError, TypeError, AttributeError) as exc:
            raise KvTransferError(f"malformed KV frame header: {exc}") from exc


def opaque_state(
    *, digest: str, prompt_len: int, weights_version: str, gpu_uuid: str | None, arena: dict[str, Any] | None = None
) -> str:
    """``encoded_opaque_state`` of a context leg: enough for a decode engine to pick a transport
    (and, with ``arena``, to copy the KV out of the prefill engine's handoff arena before taking it)."""
    data = {
        "kind": OPAQUE_KIND,
        "digest": digest,
        "prompt_len": prompt_len,
        "weights_version": weights_version,
        "host": host_id(),
        "gpu_uuid": gpu_uuid,
        "pid": os.getpid(),
    }
    if arena is not None:
        data["arena"] = arena
    return encode_opaque(data)


def read_opaque_state(encoded: str | None) -> dict[str, Any]:
    return decode_opaque(encoded, OPAQUE_KIND)


def choose_transport(
    preference: KvTransport, opaque: dict[str, Any], local_device: Any
) -> tuple[KvTransport, int | None]:
    """The transport to ask for (and, for CUDA IPC, the producer's GPU under local numbering).

    ``auto``: CUDA IPC when the context was computed on this host, on a GPU this process sees,
    and this engine runs on a GPU; else HTTP. ``cuda_ipc`` insists (an error says why it cannot)."""
    if preference == KvTransport.HTTP:
        return KvTransport.HTTP, None
    reason = None
    producer_index = local_gpu_uuids().get(str(opaque.get("gpu_uuid")))
    if getattr(local_device, "type", None) != "cuda":
        reason = "this engine runs on the CPU"
    elif not opaque:
        reason = "the context leg carried no torch encoded_opaque_state"
    elif opaque.get("host") != host_id():
        reason = "the prefill engine is on another host"
    elif producer_index is None:
        reason = "the prefill engine's GPU is not visible to this engine"
    if reason is None:
        return KvTransport.CUDA_IPC, producer_index
    if preference == KvTransport.CUDA_IPC:
        raise KvTransferError(f"kvTransport cuda_ipc is not possible: {reason}")
    return KvTransport.HTTP, None
