"""``DisaggReplicaSet.spec``: the one schema source of the resource's desired state.

Field names are snake_case in Python and camelCase on the wire (``inferenceGPUs`` is spelled out).
Single-field rules (types, bounds, enums, defaults) live on the fields; cross-field rules live in
``drs_operator.api.rules`` (CEL, attached here) and ``drs_operator.validation`` (Python, which
also checks what CEL cannot express, such as tiling). ``dict[str, Any]`` fields are free-form:
the CRD keeps their unknown fields and the operator merges them (TensorRT-LLM kwargs, pod-template
overlays, volume sources, resource requirements), or, for the deprecated ``engine.simOptions``,
validates them against the typed ``engine.sim`` model.

Every block except ``model`` has defaults, so ``{model: {path: ...}, replicas: 1}`` is a complete
spec: one replica of one TP1 prefill engine, one TP1 decode engine and one frontend.
"""

from __future__ import annotations

from typing import Any, Literal

from drs_protocol.config import CamelModel
from drs_protocol.engine_config import SimSpec, TorchSpec
from drs_protocol.lifecycle import DEFAULT_DRAIN_SECONDS
from drs_protocol.prefix_lookup import DEFAULT_LOOKUP_ENGINES
from pydantic import ConfigDict, Field, model_validator

from drs_operator.api.constants import (
    DEFAULT_BASE_PORT,
    DEFAULT_ENGINE_IMAGE,
    DEFAULT_ENGINE_PORT,
    DEFAULT_FRONTEND_IMAGE,
    DEFAULT_GROUP_HOLD_SECONDS,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_MODEL_MOUNT_PATH,
    DEFAULT_NOT_READY_TOLERATION_S,
    DEFAULT_SEGMENT_LABEL,
    MAX_ENGINES_PER_ROLE,
    MAX_FRONTENDS,
    MAX_GROUP_HOLD_SECONDS,
    MAX_PORT,
    MAX_TENSOR_PARALLEL,
    MIN_PORT,
    CtxRouter,
    EngineBackend,
    GenRouter,
    Precision,
    Role,
)
from drs_operator.api.rules import ENGINE_RULES, ROLE_RULES, SPEC_RULES, schema_extra

#: A free-form object (``x-kubernetes-preserve-unknown-fields`` in the CRD).
FreeForm = dict[str, Any]


class SpecModel(CamelModel):
    """Base of the spec models: camelCase aliases, unknown fields rejected, immutable."""

    model_config = ConfigDict(frozen=True)


class ParsersSpec(SpecModel):
    """Output parsers applied by the engines (replica-wide)."""

    reasoning: str | None = Field(None, max_length=64, description="Reasoning parser name (e.g. qwen3).")
    tool: str | None = Field(None, max_length=64, description="Tool-call parser name (e.g. qwen3).")


class ModelSpec(SpecModel):
    """The model every engine of every replica serves."""

    path: str = Field(min_length=1, max_length=4096, description="Model checkpoint path inside the engine pods.")
    served_name: str | None = Field(
        None, max_length=256, description="Model name clients send and responses report (default: the path)."
    )
    tokenizer: str | None = Field(
        None, max_length=4096, description="Tokenizer path or name for frontend tokenization (default: the path)."
    )
    volume: FreeForm | None = Field(
        None,
        description="A Kubernetes volume source holding the model (e.g. persistentVolumeClaim), mounted read-only.",
    )
    mount_path: str = Field(
        DEFAULT_MODEL_MOUNT_PATH, min_length=1, max_length=4096, description="Where the model volume is mounted."
    )
    precision: Precision = Field(Precision.AUTO, description="Activation dtype of every engine.")
    max_model_len: int | None = Field(
        None, ge=1, le=10_000_000, description="Longest context (prompt + output) in tokens; default: the model's."
    )
    parsers: ParsersSpec | None = Field(None, description="Reasoning and tool-call parsers.")


