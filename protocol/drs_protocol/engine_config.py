"""The engine config: what the operator renders into every engine pod and ``drs engine`` parses.

``drs engine --config FILE`` reads this model from YAML or JSON (``drs_engine.config``); the
operator constructs it per role and renders it into the role's ConfigMap
(``DRS_ENGINE_CONFIG_JSON``). Keys are camelCase, snake_case accepted (:mod:`drs_protocol.config`).

Example (the shape the operator writes for a decode engine of a MoE model)::

    role: decode
    backend: trtllm
    model: {path: /models/qwen3-30b-a3b, maxModelLen: 32768, precision: bfloat16}
    tensorParallelSize: 2
    moeTensorParallelSize: 1
    moeExpertParallelSize: 2
    gpuMemoryUtilization: 0.85
    maxBatchSize: 256
    maxNumTokens: 8192
    cacheTransceiver: {backend: NIXL}
    trtllmKwargs: {kv_cache_config: {enable_block_reuse: true}}   # already deep-merged
"""

from __future__ import annotations

from typing import Any, Final, Self

from pydantic import ConfigDict, Field, field_validator, model_validator

from drs_protocol.config import ConfigModel
from drs_protocol.enums import EngineBackend, KvLayout, KvTransport, PagedAttention, Precision, Role, SlotAttention
from drs_protocol.lifecycle import DEFAULT_DRAIN_SECONDS
from drs_protocol.limits import (
    DEFAULT_ENGINE_MAX_REQUEST_BYTES,
    DEFAULT_MAX_MODEL_LEN,
    FRONTEND_MAX_REQUEST_BYTES,
    engine_max_request_bytes,
)
from drs_protocol.trtllm_kwargs import tokens_per_block_of

#: Largest request body the serving routes accept by default (bytes); larger gets 413.
DEFAULT_MAX_REQUEST_BYTES: Final = DEFAULT_ENGINE_MAX_REQUEST_BYTES
DEFAULT_PORT: Final = 8000
#: The sim engine's prefix-cache block size (tokens) unless ``sim.tokensPerBlock`` says otherwise.
SIM_DEFAULT_TOKENS_PER_BLOCK: Final = 32
#: Model label of a sim engine started without a config file.
SIM_DEFAULT_MODEL: Final = "sim-qwen3"
#: Short dtype names an engine config may use for a :class:`Precision`.
PRECISION_ALIASES: Final = {"bf16": Precision.BFLOAT16, "fp16": Precision.FLOAT16, "fp32": Precision.FLOAT32}


class ModelSpec(ConfigModel):
    """The model every engine of a replica serves (replica-wide settings)."""

    path: str = Field(description="Checkpoint directory (HF layout) or hub id for TensorRT-LLM; any label for sim.")
    tokenizer: str | None = Field(
        default=None,
        description="Tokenizer directory; default: the model path (trtllm) or the bundled Qwen3 tokenizer (sim).",
    )
    max_model_len: int = Field(
        default=DEFAULT_MAX_MODEL_LEN, ge=2, description="Longest prompt + completion, in tokens."
    )
    precision: Precision = Field(
        default=Precision.BFLOAT16,
        description="auto | bfloat16 | float16 | float32 | fp8 | nvfp4 (bf16, fp16, fp32 and torch.<dtype> accepted).",
    )
    served_name: str | None = Field(default=None, description="Model name echoed in responses; default: the path.")

    @field_validator("precision", mode="before")
    @classmethod
    def _precision_alias(cls, value: Any) -> Any:
        """``bf16`` / ``fp16`` / ``fp32``, a ``torch.`` prefix and any case name the same Precision."""
        if isinstance(value, str):
            name = value.strip().lower().removeprefix("torch.")
            return PRECISION_ALIASES.get(name, name)
        return value


class CacheTransceiverSpec(ConfigModel):
    """TensorRT-LLM's ``cache_transceiver_config``: how KV moves from prefill to decode engines."""

    model_config = ConfigDict(extra="allow")

    backend: str = Field(default="DEFAULT", description="DEFAULT | UCX | NIXL | MOONCAKE | MPI.")
    max_tokens_in_buffer: int | None = Field(default=None, ge=1)


