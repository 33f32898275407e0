"""The interface between the engine server and a backend (TensorRT-LLM, or the ``sim`` test double).

The server does everything HTTP: parsing and validating requests, templating and tokenizing,
admission (max batch size), sleep gating, metrics, and building OpenAI responses. A backend gets a
:class:`LegRequest` with the prompt already as token ids and yields :class:`TokenStep` events,
then exactly one :class:`LegFinished`. Control operations return a JSON-able dict describing what
was done, or raise an :class:`~drs_engine.errors.EngineError` (``NotSupportedError`` → 501 for an
op the backend does not offer).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, Protocol

from drs_protocol.control import CollectiveInit, CollectiveUpdate, IpcUpdate, PrepareRefitInfo
from drs_protocol.prefix_lookup import PrefixHeld
from drs_protocol.weights_stream import WeightsStreamHeader

from drs_engine.errors import NotSupportedError
from drs_engine.weights.stream import WeightsExport
from drs_engine.wire import EngineRequest, RequestType

#: The memory tags of ``release_memory``/``resume_memory`` a backend that owns its memory knows
#: (``sim``, ``torch``); a call without tags covers them all. TensorRT-LLM names its own.
ALL_MEMORY_TAGS: Final = ("model", "kv_cache")


@dataclass(frozen=True, slots=True)
class LegRequest:
    """One leg of a turn, ready for a backend."""

    request_type: RequestType
    prompt_token_ids: list[int]
    max_tokens: int
    request: EngineRequest
    logprobs: bool
    top_logprobs: int
    conversation_id: str | None
    streaming: bool
    #: The server's ``disagg_request_id``-aware id for a context-only leg (``ctx_request_id``).
    ctx_request_id: int | None = None
    #: ``stop`` strings with their token ids (matched on ids, as TensorRT-LLM's stop words).
    stop_sequences: tuple[tuple[str, tuple[int, ...]], ...] = ()
    #: ``stop_sequences`` by their last token id, in request order, and the ``stop_token_ids``:
    #: a generated token is checked against the stops it can end, not all of them.
    _stops_ending: Mapping[int, tuple[tuple[str, tuple[int, ...]], ...]] = field(init=False, repr=False)
    _stop_ids: frozenset[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        ending: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
        for text, ids in self.stop_sequences:
            if ids:
                ending.setdefault(ids[-1], []).append((text, ids))
        object.__setattr__(self, "_stops_ending", {last: tuple(stops) for last, stops in ending.items()})
        object.__setattr__(self, "_stop_ids", frozenset(self.request.stop_token_ids or ()))

    def stop_after(self, generated: Sequence[int]) -> tuple[bool, str | int | None]:
        """Whether ``generated``'s last token ends the leg by a stop token id (its id) or a stop
        string (its text), the first in request order; ``(False, None)`` if neither."""
        token = generated[-1]
        if token in self._stop_ids:
            return True, token
        for text, ids in self._stops_ending.get(token, ()):
            if len(generated) >= len(ids) and tuple(generated[-len(ids) :]) == ids:
                return True, text
        return False, None


@dataclass(frozen=True, slots=True)
class TokenStep:
    """One generated token."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class ContextHandoff:
    """What a context-only leg hands to the decode engine (the engine-made part of its
    ``disaggregated_params``; the server adds the relayed fields)."""

    ctx_request_id: int
    first_gen_tokens: list[int]
    encoded_opaque_state: str | None = None
    first_gen_log_probs: list[Any] | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | None = None


@dataclass(frozen=True, slots=True)
class LegFinished:
    """The end of a leg. ``prefix_query_tokens`` is 0 when the leg did no prefix-cache lookup."""

    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    prefix_query_tokens: int
    stop_reason: int | str | None = None
    handoff: ContextHandoff | None = None
    #: The weights version that produced the leg's last tokens (None: the backend does not say).
    weights_version: str | None = None
    #: Tokens produced before the last weights switch inside this leg (None: no switch). A backend
    #: that loads weights while a leg decodes must re-prefill the prompt plus the tokens generated
    #: so far under the new weights and resume, so that no token after the switch is computed on
    #: KV of the old weights (refit safety); a backend that cannot must refuse the load while legs run.
    weights_boundary: int | None = None


