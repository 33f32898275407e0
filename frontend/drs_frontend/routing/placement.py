"""Where a new group goes, and where a group this frontend does not know is: pure rules, no I/O.

* :func:`bounded_walk`: a new opening's first turn walks the first ``width`` engines of the
  rendezvous order of its key and takes the first whose recent prefill work, with this prompt
  added, stays within ``c`` times the mean over the replica's engines (the mean counting this
  prompt; the bound in whole prompts of this size, at least one); when none of them has room, the
  one of least work. So no engine ends above ``c`` times the mean unless the least loaded one
  would (a few prompts over many engines). Consistent hashing with bounded loads (Mirrokni,
  Thorup and Zadimoghaddam), with the prompt's tokens as the unit of load.
* :func:`bounded_choice`: the walk's engine and the bound it kept, the limit of the claim that
  counts the placement on that engine at once (so groups placed concurrently, from one snapshot
  of the loads, spread: a refused claim brings the engine's live work, and the walk goes on);
* :class:`ReportedWork`: the engines' figures from their last answers, over which a new group's
  claim is walked when it goes with the lookup (one round trip);
* :func:`found_engine`: the engine a lookup found holding the longest prefix of the opening
  (``drs_protocol.prefix_lookup``); for a first turn only one that holds all of it (a partial hold,
  e.g. a system prompt that every group shares, says nothing about where this group is).
* :func:`reported_work`: the engines' own recent prefill work, as they answered the lookup: what
  the walk reads when every engine asked said it, so the replica's frontends, asking the same
  engines, walk with the same loads and place a group alike;
* :class:`RecentWork`: the prompt tokens of the last ``window`` openings this frontend placed or
  found, per engine: the load the walk bounds when an engine did not report its own. In-flight work alone does not balance GRPO
  placement: a group costs its engine one prefill (~50 ms for 1k tokens on the sim), usually over
  before the next group arrives, so the engines look idle at every placement.

Since the walk reads this frontend's memory, a restarted frontend (or the replica's other one)
may not place a group where the first one did; it does not need to: it finds the group with the
lookup, which asks the same ``width`` engines the walk may choose from.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from drs_protocol.prefix_lookup import PrefixHeld

#: Work within ``size / TIE_PARTS`` of the least loaded engine's is a tie (:func:`bounded_walk`).
TIE_PARTS = 8


def work_bound(total: int, size: int, n: int, factor: float) -> int:
    """Most recent work an engine may hold after taking a prompt of ``size`` tokens: ``factor``
    times the mean after placement, in whole prompts of ``size`` (rounded down, at least one)."""
    if n <= 0:
        raise ValueError("no engines")
    unit = max(1, size)
    return unit * max(1, math.floor(factor * (total + unit) / (n * unit)))


def bounded_walk(
    order: Sequence[str], urls: Sequence[str], work: Callable[[str], int], size: int, factor: float, width: int
) -> str:
    """The first of ``order[:width]`` whose ``work`` plus ``size`` is within :func:`work_bound` over
    ``urls`` (every candidate engine); else the first of them whose work is within an eighth of a
    prompt of the least (work that differs by less, such as siblings' last partial blocks, is a
    tie: else every group placed from one snapshot of the loads, as concurrent placements are,
    would go to the one engine a few tokens below the others)."""
    return bounded_choice(order, urls, work, size, factor, width)[0]


def bounded_choice(
    order: Sequence[str], urls: Sequence[str], work: Callable[[str], int], size: int, factor: float, width: int
) -> tuple[str, int | None]:
    """:func:`bounded_walk`'s engine and the ``limit`` of the claim that counts the placement there
    (``drs_protocol.prefix_lookup.PrefixClaim``): the bound it was within; where no engine of the
    walk had room, the least loaded one's work as read plus this prompt (the engine refuses if
    work was placed there since: the walk goes on with its live figure)."""
    if not order:
        raise ValueError("no engines")
    walk = order[: max(1, width)]
    bound = work_bound(sum(work(u) for u in urls), size, len(urls), factor)
    for url in walk:
        if work(url) + max(1, size) <= bound:
            return url, bound
    least = min(work(u) for u in walk)
    url = next(u for u in walk if TIE_PARTS * (work(u) - least) <= max(1, size))
    return url, work(url) + max(1, size)


class ReportedWork:
    """The engines' own recent work as their last answers gave it (``recent_work``), per engine URL:
    what a claim sent with the next lookup is walked over (:meth:`.ConversationRouter.claim_ahead`).
    Safe to lose: without a figure the placement takes two round trips, as before."""

    def __init__(self, max_engines: int = 1024) -> None:
        self._work: dict[str, int] = {}
        self._max = max_engines

    def update(self, answers: Mapping[str, PrefixHeld]) -> None:
        for url, answer in answers.items():
            if answer.recent_work is not None and (url in self._work or len(self._work) < self._max):
                self._work[url] = answer.recent_work

    def figures(self) -> dict[str, int]:
        return dict(self._work)


def found_engine(order: Sequence[str], held: Mapping[str, PrefixHeld], *, whole: bool) -> str | None:
    """Of the engines in ``order`` that answered, the one holding the most leading blocks, now or
    once its legs in flight end (``pending_blocks``: a sibling another frontend sent there a moment
    ago; ties: earlier in order); None when none holds any (or, ``whole``, none holds every block)."""
    best: str | None = None
    most = 0
    for url in order:
        answer = held.get(url)
        if answer is None or answer.will_hold <= most or (whole and not answer.will_cover):
            continue
        best, most = url, answer.will_hold
    return best


def reported_work(order: Sequence[str], held: Mapping[str, PrefixHeld]) -> dict[str, int] | None:
    """The engines' own recent prefill work (``recent_work``), when every engine in ``order``
    answered with it; else None (the frontend's own memory stands in)."""
    work: dict[str, int] = {}
    for url in order:
        answer = held.get(url)
        if answer is None or answer.recent_work is None:
            return None
        work[url] = answer.recent_work
    return work


class RecentWork:
    """Prompt tokens of the last ``window`` openings placed (or found) per engine."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError("window must be at least 1")
        self._placed: deque[tuple[str, int]] = deque()
        self._window = window
        self._work: dict[str, int] = {}

    def __call__(self, url: str) -> int:
        return self._work.get(url, 0)

    def add(self, url: str, tokens: int) -> None:
        self._placed.append((url, tokens))
        self._work[url] = self._work.get(url, 0) + tokens
        if len(self._placed) > self._window:
            old, old_tokens = self._placed.popleft()
            self._work[old] -= old_tokens
