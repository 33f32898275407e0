"""How the ``torch`` backend picks tokens: a request's :class:`Sampling`, the banned-id masks, and
:func:`choose_tokens` for a batch of rows (greedy or sampled, with log-probabilities)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from drs_engine.backends.base import LegRequest


@dataclass(frozen=True, slots=True)
class Sampling:
    """How one request picks tokens: ``temperature`` 0 is greedy."""

    temperature: float
    top_p: float
    top_k: int
    logprobs: bool
    top_logprobs: int
    generator: Any = None


@dataclass(frozen=True, slots=True)
class Choice:
    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...] = ()


def choose_tokens(logits: Any, samplings: list[Sampling], banned: list[Any]) -> list[Choice]:
    """One token per row of ``logits`` ``[batch, vocab]`` (float32); ``banned[b]``: a bool mask of
    ids row ``b`` may not pick (outside the tokenizer, or EOS before ``min_tokens``)."""
    with torch.inference_mode():
        return _choose(logits, samplings, banned)


def _choose(logits: Any, samplings: list[Sampling], banned: list[Any]) -> list[Choice]:
    same = all(b is banned[0] for b in banned)  # the usual case: one mask broadcast, no stack
    masked = logits.masked_fill(banned[0] if same else torch.stack(banned), float("-inf"))
    want_lp = any(s.logprobs for s in samplings)
    logp = torch.log_softmax(masked, dim=-1) if want_lp else None
    greedy = masked.argmax(dim=-1)
    if all(s.temperature <= 0 for s in samplings):
        ids = greedy  # the whole batch greedy: no per-row work
    else:
        ids = torch.stack([greedy[b] if s.temperature <= 0 else _sample(masked[b], s) for b, s in enumerate(samplings)])
    k = max((s.top_logprobs for s in samplings), default=0)
    chosen_lp = logp.gather(1, ids[:, None])[:, 0].tolist() if logp is not None else None
    top = torch.topk(logp, k, dim=-1) if logp is not None and k > 0 else None
    top_ids = top.indices.tolist() if top is not None else None
    top_vals = top.values.tolist() if top is not None else None
    out: list[Choice] = []
    for b, (token, s) in enumerate(zip(ids.tolist(), samplings, strict=True)):
        lp = float(chosen_lp[b]) if chosen_lp is not None and s.logprobs else None
        alts: tuple[tuple[int, float], ...] = ()
        if top_ids is not None and top_vals is not None and s.top_logprobs:
            alts = tuple((int(i), float(v)) for i, v in zip(top_ids[b][: s.top_logprobs], top_vals[b], strict=False))
        out.append(Choice(int(token), lp, alts))
    return out


def _sample(row: Any, s: Sampling) -> Any:
    scaled = row / s.temperature
    if s.top_k > 0:
        kth = torch.topk(scaled, min(s.top_k, scaled.shape[-1])).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if s.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < s.top_p
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p * keep)
    return torch.multinomial(probs, 1, generator=s.generator)[0]


def sampling_for(leg: LegRequest, device: Any) -> Sampling:
    """The leg's sampling parameters (a seeded generator when it samples with a ``seed``)."""
    req = leg.request
    temperature = 1.0 if req.temperature is None else float(req.temperature)
    generator = None
    if temperature > 0 and req.seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(int(req.seed))
    return Sampling(
        temperature=temperature,
        top_p=float(req.top_p or 1.0),
        top_k=int(req.top_k or 0),
        logprobs=leg.logprobs,
        top_logprobs=leg.top_logprobs,
        generator=generator,
    )


class BanMasks:
    """Ids a pick may not take: outside the tokenizer (random models), plus EOS before ``min_tokens``.
    ``ignore_eos`` bans nothing (TensorRT-LLM's meaning: EOS may be picked and does not end the leg)."""

    def __init__(self, vocab_size: int, *, vocab_limit: int | None, eos_token_id: int, device: Any) -> None:
        base = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if vocab_limit is not None:
            base[vocab_limit:] = True
            if eos_token_id < vocab_size:
                base[eos_token_id] = False
        with_eos = base.clone()
        if eos_token_id < vocab_size:
            with_eos[eos_token_id] = True
        self._masks = {False: base, True: with_eos}

    def mask(self, *, produced: int, min_tokens: int) -> Any:
        """The mask for a leg's next pick after ``produced`` tokens (EOS banned before ``min_tokens``)."""
        return self._masks[produced < min_tokens]