LegEvent = TokenStep | LegFinished


class Picked(Protocol):
    """A token a backend picked, with what a response may report about it."""

    @property
    def token_id(self) -> int: ...
    @property
    def logprob(self) -> float | None: ...
    @property
    def top_logprobs(self) -> tuple[tuple[int, float], ...]: ...


def token_step(picked: Picked, leg: LegRequest) -> TokenStep:
    """The :class:`TokenStep` of ``picked`` (log-probabilities only when the leg asked for them)."""
    if not leg.logprobs:
        return TokenStep(token_id=picked.token_id)
    return TokenStep(token_id=picked.token_id, logprob=picked.logprob, top_logprobs=picked.top_logprobs)


def restate_after_refit(prompt: list[int], generated: list[int], computed: int | None = None) -> tuple[list[int], int]:
    """Refit safety, the one rule every backend follows: when the weights change between two decode
    steps of a leg, the leg's KV is dropped and ``prompt`` plus the tokens generated so far (the
    first ``computed`` of them when given: the ids whose KV the leg holds) are prefilled again under
    the new weights before the next step. Returns those ids and the leg's ``weights_boundary`` (how
    many tokens the old weights produced)."""
    ids = [*prompt, *generated]
    return (ids if computed is None else ids[:computed]), len(generated)


@dataclass(frozen=True, slots=True)
class BinaryExport:
    """A context handed over as one binary body (``GET /v1/disagg/kv/{id}?transport=…``)."""

    length: int
    chunks: AsyncIterator[bytes | memoryview]
    media_type: str = "application/octet-stream"


def finish_after(leg: LegRequest, generated: list[int], eos_token_id: int) -> tuple[str | None, int | str | None]:
    """``(finish_reason, stop_reason)`` once ``generated`` exist, else ``(None, None)``: a stop
    token id, EOS, a stop string (matched on its token ids, as TensorRT-LLM's stop words are),
    or ``max_tokens``."""
    request = leg.request
    may_stop = len(generated) >= request.min_tokens
    if may_stop:
        stopped, reason = leg.stop_after(generated)
        if stopped and isinstance(reason, int):
            return "stop", reason
        if generated[-1] == eos_token_id and not request.ignore_eos:
            return "stop", None
        if stopped:
            return "stop", reason
    if len(generated) >= leg.max_tokens:
        return "length", None
    return None, None


