"""The ``torch`` backend's model runner: the model's forward passes as jobs on the GPU thread.

:class:`ModelRunner` runs a prompt's prefill (after the cached prefix blocks copied into the new
sequence's KV, or with ``kvLayout: paged`` shared in place in the store, :mod:`.kv.turns`; into a
handoff-arena region when the context is to be handed over; cold prompts that arrive together in
one batched pass, :class:`~drs_engine.backends.torch.batching.PrefillQueue`), and the
batched decode steps of :class:`~drs_engine.backends.torch.batching.DecodeBatcher` through
:class:`~drs_engine.backends.torch.decoder.BatchDecoder` (the decode pool and its CUDA graphs) or,
with ``kvLayout: paged``, :class:`~drs_engine.backends.torch.paged_decoder.PagedDecoder` (block tables).
Before each step a sequence outside the pool gets room for one more token, and KV computed under
other weights is recomputed (refit safety, :func:`~drs_engine.backends.base.restate_after_refit`).
The weights are read through :class:`~drs_engine.backends.torch.weights.manager.WeightsManager`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from drs_protocol.engine_config import TorchSpec
from drs_protocol.enums import KvLayout

from drs_engine.backends.base import LegRequest, finish_after, restate_after_refit
from drs_engine.backends.torch.batching import DecodeBatcher, DecodeSeq, PrefillQueue
from drs_engine.backends.torch.decoder import BatchDecoder
from drs_engine.backends.torch.kv.arena import KvArena
from drs_engine.backends.torch.kv.prefix import CopyRun
from drs_engine.backends.torch.kv.turns import PagedTurn, PagedTurns
from drs_engine.backends.torch.model import ModelShape, decode_step, new_kv, prefill, prefill_batch
from drs_engine.backends.torch.paged_decoder import PagedDecoder
from drs_engine.backends.torch.sampling import BanMasks, Choice, Sampling, choose_tokens
from drs_engine.backends.torch.weights.manager import WeightsManager
from drs_engine.backends.torch.worker import GpuWorker
from drs_engine.errors import EngineError
from drs_engine.prefix_hash import block_hashes

log = logging.getLogger("drs_engine")

#: padded prompt tokens of one batched prefill pass (:class:`~.batching.PrefillQueue`'s budget)
PREFILL_BATCH_TOKENS = 16384


@dataclass(frozen=True, slots=True)
class PrefillJob:
    """One prompt to prefill from ``start`` (after the cached ``runs`` copied in)."""

    prompt: list[int]
    start: int
    runs: list[CopyRun]
    capacity: int
    sampling: Sampling
    ban: Any
    arena: KvArena | None
    region: int | None
    cache_keeps_nothing: bool
    #: ``kvLayout: paged``: the prompt's full blocks' cache keys (None: the slot layout)
    keys: list[bytes] | None = None
    #: the sequence decodes here (paged: its table stays in the store)
    decodes: bool = False

    @property
    def cold(self) -> bool:
        """Nothing cached and its own KV (not an arena region): it can join a batched pass."""
        return self.start == 0 and not self.runs and self.region is None


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """A prompt's KV after prefill and its first token."""

    #: the sequence's KV (room for decoding when it goes on here)
    kv: Any
    #: the KV a context leg leaves (``kv`` itself, or its copy in the arena region)
    ctx_kv: Any
    first: Choice
    #: the weights generation the KV was computed with
    gen: int
    #: the arena region's description for the decode engine (None: not in the arena)
    arena: dict[str, Any] | None
    #: prompt tokens not computed (the cached prefix)
    cached: int = 0