class SimSpec(ConfigModel):
    """The ``sim`` backend (a test double for a GPU engine): cache, token function and latency model."""

    speed: float = Field(
        default=1.0,
        ge=0.0,
        description="Multiplier on every simulated duration: 1.0 realistic ratios, 0 no sleeping at all (tests).",
    )
    tokens_per_block: int = Field(
        default=SIM_DEFAULT_TOKENS_PER_BLOCK, ge=1, description="Prefix-cache block size in tokens."
    )
    cache_capacity_tokens: int = Field(default=1_048_576, ge=0, description="Prefix-cache capacity (LRU), in tokens.")
    vocab_size: int | None = Field(
        default=None, ge=2, description="Token ids are drawn from [0, vocabSize); default: the tokenizer's base vocab."
    )
    eos_token_id: int | None = Field(default=None, ge=0, description="Default: the tokenizer's EOS token.")
    eos_probability: float = Field(default=0.02, ge=0.0, le=1.0, description="Chance that a step emits EOS.")
    prefill_seconds_per_token: float = Field(default=5e-5, ge=0.0, description="Per UNCACHED prompt token.")
    decode_seconds_per_token: float = Field(default=0.015, ge=0.0, description="One decode step with batch 1.")
    decode_seconds_per_batch_slot: float = Field(
        default=0.0002, ge=0.0, description="Added to a decode step per other in-flight decode."
    )
    weights_load_seconds: float = Field(default=2.0, ge=0.0, description="Simulated time of one weights load.")
    fault_load_moves_nothing: bool = Field(
        default=False,
        description="Injected fault (tests): a weights load answers success under the new version and keeps "
        "the bytes it had (the digest shows it).",
    )
    kv_store_capacity: int = Field(default=4096, ge=1, description="Context states kept for decode engines to fetch.")
    kv_store_ttl_seconds: float = Field(default=300.0, gt=0.0, description="Unfetched context states expire after.")


#: FlexAttention's key block in the slot pool's step: ``decodeSlotTokens`` a multiple of it with ``flex``
SLOT_FLEX_BLOCK: Final = 128
#: ``torch.decodeStepsPerJob``'s default. On one H100 (2026-12-07, ``bench/gpu_disagg.py --decode-only
#: --anchor --rounds 2 --kv-layout slots,slots-runs``, docs/results.md) runs of up to 8 steps served
#: 1.15x the decode tokens/s of one step a job at 1 stream, 1.19x at 8, 1.27x at 32, TTFT no worse.
DEFAULT_DECODE_STEPS_PER_JOB: Final = 8


class TorchSpec(ConfigModel):
    """The ``torch`` backend (a reference GPU engine in PyTorch, one GPU per engine)."""

    device: str | None = Field(
        default=None,
        description="cuda, cuda:N or cpu; default: cuda:$LOCAL_RANK (else cuda:0) when CUDA is there, else cpu.",
    )
    tokens_per_block: int = Field(default=64, ge=1, description="Prefix-cache block size in tokens.")
    cache_capacity_tokens: int = Field(
        default=65536,
        ge=0,
        description=(
            "Prefix-cache capacity (LRU), in tokens, with kvLayout slots; with kvLayout paged the cache is the "
            "block store's idle blocks (maxDecodeBatch x decodeSlotTokens tokens) and 0 only turns it off."
        ),
    )
    kv_transport: KvTransport = Field(
        default=KvTransport.AUTO,
        description="How a decode engine fetches KV: auto (CUDA IPC on the same host, else HTTP), http, cuda_ipc.",
    )
    kv_store_capacity: int = Field(default=256, ge=1, description="Context KVs kept for decode engines to fetch.")
    kv_store_ttl_seconds: float = Field(default=120.0, gt=0.0, description="Unfetched context KVs expire after.")
    max_decode_batch: int = Field(default=64, ge=1, description="Sequences in one batched decode step.")
    decode_growth_tokens: int = Field(default=256, ge=1, description="KV capacity added at a time while decoding.")
    decode_steps_per_job: int = Field(
        default=DEFAULT_DECODE_STEPS_PER_JOB,
        ge=1,
        le=64,
        description=(
            "Decode steps the GPU thread runs in a row while the batch is unchanged and no other job waits, each "
            "step's tokens streamed as it ends; 1: one step per job, the event loop between steps (the default "
            "before 2026-12-07)."
        ),
    )
    decode_slot_tokens: int = Field(
        default=2048,
        ge=1,
        description=(
            "Tokens of KV per slot of the decode pool (maxDecodeBatch slots, preallocated on the GPU); a longer "
            "sequence decodes outside the pool, without CUDA graphs."
        ),
    )
    kv_layout: KvLayout = Field(
        default=KvLayout.SLOTS,
        description=(
            "Decoding KV layout: slots (the decode pool, CUDA graphs) or paged (blocks of tokensPerBlock tokens, "
            "maxDecodeBatch x decodeSlotTokens tokens in all, batched FlexAttention; no CUDA graphs)."
        ),
    )
    slot_attention: SlotAttention = Field(
        default=SlotAttention.AUTO,
        description=(
            "The slots layout's attention: sdpa (scaled_dot_product_attention over the step's token bucket), "
            "flex (FlexAttention's decoding kernel, compiled on CUDA; decodeSlotTokens a multiple of 128) or auto "
            "(flex on CUDA when decodeSlotTokens allows, else sdpa)."
        ),
    )
    paged_attention: PagedAttention = Field(
        default=PagedAttention.FLEX,
        description="The paged layout's attention: flex (FlexAttention, paged block mask) or gather (+ SDPA).",
    )
    cuda_graphs: bool = Field(default=True, description="Replay the pooled decode step as CUDA graphs (on CUDA).")
    compile_decode: bool = Field(
        default=True,
        description=(
            "Fuse the pooled decode step's elementwise chains with torch.compile (inductor; on CUDA), compiled "
            "during the engine's warm-up, before it reports ready."
        ),
    )
    kv_handoff_arena_bytes: int = Field(
        default=8 << 30,
        ge=0,
        description=(
            "GPU bytes a prefill engine sets aside (on first use) for context KV awaiting same-host decode "
            "engines, which copy it by CUDA IPC mapped once; 0: none (each context's own handle)."
        ),
    )

    @model_validator(mode="after")
    def _check_slot_attention(self) -> Self:
        if self.slot_attention is SlotAttention.FLEX and self.decode_slot_tokens % SLOT_FLEX_BLOCK:
            raise ValueError(
                f"decodeSlotTokens must be a multiple of {SLOT_FLEX_BLOCK} with slotAttention flex "
                f"(FlexAttention's key block), got {self.decode_slot_tokens}"
            )
        return self

    def slot_attention_on(self, device_type: str) -> SlotAttention:
        """``slotAttention`` resolved for a device type (``auto``: flex on CUDA where it can run)."""
        if self.slot_attention is not SlotAttention.AUTO:
            return self.slot_attention
        flex = device_type == "cuda" and self.decode_slot_tokens % SLOT_FLEX_BLOCK == 0
        return SlotAttention.FLEX if flex else SlotAttention.SDPA


