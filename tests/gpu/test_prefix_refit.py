"""A refit and the ``torch`` engine's prefix cache, on the CPU: no prefill starts from KV of the old weights,
and a decode engine recomputes received KV labelled with other weights than its own.

A refit swaps the weights in one job on the GPU thread; the cached prefix blocks are forgotten by a
later one, after the event loop learns of the swap. A prefill whose job runs between them, or whose
hit was looked up before the swap, must not start from the old weights' cached KV and compute the
rest under the new ones (stamped with the new weights' generation, the decode step would never
recompute it). The test holds the engine's real GPU thread with jobs of its own, so that the prefill
is queued behind the swap with its lookup made before it, and compares its answer with a cold
prefill on an engine started with the new weights (float32: equal greedy tokens and logprobs).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import pytest
from drs_engine.server.runner import RunningEngine, start_engine

from .conftest import COMPLETIONS, CONTROL_TOKEN, auth, completion_body, prompt_ids, torch_backend, torch_config
from .test_paged_prefix import PAGED, TPB

if TYPE_CHECKING:
    from drs_engine.backends.torch.worker import GpuWorker

T = TypeVar("T")

#: seconds a gate job holds the GPU thread at most (a failing test lets it go sooner, in ``finally``)
GATE_S = 60.0


@dataclass(frozen=True)
class Answer:
    tokens: list[int]
    logprobs: list[float]
    cached: int


async def _answer(client: httpx.AsyncClient, url: str, ids: list[int]) -> Answer:
    response = await client.post(url + COMPLETIONS, json=completion_body(ids, max_tokens=6, logprobs=1))
    assert response.status_code == 200, response.text
    body = response.json()
    choice = body["choices"][0]
    cached = int(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    return Answer(list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"]), cached)


def _worker(engine: RunningEngine) -> GpuWorker:
    """``engine``'s GPU thread."""
    return torch_backend(engine)._worker


