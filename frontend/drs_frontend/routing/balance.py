"""Stateless balancing: least in-flight (ties in turn) and plain round robin."""

from __future__ import annotations

from collections.abc import Sequence

from drs_frontend.routing.base import Candidate, Decision, Reason


class LeastLoadedRouter:
    """The candidate with the fewest requests in flight; equal loads take turns."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, candidates: Sequence[Candidate]) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        low = min(c.in_flight for c in candidates)
        tied = [c for c in candidates if c.in_flight == low]
        chosen = tied[self._turn % len(tied)]
        self._turn += 1
        return Decision(chosen.url, Reason.LEAST_LOADED)


class RoundRobinRouter:
    """Each candidate in turn, whatever its load."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, candidates: Sequence[Candidate]) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        chosen = candidates[self._turn % len(candidates)]
        self._turn += 1
        return Decision(chosen.url, Reason.ROUND_ROBIN)
