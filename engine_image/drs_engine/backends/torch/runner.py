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

A prefill's cached prefix is decided on the GPU thread when its job runs, under the weights served
then: a refit swaps the tensors in a GPU-thread job and the cached blocks are forgotten only by a
later one, so a job queued behind the swap would otherwise start from KV of the old weights and
compute the rest under the new ones, stamped with the new generation (the decode step would never
recompute it). With ``kvLayout: paged`` the job takes its prompt's cache keys then, seeded with the
served generation (:meth:`~drs_engine.backends.torch.weights.manager.WeightsManager.seed_at`: old
blocks never match); with the slot layout the hit looked up on the event loop (copy runs of
:class:`~drs_engine.backends.torch.kv.prefix.PrefixKv`, keyed the same way) is used only when the
generation it was looked up under is still served, else the prompt is computed whole.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
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
    #: the weights generation ``start`` and ``runs`` were looked up under (not served when the job
    #: runs: they are dropped and the prompt computed whole)
    gen: int = -1
    #: ``kvLayout: paged``: the prompt's blocks are looked up and published in the store, under
    #: keys taken when the job runs (:meth:`ModelRunner._keys`)
    keyed: bool = False
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
                attention=spec.slot_attention_on(device.type),
                device=device,
                dtype=dtype,
            )
        self.batcher = DecodeBatcher(
            worker, self._step, max_batch=spec.max_decode_batch, steps_per_job=spec.decode_steps_per_job
        )
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
        gen: int = -1,
        keyed: bool = False,
        decodes: bool = False,
    ) -> PrefillResult:
        """``gen``: the weights generation ``start`` and ``runs`` were looked up under; ``keyed``
        (``kvLayout: paged``): the store looks the prompt's blocks up when the job runs."""
        job = PrefillJob(
            prompt, start, runs, capacity, sampling, ban, arena, region, cache_keeps_nothing, gen, keyed, decodes
        )
        return await self.prefills.submit(job)

    # ---- prefill, on the GPU thread ----------------------------------------------------------

    def _served(self, job: PrefillJob) -> PrefillJob:
        """``job`` as it runs now: a cached prefix looked up under other weights than those served
        (a refit swapped them since) dropped, the prompt computed whole."""
        if job.gen == self._weights.gen or not (job.start or job.runs):
            return job
        return replace(job, start=0, runs=[], gen=self._weights.gen)

    def _keys(self, job: PrefillJob) -> list[bytes] | None:
        """A ``keyed`` job's full-block cache keys, seeded with the weights served now."""
        if not job.keyed or self.turns is None:
            return None
        return block_hashes(self._weights.seed, job.prompt, self._spec.tokens_per_block)

    def _prefill_many(self, jobs: list[PrefillJob]) -> list[PrefillResult | Exception]:
        """The jobs that waited together: the cold ones in one batched pass when there are two or
        more, the others one by one; each job gets its result or its error. Their cached prefixes
        are decided here, under the weights served (:meth:`_served`, :meth:`_keys`)."""
        jobs = [self._served(job) for job in jobs]
        keys = [self._keys(job) for job in jobs]
        out: dict[int, PrefillResult | Exception] = {}
        turns = self.turns
        cold = [
            i
            for i, (job, k) in enumerate(zip(jobs, keys, strict=True))
            if job.cold and (turns is None or k is None or not turns.store.pool.cached_run(k))
        ]
        cold = cold if len(cold) > 1 else []
        if cold:
            try:
                batch = self._prefill_cold([jobs[i] for i in cold], [keys[i] for i in cold])
                out.update(zip(cold, batch, strict=True))
            except Exception as exc:
                out.update(dict.fromkeys(cold, exc))
        for i, (job, k) in enumerate(zip(jobs, keys, strict=True)):
            if i not in out:
                try:
                    out[i] = (
                        self._prefill_job(job) if turns is None or k is None else self._prefill_paged(turns, job, k)
                    )
                except Exception as exc:
                    out[i] = exc
        return [out[i] for i in range(len(jobs))]

    def _prefill_cold(self, jobs: list[PrefillJob], keys: list[list[bytes] | None]) -> list[PrefillResult]:
        """Cold prompts in one forward pass (:func:`~.model.prefill_batch`), first tokens in one pick."""
        self._weights.check_complete()
        kvs = [new_kv(self._shape, job.capacity, device=self._device, dtype=self._dtype) for job in jobs]
        logits = prefill_batch(self._weights.params, self._shape, [job.prompt for job in jobs], kvs)
        firsts = choose_tokens(logits, [job.sampling for job in jobs], [job.ban for job in jobs])
        gen, turns = self._weights.gen, self.turns
        out = []
        for job, k, kv, first in zip(jobs, keys, kvs, firsts, strict=True):
            kept = kv
            if turns is not None and k is not None:  # into the store after (a batch mate's blocks shared)
                turn = turns.open(k, len(job.prompt))
                kept = turns.settle(turn, kv, k, len(job.prompt), stays=job.decodes) or kv
            out.append(PrefillResult(kept, kv, first, gen, None))  # computed whole: nothing cached
        return out

    def _prefill_job(self, job: PrefillJob) -> PrefillResult:
        """Prefill ``prompt`` from ``start``, after its cached ``runs`` copied in. With an arena
        ``region`` the context's KV lies there: computed in place when the prefix cache keeps
        nothing, else copied there (the cache's blocks must outlive the region)."""
        self._weights.check_complete()
        in_place = False
        if job.arena is not None and job.region is not None and job.cache_keeps_nothing:
            kv, in_place = job.arena.view(job.region, self._kv_shape(job.capacity), self._dtype), True
        else:
            kv = new_kv(self._shape, job.capacity, device=self._device, dtype=self._dtype)
        for dst, base, src, n in job.runs:  # cached prefix blocks, copied instead of recomputed
            kv[:, :, :, dst : dst + n].copy_(base[:, :, :, src : src + n])
        logits = prefill(self._weights.params, self._shape, job.prompt[job.start :], kv, job.start)
        ctx_kv, where = self._to_arena(job, kv, in_place=in_place)
        first = choose_tokens(logits[None], [job.sampling], [job.ban])[0]
        return PrefillResult(kv, ctx_kv, first, self._weights.gen, where, job.start)

    def _prefill_paged(self, turns: PagedTurns, job: PrefillJob, keys: list[bytes]) -> PrefillResult:
        """Prefill into the paged store (:mod:`.kv.turns`): the prompt's cached blocks under
        ``keys`` shared in place, the rest computed and written into new blocks of its turn."""
        self._weights.check_complete()
        turn = turns.open(keys, len(job.prompt))
        try:
            kv, start = turns.past(turn, job.capacity), turn.hit  # the cached prefix read from its blocks
            logits = prefill(self._weights.params, self._shape, job.prompt[start:], kv, start)
            ctx_kv, where = self._to_arena(job, kv, in_place=False)
            first = choose_tokens(logits[None], [job.sampling], [job.ban])[0]
            kept = turns.settle(turn, kv, keys, len(job.prompt), stays=job.decodes) or kv
        except BaseException:
            turns.drop(turn)
            raise
        return PrefillResult(kept, ctx_kv, first, self._weights.gen, where, start)

    def _kv_shape(self, capacity: int) -> tuple[int, ...]:
        return (self._shape.layers, 2, self._shape.kv_heads, capacity, self._shape.head_dim)

    def _to_arena(self, job: PrefillJob, kv: Any, *, in_place: bool) -> tuple[Any, dict[str, Any] | None]:
        """The KV a context leg leaves, and its arena region's description: ``kv`` itself when it
        was computed there (``in_place``) or there is no region, else its copy into the region."""
        if job.arena is None or job.region is None:
            return kv, None
        shape = self._kv_shape(job.capacity)
        ctx_kv = kv if in_place else job.arena.view(job.region, shape, self._dtype).copy_(kv)
        return ctx_kv, job.arena.describe(job.region, shape, self._dtype)

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