def _jobs_queued(worker: GpuWorker, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Awaitable[None]]:
    """Watch the jobs queued on the GPU thread (its real executor's ``submit``, observed): the
    returned coroutine function waits until a job of the named function has been queued."""
    pool = worker._pool
    names: asyncio.Queue[str] = asyncio.Queue()
    submit = pool.submit

    def observed(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        names.put_nowait(getattr(getattr(fn, "func", fn), "__name__", repr(fn)))  # run() and post() queue a _Job
        return submit(fn, *args, **kwargs)

    monkeypatch.setattr(pool, "submit", observed)

    async def queued(name: str) -> None:
        async with asyncio.timeout(GATE_S):
            while await names.get() != name:
                pass

    return queued


async def behind_a_swap(
    engine: RunningEngine,
    client: httpx.AsyncClient,
    checkpoint: Path,
    monkeypatch: pytest.MonkeyPatch,
    send: Callable[[], Coroutine[Any, Any, T]],
) -> T:
    """``send()``'s result, its prefill queued on the GPU thread right behind the swap of a load of
    ``checkpoint`` as ``v5`` (the engine still saying its old version when it arrived; the load
    then succeeds). The GPU thread is held with two gates: one lets the file read run, the other
    the swap."""
    worker = _worker(engine)
    queued = _jobs_queued(worker, monkeypatch)
    swap, run = threading.Event(), threading.Event()
    try:
        worker.post(swap.wait, GATE_S)
        load = asyncio.create_task(
            client.post(
                engine.url + "/control/weights/load", headers=auth(), json={"path": str(checkpoint), "version": "v5"}
            )
        )
        await queued("read_safetensors")
        worker.post(run.wait, GATE_S)
        swap.set()
        await queued("_install")  # the swap waits behind `run`: the engine still serves the old version
        sent: asyncio.Task[T] = asyncio.create_task(send())
        await queued("_prefill_many")  # the request's prefill, queued behind the swap
        run.set()
        got = await sent
        assert (await load).status_code == 200
    finally:
        swap.set()
        run.set()
    return got


@pytest.mark.parametrize("layout", ["slots", "paged"])
async def test_a_prefill_queued_behind_a_refit_computes_its_cached_prefix_again_under_the_new_weights(
    layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both KV layouts: a prompt whose two full blocks are cached, sent while a load's swap waits on
    the GPU thread (its lookup made under the old weights, its prefill queued behind the swap and
    before the forget), gets the tokens and logprobs of a cold prefill under the new weights and
    reports no cached tokens; the cache serves hits under the new weights after."""
    import torch
    from drs_engine.backends.torch.model import SIZES, random_state_dict
    from safetensors.torch import save_file

    save_file(
        random_state_dict(SIZES["tiny"], seed=5, device="cpu", dtype=torch.float32), str(tmp_path / "w.safetensors")
    )
    spec = PAGED if layout == "paged" else {"tokensPerBlock": TPB}
    ids = prompt_ids(40, offset=600)
    async with (
        start_engine(torch_config(**spec), control_token=CONTROL_TOKEN) as e,
        start_engine(torch_config(model="random:tiny@5", tokensPerBlock=TPB), control_token=CONTROL_TOKEN) as five,
        httpx.AsyncClient(timeout=GATE_S) as client,
    ):
        cold = await _answer(client, five.url, ids)  # the new weights, nothing cached
        old = await _answer(client, e.url, ids)
        assert old.cached == 0 and (await _answer(client, e.url, ids)).cached == 32  # two blocks cached
        got = await behind_a_swap(e, client, tmp_path, monkeypatch, lambda: _answer(client, e.url, ids))
        assert old.tokens != cold.tokens  # the two weights answer differently
        assert got.cached == 0 and got.tokens == cold.tokens
        assert got.logprobs == pytest.approx(cold.logprobs, abs=1e-4)
        again = await _answer(client, e.url, ids)
        again = again if again.cached else await _answer(client, e.url, ids)
        assert again.cached == 32 and again.tokens == cold.tokens  # a hit under the new weights


async def test_a_context_leg_prefilled_after_a_refits_swap_is_labelled_with_the_new_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A context-only leg that arrives while the engine still says its old version, and whose
    prefill runs after the load's swap (on the GPU thread, before the event loop declares the new
    version), is the new weights' KV: its answer and its handoff name the new version, so a decode
    engine still at the old weights recomputes it rather than decoding on it as its own."""
    import torch
    from drs_engine.backends.torch.model import SIZES, random_state_dict
    from safetensors.torch import save_file

    save_file(
        random_state_dict(SIZES["tiny"], seed=5, device="cpu", dtype=torch.float32), str(tmp_path / "w.safetensors")
    )
    ids = prompt_ids(40, offset=900)
    context_only = completion_body(ids, max_tokens=4, disaggregated_params={"request_type": "context_only"})
    async with (
        start_engine(torch_config(tokensPerBlock=TPB), control_token=CONTROL_TOKEN) as e,
        httpx.AsyncClient(timeout=GATE_S) as client,
    ):
        answer = await behind_a_swap(
            e, client, tmp_path, monkeypatch, lambda: client.post(e.url + COMPLETIONS, json=context_only)
        )
    assert answer.status_code == 200, answer.text
    assert answer.json()["weights_version"] == "v5", answer.json()
    assert answer.headers["x-drs-weights-version"] == "v5"


async def test_a_decode_engine_recomputes_received_kv_labelled_with_other_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode engine at ``v5`` receives a context prefilled under the prefill engine's weights
    (``0``): it judges the KV by the version its GPU thread's weights carry, recomputes the prompt's
    KV under ``v5`` before its first step, and decodes what an engine at ``v5`` decodes after the
    context's first token (float32: equal greedy tokens); KV labelled ``v5`` it decodes on as is."""
    import torch
    from drs_engine.backends.base import restate_after_refit as restate
    from drs_engine.backends.torch import runner
    from drs_engine.backends.torch.model import SIZES, random_state_dict
    from safetensors.torch import save_file

    from .test_torch_engine import disaggregated, tokens

    recomputed: list[int] = []  # the runner's recompute of a sequence's KV, observed

    def observed(prompt: list[int], generated: list[int], length: int) -> Any:
        recomputed.append(length)
        return restate(prompt, generated, length)

    monkeypatch.setattr(runner, "restate_after_refit", observed)

    save_file(
        random_state_dict(SIZES["tiny"], seed=5, device="cpu", dtype=torch.float32), str(tmp_path / "w.safetensors")
    )
    ids = prompt_ids(40, offset=1300)
    async with (
        start_engine(torch_config(), control_token=CONTROL_TOKEN) as old,
        start_engine(torch_config(model="random:tiny@5"), control_token=CONTROL_TOKEN) as five,
        start_engine(torch_config("decode"), control_token=CONTROL_TOKEN) as decode,
        httpx.AsyncClient(timeout=GATE_S) as client,
    ):
        load = await client.post(
            decode.url + "/control/weights/load",
            headers=auth(),
            json={"path": str(tmp_path / "w.safetensors"), "version": "v5"},
        )
        assert load.status_code == 200, load.text
        got = await disaggregated(client, old.url, decode.url, ids, max_tokens=8)
        after_first = await tokens(client, five.url, ids + got[:1], max_tokens=7)
        on_old_kv = await tokens(client, old.url, ids, max_tokens=8)
        assert got[1:] == after_first  # decoded under v5 from the prompt's KV computed again
        assert len(recomputed) == 1
        assert got != on_old_kv  # and the two weights decode differently
        await client.post(
            five.url + "/control/weights/load",
            headers=auth(),
            json={"path": str(tmp_path / "w.safetensors"), "version": "v5"},
        )
        same = await disaggregated(client, five.url, decode.url, ids, max_tokens=8)
        assert same == await tokens(client, five.url, ids, max_tokens=8)
        assert len(recomputed) == 1  # KV labelled v5: decoded on as is
