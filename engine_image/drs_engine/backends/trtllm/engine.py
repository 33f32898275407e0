"""The ``trtllm`` backend: TensorRT-LLM's async LLM API on GPUs.

``tensorrt_llm`` is imported only in :meth:`TrtllmBackend.start`, so importing this module (or
running the ``sim`` backend) never imports it. Everything that can be checked without a GPU — the
LLM kwargs, sampling and disaggregated params, reading result objects, the control RPCs — lives in
:mod:`.translate` and is unit-tested; this module only applies it to the real classes.
NOT RUN on a GPU in this repository (see engine_image/README.md).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import replace
from typing import Any, ClassVar

from drs_protocol.control import CollectiveInit, CollectiveUpdate, PrepareRefitInfo
from drs_protocol.nemo_rl_refit import RefitSpecError, checkpoint_files, parse_state_dict_info
from drs_protocol.trtllm_kwargs import tokens_per_block_of
from drs_protocol.weights_stream import WeightsStreamHeader

from drs_engine.backends.base import EngineBackend, LegEvent, LegFinished, LegRequest
from drs_engine.backends.trtllm.features import Features, detect_features
from drs_engine.backends.trtllm.retained import Retained, retain_dir
from drs_engine.backends.trtllm.surface import release
from drs_engine.backends.trtllm.switch import WeightsSwitch
from drs_engine.backends.trtllm.translate import (
    LLM_CLASS,
    build_control_rpc,
    build_conversation_params_kwargs,
    build_disaggregated_params_kwargs,
    build_llm_kwargs,
    build_sampling_params_kwargs,
    check_worker_results,
    finished_from_output,
    request_refusal,
    token_steps_from_output,
)
from drs_engine.config import BackendName, EngineConfig
from drs_engine.errors import BadRequestError, EngineError, NotSupportedError, UnavailableError, WeightsLoadError
from drs_engine.weights.stream import WeightsExport
from drs_engine.wire import RequestType

log = logging.getLogger("drs_engine.trtllm")


def _optional(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


class TrtllmBackend(EngineBackend):
    """TensorRT-LLM behind the engine server (a real GPU engine, not a test double)."""

    name: ClassVar[str] = BackendName.TRTLLM
    test_double: ClassVar[bool] = False

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self._llm_kwargs = build_llm_kwargs(config)
        self._version = config.weights_version
        self._llm: Any = None
        self._api: dict[str, Any] = {}
        self._features: Features | None = None
        #: the decoding legs, re-prefilled across a weights update (refit safety)
        self._switch = WeightsSwitch()
        #: the trainer-layout copy of the weights held, for peers that catch up (:mod:`.retained`)
        self._retained = Retained(retain_dir())
        #: the layout of the collective update to come (``prepare_refit_info``)
        self._refit_info: dict[str, Any] | None = None

    async def start(self) -> None:
        module_name, class_name = LLM_CLASS.rsplit(".", 1)
        llm_class = getattr(importlib.import_module(module_name), class_name)
        llmapi = importlib.import_module("tensorrt_llm.llmapi")
        memory_type = _optional("tensorrt_llm.llmapi.llm_args", "ExecutorMemoryType") or _optional(
            "tensorrt_llm._torch.virtual_memory", "ExecutorMemoryType"
        )
        sleep_config: Any = _optional("tensorrt_llm.llmapi.llm_args", "SleepConfig") or getattr(
            llmapi, "SleepConfig", None
        )
        self._api = {
            "SamplingParams": llmapi.SamplingParams,
            "DisaggregatedParams": llmapi.DisaggregatedParams,
            "ConversationParams": getattr(llmapi, "ConversationParams", None),
            "DisaggScheduleStyle": getattr(llmapi, "DisaggScheduleStyle", None),
        }
        self._features = detect_features(
            generate_async=llm_class.generate_async,
            disaggregated_params=llmapi.DisaggregatedParams,
            conversation_params=self._api["ConversationParams"],
            sleep_config=sleep_config,
            memory_type=memory_type,
        )
        kwargs = dict(self._llm_kwargs)
        if self._features.sleep and isinstance(kwargs.get("sleep_config"), dict):
            kwargs["sleep_config"] = sleep_config(**kwargs["sleep_config"])
        elif not self._features.sleep:
            kwargs.pop("sleep_config", None)
        self._llm = await asyncio.to_thread(lambda: llm_class(**kwargs))
        await self._llm.setup_async()

    async def close(self) -> None:
        if self._llm is not None:
            await asyncio.to_thread(self._llm.shutdown)
            self._llm = None

    @property
    def weights_version(self) -> str:
        return self._version

    @property
    def tokens_per_block(self) -> int:
        return tokens_per_block_of(self._llm_kwargs)

    def server_info(self) -> dict[str, Any]:
        features = self._features
        return {
            "kind": "gpu engine",
            "llm_class": LLM_CLASS,
            "tensorrt_llm_pin": release()["version"],
            "degraded_features": dict(features.degraded) if features is not None else None,
            "memory_tags": list(features.memory_tags) if features is not None else None,
            "cache_transceiver_config": self._llm_kwargs.get("cache_transceiver_config"),
            "tensor_parallel_size": self._llm_kwargs.get("tensor_parallel_size"),
            "moe_tensor_parallel_size": self._llm_kwargs.get("moe_tensor_parallel_size"),
            "moe_expert_parallel_size": self._llm_kwargs.get("moe_expert_parallel_size"),
        }

    def _require_features(self) -> Features:
        if self._features is None:
            raise UnavailableError("the TensorRT-LLM engine is not loaded")
        return self._features

    def _require_llm(self) -> Any:
        if self._llm is None:
            raise UnavailableError("the TensorRT-LLM engine is not loaded")
        return self._llm

    async def generate(self, leg: LegRequest) -> AsyncGenerator[LegEvent, None]:
        """The leg's tokens. Refit safety (:mod:`.switch`): a decoding leg that a weights update
        interrupts is submitted again over its prompt plus the tokens it has passed on (a plain
        context-and-generation request: the context a prefill engine handed over is of the old
        weights too), so every token after ``weights_boundary`` comes from the new weights."""
        self._require_llm()
        sampling = build_sampling_params_kwargs(leg.request, leg.max_tokens)
        submit = self._submission(leg)
        decoding = leg.request_type is not RequestType.CONTEXT_ONLY
        prefix_lookup = leg.request_type is not RequestType.GENERATION_ONLY
        generated: list[int] = []
        boundary: int | None = None
        while True:
            await self._switch.ready()  # no request goes in while the weights change
            version = self._version
            promise = submit(sampling)
            running = self._switch.track(promise) if decoding else None
            emitted = 0
            done = False
            outputs: AsyncIterator[Any] = promise if leg.streaming else _once(promise.aresult())
            try:
                async for output in outputs:
                    if running is not None and running.stale:
                        break  # computed while (or after) the weights changed: dropped, submitted again
                    for step in token_steps_from_output(output, emitted):
                        emitted += 1
                        generated.append(step.token_id)
                        yield step
                    finished = finished_from_output(
                        output, prompt_tokens=len(leg.prompt_token_ids), prefix_lookup=prefix_lookup
                    )
                    if finished is not None:
                        # ctx_info_endpoint stays TensorRT-LLM's own (its KV transceiver's, e.g.
                        # tcp://host:port) or absent: never this server's HTTP URL.
                        done = True
                        if boundary is not None:
                            cached = min(finished.cached_tokens, len(leg.prompt_token_ids))
                            finished = replace(finished, cached_tokens=cached, weights_boundary=boundary)
                        yield replace(finished, weights_version=version)
                        return
            finally:
                if running is not None:
                    self._switch.untrack(running)
                if not done:  # closed early (the client left, a timeout, a refit): free the executor's slot
                    if running is not None:
                        running.abort()
                    else:
                        promise.abort()  # GenerationResult.abort -> executor.abort_request(request_id)
            if running is None or not running.stale:
                return
            if len(generated) >= leg.max_tokens:  # every token came before the update: nothing to redo
                prompt_tokens = len(leg.prompt_token_ids)
                query = prompt_tokens if prefix_lookup else 0
                yield LegFinished("length", prompt_tokens, 0, query, weights_version=version)
                return
            await self._switch.settled(running)
            boundary = len(generated) if generated else None
            submit = self._submission(leg, [*leg.prompt_token_ids, *generated])
            sampling = {
                **sampling,
                "max_tokens": leg.max_tokens - len(generated),
                "min_tokens": max(0, leg.request.min_tokens - len(generated)),
            }

    def _submission(self, leg: LegRequest, restated: list[int] | None = None) -> Callable[[dict[str, Any]], Any]:
        """A function that submits the leg to TensorRT-LLM with given sampling keywords: as asked,
        or (``restated``: the prompt plus the tokens generated before a weights update) as a
        context-and-generation request over those ids, with no disaggregated params."""
        llm = self._require_llm()
        features = self._require_features()
        dp_kwargs = None
        if restated is None:
            dp_kwargs = build_disaggregated_params_kwargs(leg.request.disaggregated_params, ctx_request_id=None)
        if dp_kwargs is not None:
            if not features.ctx_usage:
                dp_kwargs.pop("ctx_usage", None)
            if not features.schedule_style:
                dp_kwargs.pop("schedule_style", None)
            elif "schedule_style" in dp_kwargs and self._api["DisaggScheduleStyle"] is not None:
                dp_kwargs["schedule_style"] = self._api["DisaggScheduleStyle"](dp_kwargs["schedule_style"])
        extra: dict[str, Any] = {}
        cp_kwargs = build_conversation_params_kwargs(leg.conversation_id)
        if cp_kwargs is not None and features.conversation_params:
            extra["conversation_params"] = self._api["ConversationParams"](**cp_kwargs)
        inputs = leg.prompt_token_ids if restated is None else restated

        def submit(sampling: dict[str, Any]) -> Any:
            try:
                return llm.generate_async(
                    inputs=inputs,
                    sampling_params=self._api["SamplingParams"](**sampling),
                    streaming=leg.streaming,
                    disaggregated_params=None if dp_kwargs is None else self._api["DisaggregatedParams"](**dp_kwargs),
                    **extra,
                )
            except Exception as exc:  # TensorRT-LLM refuses requests over its limits when they are submitted
                refusal = request_refusal(exc)
                if refusal is None:
                    raise
                raise refusal from exc

        return submit

    async def export_context(self, ctx_request_id: int) -> dict[str, Any]:
        raise NotSupportedError(
            "the trtllm backend moves KV with TensorRT-LLM's cache transceiver (cache_transceiver_config), "
            "not over this route"
        )

    async def _rpc(
        self, op: str, params: dict[str, Any] | None = None, *, error: type[EngineError] = EngineError
    ) -> list[Any]:
        method, kwargs = build_control_rpc(op, params)
        llm = self._require_llm()
        try:
            result: list[Any] = await llm.collective_rpc(method, kwargs=kwargs)
            check_worker_results(method, result)
        except EngineError:
            raise
        except Exception as exc:  # a worker raised or returned False: report it and keep serving
            raise error(f"{method} failed on the TensorRT-LLM workers: {type(exc).__name__}: {exc}") from exc
        return result

    async def measure_digest(self) -> str | None:
        """The digest every worker reports of what it handed the engine (they must agree; None
        before any update, or when TensorRT-LLM is not loaded)."""
        if self._llm is None:
            return None
        digests = set(await self._rpc("weights_digest"))
        if len(digests) > 1:
            raise EngineError(f"the TensorRT-LLM workers hold different weights digests: {sorted(map(str, digests))}")
        return next(iter(digests), None)

    async def load_weights(self, path: str, version: str) -> dict[str, Any]:
        if not os.path.exists(path):
            raise WeightsLoadError(f"weights path {path!r} does not exist", param="path")
        try:  # what the worker extension will read: a path it would refuse interrupts no leg
            checkpoint_files(path)
        except OSError as exc:
            raise WeightsLoadError(f"weights path {path!r}: {exc}", param="path") from exc
        async with self._switch.update("load_weights"):
            await self._rpc("load_weights", {"path": path}, error=WeightsLoadError)
            await self._rpc("reset_prefix_cache")
            previous, self._version = self._version, version
        self._retained.after_path_load()
        return {"version": version, "previous_version": previous}

    async def export_weights(self) -> WeightsExport:
        """The kept copy of the last collective update or peer load (:mod:`.retained`)."""
        return self._retained.export(await self.measure_digest())

    async def load_weights_from_stream(
        self, header: WeightsStreamHeader, pieces: AsyncIterator[bytes], version: str
    ) -> dict[str, Any]:
        """Write the peer's stream to a file (its digest checked as it arrives: other bytes touch
        nothing), then have the workers load that file in the stream's layout."""
        info = await self._retained.receive(header, pieces)
        path = str(self._retained.incoming)
        try:
            async with self._switch.update("load_weights_from_stream"):
                self._retained.prepare()
                await self._rpc(
                    "load_weights_from_stream", {"path": path, "state_dict_info": info}, error=WeightsLoadError
                )
                await self._rpc("reset_prefix_cache")
                previous, self._version = self._version, version
        except EngineError:
            self._retained.incoming.unlink(missing_ok=True)
            raise
        held = await self.measure_digest()
        if held != header.digest:
            raise WeightsLoadError(f"the workers hold digest {held} after loading the peer's {header.digest}")
        self._retained.adopt_incoming(header)
        return {"version": version, "previous_version": previous, "source": "peer stream", "bytes": header.nbytes}

    async def init_collective(self, params: CollectiveInit) -> dict[str, Any]:
        await self._rpc("init_collective", params.model_dump(exclude={"timeout_s"}))
        return {"initialized": True, "world_size": params.world_size}

    async def prepare_refit_info(self, params: PrepareRefitInfo) -> dict[str, Any]:
        try:
            parse_state_dict_info(params.state_dict_info)
        except RefitSpecError as exc:
            raise BadRequestError(str(exc), param="state_dict_info") from exc
        await self._rpc("prepare_refit_info", {"state_dict_info": params.state_dict_info})
        self._refit_info = dict(params.state_dict_info)
        return {"prepared": True, "tensors": len(params.state_dict_info)}

    async def update_weights_from_collective(self, params: CollectiveUpdate) -> dict[str, Any]:
        async with self._switch.update("update_weights_from_collective"):
            retain_to = self._retained.prepare()
            await self._rpc(
                "update_weights_from_collective",
                {"drain": params.drain, "recompute_kv": params.recompute_kv, "retain_to": retain_to},
                error=WeightsLoadError,
            )
            await self._rpc("reset_prefix_cache")
            previous, self._version = self._version, params.version
        if self._refit_info is not None:
            self._retained.kept(self._refit_info, await self.measure_digest())
        return {"version": params.version, "previous_version": previous}

    async def abort_collective(self, reason: str) -> dict[str, Any]:
        raise NotSupportedError(
            "abort_collective: TensorRT-LLM cannot abort an NCCL operation in flight on its workers; "
            "a hung broadcast ends only with the worker (the sidecar's deadline still answers the trainer)"
        )

    async def reset_prefix_cache(self) -> dict[str, Any]:
        await self._rpc("reset_prefix_cache")
        return {"reset": True}

    def _memory_tags(self, tags: list[str]) -> list[str]:
        features = self._require_features()
        if not features.sleep:
            raise NotSupportedError(f"memory release/resume: {features.degraded.get('sleep_config_unavailable')}")
        unknown = [t for t in tags if t not in features.memory_tags]
        if unknown:
            raise BadRequestError(
                f"tags: unknown memory tag(s) {unknown} (known: {list(features.memory_tags)})", param="tags"
            )
        return list(tags) or list(features.memory_tags)

    async def release_memory(self, tags: list[str]) -> dict[str, Any]:
        released = self._memory_tags(tags)
        # TensorRT-LLM's release frees the KV memory but not the prefix-reuse index: reset it first.
        await self._rpc("reset_prefix_cache")
        await self._require_llm().release(released)
        return {"released": released}

    async def resume_memory(self, tags: list[str]) -> dict[str, Any]:
        resumed = self._memory_tags(tags)
        await self._require_llm().resume(resumed)
        return {"resumed": resumed}

    async def start_profile(self) -> dict[str, Any]:
        await self._rpc("start_profile")
        return {"profiling": True}

    async def stop_profile(self) -> dict[str, Any]:
        await self._rpc("stop_profile")
        return {"profiling": False}


async def _once(awaitable: Any) -> AsyncIterator[Any]:
    yield await awaitable