class RoleSpec(SpecModel):
    """One engine role (prefill or decode) of every replica.

    A role may set only the knobs that legitimately differ between prefill and decode: the
    parallelism, gpuMemoryUtilization, maxBatchSize, maxNumTokens and trtllmKwargs (deep-merged
    over ``spec.trtllm.kwargs``). ``precision``, ``maxModelLen`` and ``parsers`` are replica-wide;
    they appear here only so that the schema can reject them with a message saying where they go.
    """

    model_config = ConfigDict(json_schema_extra=schema_extra(*ROLE_RULES))

    engines: int = Field(1, ge=1, le=MAX_ENGINES_PER_ROLE, description="Engines of this role per replica (M or K).")
    tensor_parallel_size: int = Field(
        1, ge=1, le=MAX_TENSOR_PARALLEL, description="GPUs per engine (the engine's width)."
    )
    moe_tensor_parallel_size: int | None = Field(
        None,
        ge=1,
        le=MAX_TENSOR_PARALLEL,
        description="MoE tensor parallelism; with the EP size it must multiply to TP.",
    )
    moe_expert_parallel_size: int | None = Field(
        None,
        ge=1,
        le=MAX_TENSOR_PARALLEL,
        description="MoE expert parallelism; with the MoE TP size it must multiply to TP.",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fraction of free GPU memory for the KV cache (kv_cache_config.free_gpu_memory_fraction).",
    )
    max_batch_size: int | None = Field(None, ge=1, le=1_000_000, description="TensorRT-LLM max_batch_size.")
    max_num_tokens: int | None = Field(None, ge=1, le=100_000_000, description="TensorRT-LLM max_num_tokens.")
    trtllm_kwargs: FreeForm | None = Field(
        None, description="TensorRT-LLM LLM arguments deep-merged over spec.trtllm.kwargs for this role."
    )
    template: FreeForm | None = Field(
        None,
        description="Pod-template overlay (metadata, spec) merged into this role's engine pods after spec.template.",
    )
    precision: Precision | None = Field(None, description="Not allowed here: set spec.model.precision.")
    max_model_len: int | None = Field(None, description="Not allowed here: set spec.model.maxModelLen.")
    parsers: ParsersSpec | None = Field(None, description="Not allowed here: set spec.model.parsers.")

    @property
    def width(self) -> int:
        """GPUs per engine of this role."""
        return self.tensor_parallel_size


class EngineSpec(SpecModel):
    """Which engine implementation runs in the engine pods, and its backend's options."""

    # Each backend's options are the engine config's own model (drs_protocol.engine_config), so the
    # CRD, the operator and `drs engine` read one definition; a field left out takes the engine's
    # default. simOptions is the deprecated, untyped spelling of sim: still accepted, and checked by
    # drs_operator.validation against the same model (Valid=False naming the field).
    model_config = ConfigDict(json_schema_extra=schema_extra(*ENGINE_RULES))

    backend: EngineBackend = Field(
        EngineBackend.TRTLLM,
        description=(
            "trtllm: TensorRT-LLM on GPUs; sim: the CPU test double that speaks the same protocol; "
            "torch: a reference GPU engine in PyTorch, one GPU per engine."
        ),
    )
    sim: SimSpec | None = Field(None, description="Options of the sim backend (cache, token function, latency model).")
    torch: TorchSpec | None = Field(None, description="Options of the torch backend (device, cache, KV handoff).")
    sim_options: FreeForm | None = Field(
        None, description="Deprecated: set engine.sim, which has the same fields. Exclusive with engine.sim."
    )
    drain_seconds: int = Field(
        DEFAULT_DRAIN_SECONDS,
        ge=0,
        le=3600,
        description=(
            "On stop, an engine refuses new legs and gives the legs in flight and the context states it holds this "
            "long before it exits; the pod's terminationGracePeriodSeconds is this plus 10."
        ),
    )

    def sim_settings(self) -> SimSpec | None:
        """The sim options, from ``sim`` or the deprecated ``simOptions`` (of a validated spec:
        ``drs_operator.validation`` has checked ``simOptions`` against :class:`SimSpec`)."""
        if self.sim is not None:
            return self.sim
        if self.sim_options:
            return SimSpec.model_validate(self.sim_options)
        return None