class ModelRunner:
    """Prefill and decode steps of one model on one device."""

    def __init__(
        self,
        spec: TorchSpec,
        *,
        shape: ModelShape,
        device: Any,
        dtype: Any,
        weights: WeightsManager,
        worker: GpuWorker,
        vocab_limit: int | None,
        eos_token_id: int,
    ) -> None:
        self._spec = spec
        self._shape = shape
        self._device = device
        self._dtype = dtype
        self._weights = weights
        self._worker = worker
        self._eos_token_id = eos_token_id
        self._vocab_limit = vocab_limit
        self._bans: BanMasks | None = None
        self.decoder: BatchDecoder | PagedDecoder
        if spec.kv_layout is KvLayout.PAGED:
            self.decoder = PagedDecoder(
                shape,
                tokens=spec.max_decode_batch * spec.decode_slot_tokens,
                tokens_per_block=spec.tokens_per_block,
                rows=spec.max_decode_batch,
                attention=spec.paged_attention,
                compiled=spec.compile_decode,
                caching=spec.cache_capacity_tokens >= spec.tokens_per_block,
                device=device,
                dtype=dtype,
            )
            self.decoder.keys = self._cache_keys
        else:
            self.decoder = BatchDecoder(
                shape,
                slots=spec.max_decode_batch,
                slot_tokens=spec.decode_slot_tokens,
                cuda_graphs=spec.cuda_graphs,
                compiled=spec.compile_decode,
                device=device,
                dtype=dtype,
            )
        self.batcher = DecodeBatcher(worker, self._step, max_batch=spec.max_decode_batch)
        self.prefills: PrefillQueue[PrefillJob, PrefillResult] = PrefillQueue(
            worker,
            self._prefill_many,
            budget=PREFILL_BATCH_TOKENS,
            tokens=lambda job: len(job.prompt) - job.start,
            discard=self._discard,
        )

    @property
    def turns(self) -> PagedTurns | None:
        """The paged store's prompts (``kvLayout: paged``: the pool is the prefix cache), or None."""
        return self.decoder.turns if isinstance(self.decoder, PagedDecoder) else None

    def _cache_keys(self, seq: DecodeSeq) -> list[bytes]:
        """A sequence's computed tokens' full-block keys, under the weights served (on the GPU thread)."""
        if seq.weights_gen != self._weights.gen:
            return []
        ids = (seq.prompt + seq.generated)[: seq.length]
        return block_hashes(self._weights.seed, ids, self._spec.tokens_per_block)

    def _discard(self, result: PrefillResult) -> None:
        """A prefill whose client left before taking it: its turn's references go."""
        self.drop_turn(result.kv)

    def drop_turn(self, kv: Any) -> None:
        """``kv`` a turn still in the store (its sequence never stepped): dropped on the GPU thread."""
        turns = self.turns
        if turns is not None and isinstance(kv, PagedTurn):
            self._worker.post(turns.drop, kv)

    def forget_cached(self) -> int:
        """The paged store's cached blocks dropped (new weights, a reset, sleep: on the GPU thread)."""
        turns = self.turns
        return turns.store.pool.forget_cached() if turns is not None else 0

    async def start(self, tokens_per_block: int) -> None:
        """The banned-id masks, made on the device (by the GPU thread), then every path a request
        takes run once (:meth:`_warm_up`)."""
        self._bans = await self._worker.run(
            lambda: BanMasks(
                self._shape.vocab_size,
                vocab_limit=self._vocab_limit,
                eos_token_id=self._eos_token_id,
                device=self._device,
            )
        )
        await self._worker.run(self._warm_up, tokens_per_block)

    def _warm_up(self, tokens_per_block: int) -> None:
        """A cold prefill, a prefill after cached blocks copied in (the prefix-hit path: attention
        masked over the prefix), a batched decode step and a token choice, on a throwaway KV, so
        that no request (the first cached prompt included) pays for the first use of a kernel."""
        blocks = 8
        n = min(blocks * tokens_per_block + 16, self._shape.max_positions - 2)
        cut = (n // 2 // tokens_per_block) * tokens_per_block
        ids = [1000 + (i * 7919) % 50000 for i in range(n)]
        cold = new_kv(self._shape, n + 1, device=self._device, dtype=self._dtype)
        prefill(self._weights.params, self._shape, ids, cold, 0)
        hit = new_kv(self._shape, n + 1, device=self._device, dtype=self._dtype)
        hit[:, :, :, :cut].copy_(cold[:, :, :, :cut])
        logits = prefill(self._weights.params, self._shape, ids[cut:], hit, cut)
        pair = [new_kv(self._shape, n + 1, device=self._device, dtype=self._dtype) for _ in range(2)]
        prefill_batch(self._weights.params, self._shape, [ids, ids[: n // 2]], pair)  # arriving together
        greedy = Sampling(temperature=0.0, top_p=1.0, top_k=0, logprobs=True, top_logprobs=1)
        mask = self._bans.mask(produced=1, min_tokens=0) if self._bans is not None else None
        if mask is not None:
            choose_tokens(logits[None], [greedy], [mask])
            step = decode_step(self._weights.params, self._shape, [ids[-1], ids[-1]], [cold, hit], [n, n])
            choose_tokens(step, [greedy, greedy], [mask, mask])
            self._warm_pool(cold, n, ids[-1])
            self._warm_turns(ids)
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def _warm_pool(self, kv: Any, n: int, token: int) -> None:
        """The decode pool allocated and its step run at each of the decoder's warm-up batch sizes
        (:meth:`~.decoder.BatchDecoder.warm_rows`: graphs captured, FlexAttention compiled), through
        the real step with throwaway sequences that then leave. With the paged layout each takes
        one block (its first ``tokensPerBlock - 1`` tokens), so the widest batch fits the store."""
        if not self.decoder.fits(n):
            return
        rows = self.decoder.warm_rows()
        if isinstance(self.decoder, PagedDecoder):
            n = min(n, self.decoder.store.tokens_per_block - 1)
        greedy = Sampling(temperature=0.0, top_p=1.0, top_k=0, logprobs=False, top_logprobs=0)
        seqs = [
            DecodeSeq(kv, n, token, greedy, [token], check=lambda _: (None, None), banned=lambda _: None)
            for _ in range(max(rows))
        ]
        started = time.monotonic()
        for r in rows:
            self._step(seqs[:r], [])
        self._step([], seqs)
        if len(rows) > 2:
            log.info(
                "decode step warmed at %d batch sizes (1..%d rows) in %.1f s",
                len(rows),
                max(rows),
                time.monotonic() - started,
            )

    def _warm_turns(self, ids: list[int]) -> None:
        """The paged store's prefill path (:mod:`.kv.turns`) run cold and then as a prefix hit (the
        hit's past gathered from shared blocks), under throwaway keys forgotten after."""
        turns, n = self.turns, len(ids)
        if turns is None or not self.decoder.fits(n):
            return
        keys = [("warm-up", i) for i in range(n // self._spec.tokens_per_block)]
        for _ in range(2):
            turn = turns.open(keys, n)
            kv = turns.past(turn, n + 1)
            prefill(self._weights.params, self._shape, ids[turn.hit :], kv, turn.hit)
            turns.settle(turn, kv, keys, n, stays=False)
        turns.store.pool.forget_cached()

    def decode_capacity(self, leg: LegRequest) -> int:
        """KV capacity of a sequence that decodes here (grown by ``decodeGrowthTokens`` as it goes)."""
        return len(leg.prompt_token_ids) + min(leg.max_tokens, self._spec.decode_growth_tokens)

    def ban(self, leg: LegRequest, produced: int) -> Any:
        if self._bans is None:
            raise EngineError("the torch backend is not started")
        return self._bans.mask(produced=produced, min_tokens=leg.request.min_tokens)

    async def prefill(
        self,
        prompt: list[int],
        start: int,
        runs: list[CopyRun],
        capacity: int,
        sampling: Sampling,
        ban: Any,
        arena: KvArena | None = None,
        region: int | None = None,
        *,
        cache_keeps_nothing: bool = False,
        keys: list[bytes] | None = None,
        decodes: bool = False,
    ) -> PrefillResult:
        job = PrefillJob(
            prompt, start, runs, capacity, sampling, ban, arena, region, cache_keeps_nothing, keys, decodes
        )
        return await self.prefills.submit(job)

    def _prefill_many(self, jobs: list[PrefillJob]) -> list[PrefillResult | Exception]:
        """The jobs that waited together (on the GPU thread): the cold ones in one batched pass when
        there are two or more, the others one by one; each job gets its result or its error."""
        out: dict[int, PrefillResult | Exception] = {}
        turns = self.turns
        cold = [
            i
            for i, job in enumerate(jobs)
            if job.cold and (turns is None or job.keys is None or not turns.store.pool.cached_run(job.keys))
        ]
        cold = cold if len(cold) > 1 else []
        if cold:
            try:
                for i, result in zip(cold, self._prefill_cold([jobs[i] for i in cold]), strict=True):
                    out[i] = result
            except Exception as exc:
                out.update(dict.fromkeys(cold, exc))
        for i, job in enumerate(jobs):
            if i not in out:
                try:
                    out[i] = self._prefill_job(job)
                except Exception as exc:
                    out[i] = exc
        return [out[i] for i in range(len(jobs))]

    def _prefill_cold(self, jobs: list[PrefillJob]) -> list[PrefillResult]:
        """Cold prompts in one forward pass (:func:`~.model.prefill_batch`), first tokens in one pick."""
        self._weights.check_complete()
        kvs = [new_kv(self._shape, job.capacity, device=self._device, dtype=self._dtype) for job in jobs]
        logits = prefill_batch(self._weights.params, self._shape, [job.prompt for job in jobs], kvs)
        firsts = choose_tokens(logits, [job.sampling for job in jobs], [job.ban for job in jobs])
        gen, turns = self._weights.gen, self.turns
        out = []
        for job, kv, first in zip(jobs, kvs, firsts, strict=True):
            kept = kv
            if turns is not None and job.keys is not None:  # into the store after (a batch mate's blocks shared)
                turn = turns.open(job.keys, len(job.prompt))
                kept = turns.settle(turn, kv, job.keys, len(job.prompt), stays=job.decodes) or kv
            out.append(PrefillResult(kept, kv, first, gen, None))  # computed whole: nothing cached
        return out

    def _prefill_job(self, job: PrefillJob) -> PrefillResult:
        """Prefill ``prompt`` from ``start``. With an arena ``region`` the context's KV lies there:
        computed in place when the prefix cache keeps nothing, else copied there (the cache's blocks
        must outlive the region)."""
        prompt, start, runs, capacity, s, ban = job.prompt, job.start, job.runs, job.capacity, job.sampling, job.ban
        arena, region, cache_keeps_nothing = job.arena, job.region, job.cache_keeps_nothing
        self._weights.check_complete()
        shape = (self._shape.layers, 2, self._shape.kv_heads, capacity, self._shape.head_dim)
        arena = arena if region is not None else None
        in_place = arena is not None and cache_keeps_nothing
        turns = self.turns if job.keys is not None else None
        turn = turns.open(job.keys or [], len(prompt)) if turns is not None else None
        try:
            if arena is not None and region is not None and in_place:
                kv = arena.view(region, shape, self._dtype)
            elif turns is not None and turn is not None:  # the cached prefix read from its shared blocks
                kv, start = turns.past(turn, capacity), turn.hit
            else:
                kv = new_kv(self._shape, capacity, device=self._device, dtype=self._dtype)
            for dst, base, src, n in runs:  # cached prefix blocks, copied instead of recomputed
                kv[:, :, :, dst : dst + n].copy_(base[:, :, :, src : src + n])
            logits = prefill(self._weights.params, self._shape, prompt[start:], kv, start)
            ctx_kv, where = kv, None
            if arena is not None and region is not None:
                ctx_kv = kv if in_place else arena.view(region, shape, self._dtype).copy_(kv)
                where = arena.describe(region, shape, self._dtype)
            first = choose_tokens(logits[None], [s], [ban])[0]
            kept = kv
            if turns is not None and turn is not None:
                kept = turns.settle(turn, kv, job.keys or [], len(prompt), stays=job.decodes) or kv
        except BaseException:
            if turns is not None and turn is not None:
                turns.drop(turn)
            raise
        return PrefillResult(kept, ctx_kv, first, self._weights.gen, where, start)

    def new_seq(self, leg: LegRequest, kv: Any, first: Choice, s: Sampling, gen: int) -> DecodeSeq:
        """A sequence that decodes on from ``kv`` (``gen`` -1: KV of other weights, recomputed first)."""
        return DecodeSeq(
            prompt=list(leg.prompt_token_ids),
            weights_gen=gen,
            grow_to=self.decode_capacity(leg),
            kv=kv,
            length=len(leg.prompt_token_ids),
            next_token=first.token_id,
            sampling=s,
            generated=[first.token_id],
            check=lambda generated: finish_after(leg, generated, self._eos_token_id),
            banned=lambda produced: self.ban(leg, produced),
        )

    # ---- on the GPU thread -----------------------------------------------------------------

    def _step(self, batch: list[DecodeSeq], leaving: list[DecodeSeq]) -> Any:
        """One batched step (see :mod:`.decoder`): slots given back and taken, KV made ready, logits."""
        self.decoder.release(leaving)
        if not batch:
            return None
        self._weights.check_complete()
        self.decoder.seat(batch)
        for seq in batch:
            self._prepare(seq)
        return self.decoder.step(self._weights.params, self._weights.packed, batch)

    def free_pool(self) -> None:
        """Drop the decode pool and its graphs (sleep: on the GPU thread, after the batch failed)."""
        self.decoder.free()

    def _prepare(self, seq: DecodeSeq) -> None:
        """Before a step: if the weights changed since ``seq``'s KV was computed, that KV recomputed
        under the new weights (the prompt and the tokens generated so far: refit safety; written
        into its slot when pooled), and outside the pool room for one more token in its KV (grown
        by ``decodeGrowthTokens``)."""
        if seq.weights_gen != self._weights.gen:
            ids, boundary = restate_after_refit(seq.prompt, seq.generated, seq.length)
            if seq.pooled:
                self.decoder.rewrite(seq, lambda kv: prefill(self._weights.params, self._shape, ids, kv, 0))
            else:
                fresh = new_kv(self._shape, seq.kv.shape[3], device=self._device, dtype=self._dtype)
                prefill(self._weights.params, self._shape, ids, fresh, 0)
                seq.kv = fresh
            seq.weights_gen, seq.boundary = self._weights.gen, boundary
        if seq.pooled or seq.length < seq.kv.shape[3]:
            return
        capacity = seq.kv.shape[3]
        grown = max(seq.grow_to, capacity + self._spec.decode_growth_tokens)
        bigger = new_kv(self._shape, grown, device=self._device, dtype=self._dtype)
        bigger[:, :, :, :capacity].copy_(seq.kv)
        seq.kv = bigger
