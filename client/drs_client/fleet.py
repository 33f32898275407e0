"""What the trainer reads of a fleet: :class:`FleetView`, parsed from the DisaggReplicaSet with the
operator's own status models (the one schema source), and what "serving" means.

Pure: no I/O. :func:`drs_client.parse.view_of` builds a view from the resource as the API returns it.
"""

from __future__ import annotations

from dataclasses import dataclass

from drs_operator.api.constants import Phase


@dataclass(frozen=True, slots=True)
class EngineView:
    """One engine: ``weights_version`` as the operator shows it (None: the weights it started with)."""

    name: str
    role: str
    replica: int
    url: str | None
    ready: bool
    weights_version: str | None
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class FleetView:
    """One DisaggReplicaSet as its status shows it. Equal views are the same as far as a trainer cares
    (the watch yields a new one only when something here changed)."""

    namespace: str
    name: str
    generation: int | None
    observed_generation: int | None
    phase: str | None
    replicas: int
    ready_replicas: int
    updated_replicas: int
    urls: tuple[str, ...]
    engines: tuple[EngineView, ...]
    weights_version: str | None
    message: str
    #: the model name clients send (``spec.model.servedName``, else its path)
    model: str | None = None
    #: ``spec.model.parsers.reasoning``: the engines split reasoning from the answer
    reasoning_parser: str | None = None

    @property
    def current(self) -> bool:
        """The status was written for the spec as it is now (not an older generation)."""
        return self.generation is None or self.observed_generation == self.generation

    @property
    def invalid(self) -> bool:
        return self.current and self.phase == Phase.INVALID.value

    def serves(self, min_ready_replicas: int | None = None) -> bool:
        """Serving: the status is current, there are URLs, and either the phase is Ready (every replica
        ready and updated; ``min_ready_replicas`` None) or at least that many replicas are ready."""
        if not self.current or not self.urls:
            return False
        if min_ready_replicas is None:
            return self.phase == Phase.READY.value
        return self.ready_replicas >= min_ready_replicas

    def engine_weights(self) -> dict[str, str | None]:
        """Engine name -> the weights version the status shows for it."""
        return {e.name: e.weights_version for e in self.engines}


@dataclass(frozen=True, slots=True)
class Progress:
    """What a wait reports to its callback on every change."""

    phase: str | None
    ready_replicas: int
    replicas: int
    urls: int
    message: str
    elapsed_s: float
    view: FleetView