class FrontendSpec(SpecModel):
    """The CPU-only relays in front of each replica (F per replica)."""

    workers: int = Field(1, ge=1, le=MAX_FRONTENDS, description="Frontends per replica (F).")
    tokenize: bool = Field(True, description="Render the chat template and tokenize on the frontends.")
    tokenize_shadow_rate: float = Field(
        0.0, ge=0, le=1, description="Fraction of requests whose token ids are re-derived prefill-side and compared."
    )
    token_continuity: bool = Field(
        True,
        description="Begin each turn's prompt ids with the ids the policy produced (required_prefix_token_ids, else the "
        "last assistant message's prompt_token_ids + generation_token_ids), spliced as NeMo RL does: on the frontends "
        "when they tokenize, else on the engine. Off: the history is re-tokenized as text.",
    )
    base_port: int = Field(
        DEFAULT_BASE_PORT,
        ge=MIN_PORT,
        le=MAX_PORT,
        description="Frontend f of replica r listens on basePort + r*F + f.",
    )
    resources: FreeForm | None = Field(None, description="Kubernetes resource requirements of a frontend container.")
    template: FreeForm | None = Field(None, description="Pod-template overlay merged into every frontend pod.")
    hold_seconds: int = Field(
        60,
        ge=0,
        le=3600,
        description=(
            "A turn that finds no engine of a role up (its replica's or, as a fallback, another replica's) waits "
            "this long for one before it fails with 503."
        ),
    )
    group_routing: bool = Field(
        True,
        description=(
            "Place a new conversation by its opening (its tools and messages before the first assistant message) "
            "on the first prefill engine in rendezvous order of the opening's key, so the siblings of a GRPO "
            "group share one engine and its prompt is prefilled once, and a restarted or other frontend sends "
            "every later turn to that engine (docs/grpo-routing.md). Off: by rendezvous over the conversation id."
        ),
    )
    group_lookup_engines: int = Field(
        DEFAULT_LOOKUP_ENGINES,
        ge=0,
        le=64,
        description=(
            "With groupRouting: a new group's first turn goes to the first of this many prefill engines in "
            "rendezvous order of its opening whose recent prefill work (as the engines report it, the placement "
            "claimed there) stays within affinityLoadFactor times the mean, and a turn whose conversation this "
            "frontend does not know (after a restart, or sent by the replica's other frontend) asks the same "
            "engines what their prefix caches hold of it and follows the longest (docs/grpo-routing.md). "
            f"The default, {DEFAULT_LOOKUP_ENGINES}, covers every engine of a replica of up to {DEFAULT_LOOKUP_ENGINES}. "
            "0: the opening's first engine whatever the load, no lookup (no load bound)."
        ),
    )
    group_hold_seconds: float | None = Field(
        None,
        ge=0,
        le=MAX_GROUP_HOLD_SECONDS,
        description=(
            "A first turn whose opening's first turn is in its context leg on the same frontend waits for it at "
            "most this long, then reads its prompt from the prefix cache (0: no holding). Unset: "
            f"{DEFAULT_GROUP_HOLD_SECONDS:g} with groupRouting, 0 without; set above 0 it needs groupRouting."
        ),
    )
    standby: bool | None = Field(
        None,
        description=(
            "Run a second frontend process per URL (Deployment <frontend>-standby, its own pod, snowflake process id "
            "1) behind the same Service, so a killed frontend pod or process leaves its URL served. Needs pod "
            "networking. Unset: on with pod networking, off with network.hostNetwork (one process per URL there: "
            "the FrontendStandby condition says so)."
        ),
    )

    def group_hold(self) -> float:
        """The seconds a sibling is held for its group's first context leg (groupHoldSeconds, defaulted)."""
        if self.group_hold_seconds is not None:
            return self.group_hold_seconds
        return DEFAULT_GROUP_HOLD_SECONDS if self.group_routing else 0.0


class RouterSpec(SpecModel):
    """Routing inside a replica (each frontend holds its own router state)."""

    ctx: CtxRouter = Field(CtxRouter.CONVERSATION, description="Prefill-engine router; conversation is stateful.")
    gen: GenRouter = Field(GenRouter.LOAD_BALANCING, description="Decode-engine router.")
    gen_tokids_ctxbytes: bool = Field(True, description="Relay prompt token ids as base64 int32 between the legs.")
    gen_strip_message_history: bool = Field(True, description="Send only the last message on the generation leg.")
    max_sessions: int = Field(
        DEFAULT_MAX_SESSIONS, ge=1, le=100_000_000, description="Conversations the ctx router remembers (LRU)."
    )


class TrtllmSpec(SpecModel):
    """Settings shared by every TensorRT-LLM engine."""

    kwargs: FreeForm = Field(default_factory=dict, description="TensorRT-LLM LLM arguments shared by both roles.")
    engine_port: int = Field(
        DEFAULT_ENGINE_PORT,
        ge=MIN_PORT,
        le=MAX_PORT,
        description="Engine HTTP port; with hostNetwork, engine i of the plan listens on enginePort + i.",
    )


class NetworkSpec(SpecModel):
    """How engines and frontends are reached."""

    host_network: bool = Field(
        False, description="Run engines and frontends on the node's network; URLs then name node addresses."
    )


class PolicyPeer(SpecModel):
    """A networking.k8s.io/v1 NetworkPolicyPeer: who may reach the engines (at least one selector)."""

    pod_selector: FreeForm | None = Field(None, description="A label selector of pods (matchLabels/matchExpressions).")
    namespace_selector: FreeForm | None = Field(None, description="A label selector of namespaces.")
    ip_block: FreeForm | None = Field(None, description="An IPBlock: cidr and optional except.")

    @model_validator(mode="after")
    def _one_selector(self) -> PolicyPeer:
        if self.pod_selector is None and self.namespace_selector is None and self.ip_block is None:
            raise ValueError("a peer needs podSelector, namespaceSelector or ipBlock")
        if self.ip_block is not None and (self.pod_selector is not None or self.namespace_selector is not None):
            raise ValueError("ipBlock cannot be combined with podSelector or namespaceSelector")
        return self


