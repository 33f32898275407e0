"""CONTRACT TEST DOUBLE: result shapes (slots dataclasses with exactly the recorded attributes)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

from tensorrt_llm._surface import strict_class, surface

_C = surface()["classes"]
#: Seconds per streamed step (``TRTLLM_DOUBLE_STEP_S``; 0: at once).
STEP_S = float(os.environ.get("TRTLLM_DOUBLE_STEP_S", "0"))
Logprob = strict_class("Logprob", _C["tensorrt_llm.executor.result.Logprob"]["attributes"], module=__name__)
CompletionOutput = strict_class(
    "CompletionOutput", _C["tensorrt_llm.executor.result.CompletionOutput"]["attributes"], module=__name__
)


class GenerationResult:
    """``outputs``, ``finished``, ``cached_tokens``, ``prompt_token_ids``; ``aresult``, ``abort``,
    async iteration — nothing else (``__slots__``)."""

    __slots__ = ("_aborted", "_steps", "cached_tokens", "finished", "outputs", "prompt_token_ids")

    def __init__(self, prompt_token_ids: list[int], cached_tokens: int, steps: Iterator[Any]) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.cached_tokens = cached_tokens
        self.outputs = [CompletionOutput(index=0, token_ids=[], logprobs=[])]
        self.finished = False
        #: (token, logprob entry, finish_reason | None, disaggregated_params | None), computed when reached
        self._steps = steps
        self._aborted = False

    def _advance(self) -> None:
        token, entry, finish, params = next(self._steps)
        out = self.outputs[0]
        out.token_ids.append(token)
        if entry is not None:
            out.logprobs.append(entry)
        if finish is not None:
            out.finish_reason = finish
            out.disaggregated_params = params
            self.finished = True

    async def aresult(self) -> GenerationResult:
        while not self.finished:
            self._advance()
        return self

    def abort(self) -> None:
        self._aborted = True

    def __aiter__(self) -> GenerationResult:
        return self

    async def __anext__(self) -> GenerationResult:
        if self.finished or self._aborted:
            raise StopAsyncIteration
        if STEP_S:  # a decode step's time (the engine's other work runs meanwhile, as on a GPU)
            await asyncio.sleep(STEP_S)
            if self._aborted:
                raise StopAsyncIteration
        self._advance()
        return self
