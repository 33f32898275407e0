"""Names several processes share: engine roles, engine backends, router names, precisions, KV transports.

The operator's CRD enums are generated from these classes (``drs_operator.api.spec`` types its
fields with them), the engine and frontend config models parse them, and the command lines offer
them as choices, so a name added here reaches every side at once.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final


class Role(StrEnum):
    """An engine role. TensorRT-LLM spells them ``ctx`` / ``gen`` on the wire."""

    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def wire_name(self) -> str:
        """TensorRT-LLM's name for the role in a disaggregated server config."""
        return "ctx" if self is Role.PREFILL else "gen"


#: Engine roles in plan order: prefill engines come before decode engines in every replica.
ROLES: Final = (Role.PREFILL, Role.DECODE)


class EngineBackend(StrEnum):
    """What runs inside an engine: TensorRT-LLM on GPUs, or the CPU ``sim`` test double."""

    TRTLLM = "trtllm"
    SIM = "sim"
    TORCH = "torch"


class CtxRouter(StrEnum):
    """How a frontend picks the prefill engine of a turn (``conversation`` is stateful)."""

    CONVERSATION = "conversation"
    LOAD_BALANCING = "load_balancing"
    ROUND_ROBIN = "round_robin"


class GenRouter(StrEnum):
    """How a frontend picks the decode engine of a turn."""

    LOAD_BALANCING = "load_balancing"
    ROUND_ROBIN = "round_robin"


class Precision(StrEnum):
    """``spec.model.precision``: ``auto`` or an activation dtype (TensorRT-LLM ``dtype``), or
    ``fp8`` / ``nvfp4`` for a pre-quantized checkpoint (the dtype is then the checkpoint's)."""

    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"
    FP8 = "fp8"
    NVFP4 = "nvfp4"


class KvTransport(StrEnum):
    """``spec.engine.torch.kvTransport``: how a ``torch`` decode engine fetches a context's KV from
    the prefill engine: ``auto`` (CUDA IPC when both engines share a host, else HTTP), ``http``
    (the KV as bytes over HTTP) or ``cuda_ipc`` (mapped from the prefill engine's GPU memory)."""

    AUTO = "auto"
    HTTP = "http"
    CUDA_IPC = "cuda_ipc"


class KvLayout(StrEnum):
    """``spec.engine.torch.kvLayout``: where a ``torch`` engine's decoding sequences keep their KV:
    ``slots`` (the decode pool: one row of ``decodeSlotTokens`` per sequence, CUDA graphs) or
    ``paged`` (blocks of ``tokensPerBlock`` tokens in per-sequence block tables, the whole batch's
    attention one FlexAttention call over a paged block mask; no CUDA graphs yet)."""

    SLOTS = "slots"
    PAGED = "paged"


class SlotAttention(StrEnum):
    """``spec.engine.torch.slotAttention``: the attention of the ``slots`` layout's decode step (the
    decode pool, replayed as CUDA graphs): ``sdpa`` (scaled_dot_product_attention over the step's
    token bucket, masked to each row's length), ``flex`` (FlexAttention's decoding kernel, compiled
    on CUDA, reading only each row's blocks up to its length) or ``auto`` (the default: ``flex`` on
    CUDA when ``decodeSlotTokens`` is a multiple of its key block, 128; else ``sdpa``)."""

    AUTO = "auto"
    SDPA = "sdpa"
    FLEX = "flex"


class PagedAttention(StrEnum):
    """``spec.engine.torch.pagedAttention``: the attention of the ``paged`` layout's decode step:
    ``flex`` (FlexAttention with a paged block mask, compiled on CUDA) or ``gather`` (the fallback:
    the block tables gathered into a contiguous view, then scaled_dot_product_attention)."""

    FLEX = "flex"
    GATHER = "gather"


def choices(enum: type[StrEnum]) -> list[str]:
    """The values of ``enum``, for a command line's choices."""
    return [member.value for member in enum]