class NetworkPolicySpec(SpecModel):
    """Per-replica NetworkPolicies the operator renders as children (opt-in; needs an enforcing CNI)."""

    enabled: bool = Field(
        False,
        description=(
            "One NetworkPolicy per replica: its engines accept only its own frontends and engines "
            "(requests and the KV handoff), the fleet's other engines (a path-less catch-up streams "
            "the desired weights from a peer of any replica), the operator's own pods (it asks each "
            "engine which weights it holds) and engineClients."
        ),
    )
    engine_clients: list[PolicyPeer] = Field(
        default_factory=list,
        max_length=32,
        description="More peers allowed to reach every engine, e.g. the trainer's refit sidecar.",
    )


class Toleration(SpecModel):
    """A Kubernetes toleration (core/v1 Toleration)."""

    key: str | None = Field(None, max_length=317)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class TopologySpec(SpecModel):
    """Which nodes the fleet may use and how they group into NVLink segments."""

    gpus_per_node: int | None = Field(
        None,
        ge=1,
        le=64,
        description="GPUs per node; when set, only nodes of that size are used and tiling is checked up front.",
    )
    segment_label: str = Field(
        DEFAULT_SEGMENT_LABEL,
        min_length=1,
        max_length=317,
        description="Node label naming a node's NVLink segment; a node without it is its own segment.",
    )
    node_selector: dict[str, str] | None = Field(
        None, max_length=64, description="Labels a node must carry to be used."
    )
    tolerations: list[Toleration] | None = Field(
        None, max_length=64, description="Taints the fleet tolerates (GPU nodes are usually tainted)."
    )
    not_ready_toleration_seconds: int = Field(
        DEFAULT_NOT_READY_TOLERATION_S,
        ge=0,
        le=86_400,
        description=(
            "How long a placed replica stays on a node that is not Ready (NotReady or Unknown, or still "
            "tainted node.kubernetes.io/not-ready or unreachable) before it moves, counted from the node's "
            "Ready transition, as a pod's toleration of those taints counts (Kubernetes' default 300). "
            "0 moves at once. New replicas never go to such a node."
        ),
    )


class ImagesSpec(SpecModel):
    """Container images of the engines and the frontends."""

    engine: str = Field(DEFAULT_ENGINE_IMAGE, min_length=1, max_length=512, description="Engine container image.")
    frontend: str = Field(DEFAULT_FRONTEND_IMAGE, min_length=1, max_length=512, description="Frontend container image.")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(None, description="Image pull policy.")


class DisaggReplicaSetSpec(SpecModel):
    """Desired state: N replicas, each M prefill + K decode engines behind F frontends."""

    model_config = ConfigDict(json_schema_extra=schema_extra(*SPEC_RULES))

    replicas: int | None = Field(
        None,
        ge=0,
        le=MAX_FRONTENDS,
        description="Number of replicas N (the scale subresource, so `kubectl scale` needs this form). Exclusive with inferenceGPUs.",
    )
    inference_gpus: int | None = Field(
        None,
        alias="inferenceGPUs",
        ge=1,
        le=1_000_000,
        description="GPU budget; N = inferenceGPUs / replica width, which must divide it. Exclusive with replicas.",
    )
    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    prefill: RoleSpec = Field(default_factory=RoleSpec, description="Prefill engines of each replica.")
    decode: RoleSpec = Field(default_factory=RoleSpec, description="Decode engines of each replica.")
    frontend: FrontendSpec = Field(default_factory=FrontendSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    trtllm: TrtllmSpec = Field(default_factory=TrtllmSpec)
    network: NetworkSpec = Field(default_factory=NetworkSpec)
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)
    topology: TopologySpec = Field(default_factory=TopologySpec)
    images: ImagesSpec = Field(default_factory=ImagesSpec)
    template: FreeForm | None = Field(None, description="Pod-template overlay merged into every engine pod.")

    def role(self, role: str) -> RoleSpec:
        """The block of ``role`` (``prefill`` or ``decode``)."""
        if role == Role.PREFILL:
            return self.prefill
        if role == Role.DECODE:
            return self.decode
        raise ValueError(f"unknown role {role!r}")

    @property
    def frontend_standby(self) -> bool:
        """Whether each frontend URL runs a standby process: ``frontend.standby``, unset meaning
        on with pod networking and off on the host network (where it cannot run)."""
        if self.frontend.standby is not None:
            return self.frontend.standby
        return not self.network.host_network

    @property
    def replica_width(self) -> int:
        """GPUs per replica: M * prefill width + K * decode width."""
        return self.prefill.engines * self.prefill.width + self.decode.engines * self.decode.width
