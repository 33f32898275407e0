"""CONTRACT TEST DOUBLE of ``tensorrt_llm._torch.async_llm.AsyncLLM`` (see ../../README.md).

Strict where TensorRT-LLM is strict: constructor keywords outside the recorded surface, generate
arguments of the wrong type, RPCs to methods the configured worker extension does not define (or
with arguments its signature does not bind), unknown memory tags, and release/resume without a
sleep config all raise. Behaviour is a small deterministic model: tokens are a hash of (weights,
prompt, tokens so far), each computed as the request reaches it (``TRTLLM_DOUBLE_STEP_S`` per
streamed step), and a hash of other bytes when the weights changed since the request's prefill
(its KV is stale: what TensorRT-LLM does with a request in flight across an update); a context-only leg returns one token and its state in ``opaque_state``; a
generation-only leg verifies that state; loads and collective updates change the weights.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from pathlib import Path
from typing import Any

from tensorrt_llm._surface import OLDER, record, surface
from tensorrt_llm.executor.result import GenerationResult, Logprob
from tensorrt_llm.llmapi import DisaggregatedParams, SamplingParams
from tensorrt_llm.llmapi.llm_args import ExecutorMemoryType

VOCAB = 50_000
BLOCK = 32


def _digest(*parts: Any) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


class AsyncLLM:
    def __init__(self, **kwargs: Any) -> None:
        allowed = set(surface()["llm"]["kwargs"])
        unknown = sorted(set(kwargs) - allowed)
        if unknown:
            raise TypeError(f"AsyncLLM got unexpected keyword argument(s) {unknown}")
        if "model" not in kwargs:
            raise TypeError("AsyncLLM missing required argument 'model'")
        sleep_config = kwargs.get("sleep_config")
        if sleep_config is not None and type(sleep_config).__name__ != "SleepConfig":
            raise TypeError(f"sleep_config must be a SleepConfig, got {type(sleep_config).__name__}")
        self.kwargs = kwargs
        self.world = int(kwargs.get("tensor_parallel_size", 1))
        self.extension = self._extension(
            kwargs.get("ray_worker_extension_cls", "tensorrt_llm.llmapi.rlhf_utils.WorkerExtension")
        )
        self.weights = _digest("initial", kwargs["model"])
        #: The bytes the last completed update handed over (the extension's ``weights_digest`` is
        #: the drs digest of them; None before any update, as in the real extension).
        self.handed: bytes | None = None
        self.seen_blocks: set[bytes] = set()
        self.asleep: set[str] = set()
        self.refit: dict[str, Any] = {}
        self.ready = False
        self.request_ids = 1
        record("init", kwargs=sorted(kwargs))

    @staticmethod
    def _extension(path: str) -> type[Any]:
        module, _, name = path.rpartition(".")
        cls: type[Any] = getattr(importlib.import_module(module), name)
        return cls

    async def setup_async(self) -> None:
        self.ready = True

    def shutdown(self) -> None:
        self.ready = False

    # -- generation --------------------------------------------------------------------------------

    def _generate(
        self, inputs: list[int], sampling_params: Any, streaming: bool, disaggregated_params: Any, **extra: Any
    ) -> GenerationResult:
        if not self.ready:
            raise RuntimeError("setup_async() was not awaited")
        if self.asleep:
            raise RuntimeError(f"the engine is asleep (released: {sorted(self.asleep)})")
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError("sampling_params must be a SamplingParams")
        if disaggregated_params is not None and not isinstance(disaggregated_params, DisaggregatedParams):
            raise TypeError("disaggregated_params must be a DisaggregatedParams")
        prompt = [int(t) for t in inputs]
        limit = self.kwargs.get("max_num_tokens")
        if limit and len(prompt) > limit:  # LLM._check_arguments, PyTorch backend, no chunked prefill
            raise ValueError(
                f"The sum of prompt length ({len(prompt)}), query length (0) should not exceed max_num_tokens ({limit})"
            )
        record(
            "generate",
            request_type=getattr(disaggregated_params, "request_type", None),
            **{k: str(v) for k, v in extra.items()},
        )
        kind = disaggregated_params.request_type if disaggregated_params is not None else "context_and_generation"
        cached = self._cached(prompt) if kind != "generation_only" else 0
        first = self._check_state(prompt, disaggregated_params) if kind == "generation_only" else None
        limit = 1 if kind == "context_only" else int(sampling_params.max_tokens or 16)
        steps = self._steps(
            prompt, first, limit, sampling_params, disaggregated_params if kind == "context_only" else None
        )
        return GenerationResult(prompt, cached, steps)

    def _steps(self, prompt: list[int], first: int | None, limit: int, sampling_params: Any, context: Any) -> Any:
        """The request's steps, each computed when the executor reaches it, under the weights the
        engine holds then, over KV computed under the weights it held at the request's prefill
        (a weights update between two steps leaves that KV stale, as TensorRT-LLM does)."""
        kv_weights = self.weights
        tokens: list[int] = []
        for i in range(limit):
            token = first if i == 0 and first is not None else self._next(prompt, tokens, kv_weights)
            entry = self._logprobs(prompt, tokens, token, sampling_params.logprobs)
            last = i == limit - 1
            params = self._context_params(prompt, token, context) if last and context is not None else None
            tokens.append(token)
            yield (token, entry, "length" if last else None, params)

    if OLDER:

        def generate_async(
            self,
            inputs: list[int],
            sampling_params: Any = None,
            streaming: bool = False,
            disaggregated_params: Any = None,
        ) -> GenerationResult:
            return self._generate(inputs, sampling_params, streaming, disaggregated_params)

    else:

        def generate_async(  # type: ignore[misc]  # the newer release's signature
            self,
            inputs: list[int],
            sampling_params: Any = None,
            streaming: bool = False,
            disaggregated_params: Any = None,
            conversation_params: Any = None,
        ) -> GenerationResult:
            if conversation_params is not None and type(conversation_params).__name__ != "ConversationParams":
                raise TypeError("conversation_params must be a ConversationParams")
            extra = {} if conversation_params is None else {"conversation_params": conversation_params}
            return self._generate(inputs, sampling_params, streaming, disaggregated_params, **extra)

    def _next(self, prompt: list[int], tokens: list[int], kv_weights: bytes) -> int:
        if kv_weights == self.weights:
            return int.from_bytes(_digest(self.weights, prompt, tokens)[:4], "big") % VOCAB
        return int.from_bytes(_digest("stale kv", kv_weights, self.weights, prompt, tokens)[:4], "big") % VOCAB

    def _logprobs(self, prompt: list[int], before: list[int], token: int, k: int | None) -> Any:
        if not k:
            return None
        alt = (token + 1) % VOCAB
        return {token: Logprob(logprob=-0.25, rank=1), alt: Logprob(logprob=-1.5, rank=2)}

    def _cached(self, prompt: list[int]) -> int:
        hits = 0
        for end in range(BLOCK, len(prompt), BLOCK):
            key = _digest(self.weights, prompt[:end])
            if key in self.seen_blocks and hits == end - BLOCK:
                hits = end
            self.seen_blocks.add(key)
        return hits

    def _context_params(self, prompt: list[int], first: int, request: Any) -> Any:
        rid = request.disagg_request_id if request.disagg_request_id is not None else self.request_ids
        self.request_ids += 1
        return DisaggregatedParams(
            request_type="context_only",
            first_gen_tokens=[first],
            ctx_request_id=rid,
            opaque_state=_digest("state", self.weights, prompt, first),
            ctx_dp_rank=0,
            ctx_info_endpoint="tcp://127.0.0.1:47001",
            first_gen_log_probs=None,
        )

    def _check_state(self, prompt: list[int], params: Any) -> int:
        if params.ctx_request_id is None or not params.first_gen_tokens:
            raise ValueError("generation_only needs ctx_request_id and first_gen_tokens")
        first = int(params.first_gen_tokens[0])
        if params.opaque_state != _digest("state", self.weights, prompt, first):
            raise RuntimeError(f"KV transfer failed for ctx_request_id {params.ctx_request_id}: state does not match")
        return first

    # -- memory ----------------------------------------------------------------------------------

    async def release(self, tags: list[str]) -> None:
        await self.collective_rpc("sleep", args=(tags,))

    async def resume(self, tags: list[str]) -> None:
        await self.collective_rpc("wakeup", args=(tags,))

    def _memory(self, method: str, tags: list[str]) -> None:
        if self.kwargs.get("sleep_config") is None:
            raise RuntimeError("sleep mode is not enabled: construct the LLM with sleep_config")
        for tag in tags:
            ExecutorMemoryType(tag)  # ValueError for an unknown tag
        if method == "sleep":
            self.asleep.update(tags)
        else:
            self.asleep.difference_update(tags)

    # -- RPCs --------------------------------------------------------------------------------------

    async def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        unique_reply_rank: int | None = None,
    ) -> list[Any]:
        kwargs = dict(kwargs or {})
        record("rpc", method=method, args=[str(a) for a in args], kwargs=sorted(kwargs))
        if method in ("sleep", "wakeup"):
            self._memory(method, list(args[0]))
            return [None] * self.world
        func = getattr(self.extension, method, None)
        if func is None or not callable(func):
            raise AttributeError(f"{self.extension.__qualname__} has no method {method!r}")
        inspect.signature(func).bind(None, *args, **kwargs)  # TypeError when the arguments do not fit
        result = getattr(self, f"_rpc_{method}")(*args, **kwargs)
        return [result] * self.world

    def _rpc_weights_digest(self) -> str | None:
        from drs_protocol.weights_digest import digest_bytes

        return None if self.handed is None else digest_bytes(self.handed)

    def _rpc_reset_prefix_cache(self) -> None:
        self.seen_blocks.clear()

    def _rpc_start_profile(self) -> None:
        return None

    def _rpc_stop_profile(self) -> None:
        return None

    def _rpc_load_weights_from_path(self, path: str) -> bool:
        files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else [Path(path)]
        if not files or not all(f.is_file() and f.suffix == ".safetensors" for f in files):
            return False  # the real extension returns False on failure
        self.handed = b"".join(f.read_bytes() for f in files)
        self.weights = _digest("load", self.handed)
        self.seen_blocks.clear()
        return True

    def _rpc_init_collective(
        self, rank_prefix: int, ip: str, port: int, world_size: int, train_world_size: int
    ) -> bool:
        self.refit = {"group": (rank_prefix, ip, port, world_size, train_world_size)}
        return True

    def _rpc_prepare_refit_info(self, state_dict_info: dict[str, Any]) -> bool:
        if "group" not in self.refit:
            return False
        self.refit["info"] = state_dict_info
        return True

    def _rpc_update_weights_from_collective(
        self, drain: bool = True, recompute_kv: bool = False, retain_to: str | None = None
    ) -> bool:
        if "info" not in self.refit:
            return False
        # stands for the broadcast: bytes of the layout's size, other at every update
        self.handed = _fill(
            _digest("collective", self.weights, sorted(self.refit["info"])), _nbytes(self.refit["info"])
        )
        self.weights = _digest("load", self.handed)
        self.seen_blocks.clear()
        if retain_to is not None:  # the first worker keeps what it received (one file per engine)
            Path(retain_to + ".part").write_bytes(self.handed)
            Path(retain_to + ".part").replace(retain_to)
        return True

    def _rpc_load_weights_from_packed(self, path: str, state_dict_info: dict[str, Any]) -> bool:
        data = Path(path).read_bytes()
        if len(data) != _nbytes(state_dict_info):
            return False  # the real extension refuses a file that is not the layout's size
        self.handed = data
        self.weights = _digest("load", self.handed)
        self.seen_blocks.clear()
        return True


def _nbytes(state_dict_info: dict[str, Any]) -> int:
    from drs_protocol.nemo_rl_refit import parse_state_dict_info

    return sum(spec.nbytes for spec in parse_state_dict_info(state_dict_info))


def _fill(seed: bytes, size: int) -> bytes:
    return (seed * (size // len(seed) + 1))[:size]