class EngineConfig(ConfigModel):
    """One engine server: its role, backend, model, parallelism and serving limits."""

    role: Role = Role.PREFILL
    backend: EngineBackend = EngineBackend.TRTLLM
    model: ModelSpec
    weights_version: str = Field(default="0", description="Version reported until the first load.")
    tensor_parallel_size: int = Field(default=1, ge=1)
    moe_tensor_parallel_size: int | None = Field(default=None, ge=1)
    moe_expert_parallel_size: int | None = Field(default=None, ge=1)
    gpu_memory_utilization: float | None = Field(
        default=None, gt=0.0, le=1.0, description="kv_cache_config.free_gpu_memory_fraction."
    )
    max_batch_size: int = Field(default=256, ge=1, description="Requests in flight at once; the rest queue.")
    max_num_tokens: int = Field(default=8192, ge=1)
    trtllm_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra LLM(...) kwargs, already deep-merged; win over derived ones."
    )
    cache_transceiver: CacheTransceiverSpec | None = None
    sim: SimSpec = Field(default_factory=SimSpec)
    torch: TorchSpec = Field(default_factory=TorchSpec)
    host: str = "0.0.0.0"
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535)
    advertise_url: str | None = Field(
        default=None, description="URL peers use to reach this engine (ctx_info_endpoint); default http://HOST:PORT."
    )
    max_request_bytes: int | None = Field(
        default=None,
        ge=1024,
        description=(
            "Largest body of a serving route (bytes; larger gets 413); default: what a frontend at its default "
            "limit forwards for this maxModelLen (drs_protocol.limits.engine_max_request_bytes)."
        ),
    )
    drain_seconds: float = Field(
        default=DEFAULT_DRAIN_SECONDS,
        ge=0.0,
        description="On SIGTERM: seconds in-flight legs and unfetched context states get before the engine exits.",
    )
    strict_trtllm_responses: bool = Field(
        default=False,
        description=(
            "Answer only fields TensorRT-LLM's own response models declare (a stock OpenAIDisaggServer can "
            "front the engine); drops chat choices' token_ids, which NeMo-Gym and the drs frontend read."
        ),
    )

    @model_validator(mode="after")
    def _check_moe_split(self) -> Self:
        tp, mtp, mep = self.tensor_parallel_size, self.moe_tensor_parallel_size, self.moe_expert_parallel_size
        if mtp is not None and mep is not None and mtp * mep != tp:
            raise ValueError(
                f"moeTensorParallelSize * moeExpertParallelSize must equal tensorParallelSize: {mtp} * {mep} != {tp}"
            )
        if self.backend is EngineBackend.TORCH and (tp != 1 or (mtp or 1) != 1 or (mep or 1) != 1):
            raise ValueError(
                f"tensorParallelSize: the torch backend runs one GPU per engine, so it must be 1 (got {tp}); "
                "wider engines need the trtllm backend"
            )
        return self

    def request_bytes_limit(self) -> int:
        """``maxRequestBytes``, else derived from the default frontend limit and ``maxModelLen``."""
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return engine_max_request_bytes(FRONTEND_MAX_REQUEST_BYTES, self.model.max_model_len)

    def tokens_per_block(self) -> int:
        """The prefix-cache block size (tokens) of this engine's backend: the granularity its cache
        hits come in, which a frontend's prefix router must hash by (``prefixBlockTokens``)."""
        if self.backend is EngineBackend.SIM:
            return self.sim.tokens_per_block
        if self.backend is EngineBackend.TORCH:
            return self.torch.tokens_per_block
        return tokens_per_block_of(self.trtllm_kwargs)

    def resolved_advertise_url(self) -> str:
        """Where peers reach this engine: ``advertiseUrl``, else ``http://HOST:PORT``."""
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def served_model_name(self) -> str:
        return self.model.served_name or self.model.path