class EngineBackend(abc.ABC):
    """A model behind the engine server."""

    #: ``trtllm``, ``torch`` or ``sim``.
    name: ClassVar[str]
    #: True for the sim: it is a test and benchmark double, and says so everywhere.
    test_double: ClassVar[bool]
    #: True: a stream's chunk carries every token that arrived since the last send
    #: (:mod:`drs_engine.server.readahead`); False: one chunk per token.
    stream_runs: ClassVar[bool] = False

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model; the server reports healthy only after this returns."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release everything (idempotent)."""

    @property
    @abc.abstractmethod
    def weights_version(self) -> str:
        """The version of the weights being served."""

    @property
    @abc.abstractmethod
    def tokens_per_block(self) -> int: ...

    @abc.abstractmethod
    def server_info(self) -> dict[str, Any]:
        """Backend facts for ``GET /server_info`` (the server adds role, limits, versions)."""

    @abc.abstractmethod
    def generate(self, leg: LegRequest) -> AsyncGenerator[LegEvent, None]:
        """Run one leg: token steps, then exactly one :class:`LegFinished`."""

    def pending_handoffs(self) -> int:
        """Context states left for decode engines and not fetched yet (a draining engine waits for them).

        0 for a backend whose KV moves by its own transceiver."""
        return 0

    @abc.abstractmethod
    async def export_context(self, ctx_request_id: int) -> dict[str, Any]:
        """Hand over (and forget) a context state for ``GET /v1/disagg/kv/{ctx_request_id}``."""

    async def export_context_frame(
        self, ctx_request_id: int, transport: str, *, copy_event: str | None = None, prompt_digest: bool = False
    ) -> BinaryExport:
        """Hand over (and forget) a context's KV as a binary frame over ``transport`` (torch backend);
        ``copy_event``: :data:`drs_protocol.routes.KV_COPY_EVENT_PARAM`; ``prompt_digest``:
        :data:`drs_protocol.routes.KV_PROMPT_DIGEST_PARAM`."""
        raise NotSupportedError(f"the {self.name} backend hands contexts over as JSON (GET without ?transport=)")

    def prefix_held(self, prompt_ids: Sequence[int]) -> PrefixHeld:
        """How many leading full blocks of ``prompt_ids`` the prefix cache holds now, under the
        weights served now (``drs_protocol.prefix_lookup``); no LRU touch, no counter."""
        raise NotSupportedError(f"the {self.name} backend cannot say which prompt blocks its cache holds")

    async def measure_digest(self) -> str | None:
        """The :mod:`drs_protocol.weights_digest` of the weights held now, computed from the
        bytes themselves (the server calls it after start and after every change of weights);
        None for a backend that computes none."""
        return None

    @abc.abstractmethod
    async def load_weights(self, path: str, version: str) -> dict[str, Any]:
        """Read the checkpoint at ``path`` into the weights and serve them as ``version``."""

    async def load_weights_at(self, path: str, version: str, cut_over: Callable[[], Awaitable[None]]) -> dict[str, Any]:
        """:meth:`load_weights` at a refit's cut-over: ``cut_over()`` returns at that instant, and
        nothing of the new weights may serve before it. A backend that can read and check them
        into a copy that serves nothing (``sim``) does that first and only swaps after it; this
        default waits, then loads (``torch``, ``trtllm``: their loads change the served weights)."""
        await cut_over()
        return await self.load_weights(path, version)

    async def export_weights(self) -> WeightsExport:
        """The weights held now, as a peer catching up receives them (``GET /control/weights/stream``):
        their layout and bytes in order (:mod:`drs_engine.weights.stream`)."""
        raise NotSupportedError(f"the {self.name} backend cannot stream its weights to a peer")

    async def load_weights_from_stream(
        self, header: WeightsStreamHeader, pieces: AsyncIterator[bytes], version: str
    ) -> dict[str, Any]:
        """Take a peer's weights (``pieces``: exactly ``header.nbytes``) and serve them as
        ``version``, but only once their digest, computed here over what arrived, is
        ``header.digest``: on any failure (a short stream, other bytes) the weights held before
        stay, untouched (:class:`~drs_engine.errors.WeightsLoadError`)."""
        raise NotSupportedError(f"the {self.name} backend cannot load weights from a peer")

    @abc.abstractmethod
    async def init_collective(self, params: CollectiveInit) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def prepare_refit_info(self, params: PrepareRefitInfo) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def update_weights_from_collective(self, params: CollectiveUpdate) -> dict[str, Any]: ...

    async def abort_collective(self, reason: str) -> dict[str, Any]:
        """Leave the collective group at once (called beside an update in flight, never queued
        behind it): ``{"aborted": bool}``, whether there was a group. A backend with no group has
        nothing to abort."""
        return {"aborted": False}

    async def update_weights_from_ipc(self, params: IpcUpdate) -> dict[str, Any]:
        """The colocated refit: copy the trainer's CUDA-IPC-shared packed buffers into the weights."""
        raise NotSupportedError(
            f"update_weights_from_ipc (the colocated CUDA IPC refit) is not supported by the {self.name} backend; "
            "the torch backend offers it (the trtllm backend refits by collective broadcast or from a path)"
        )

    @abc.abstractmethod
    async def reset_prefix_cache(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def release_memory(self, tags: list[str]) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def resume_memory(self, tags: list[str]) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def start_profile(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def stop_profile(self) -> dict[str, Any]: ...
