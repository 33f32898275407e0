""":class:`AsyncFleet`: one fleet for an asyncio trainer. It composes a :class:`~drs_client.kube.KubeReader`
(the status, through the Kubernetes API) and, when a sidecar URL is known, an
:class:`~drs_client.sidecar.AsyncSidecar` (refit, sleep, wake, prefix-cache reset).

::

    async with await AsyncFleet.connect("pod-sim", namespace="default") as fleet:
        view = await fleet.wait_ready(timeout_s=300, progress=print)
        urls = view.urls                      # NeMo-Gym's base_url list, replica-major
        await fleet.refit("/models/step-7", "step-7")
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, Final

from drs_protocol.trainer_api import FanOutReport, FleetReport
from kubernetes_asyncio.config import ConfigException

from drs_client.errors import FleetInvalid, FleetUnreadable, NoSidecar, SidecarUnreachable, WaitTimeout
from drs_client.fleet import EngineView, FleetView, Progress
from drs_client.kube import KubeReader, api_client
from drs_client.sidecar import AsyncSidecar

#: Seconds :meth:`AsyncFleet.wait_ready` waits unless told.
WAIT_TIMEOUT_S: Final = 600.0
#: Seconds :meth:`AsyncFleet.wait_weights` waits unless told (the operator copies the sidecar's record).
WEIGHTS_TIMEOUT_S: Final = 120.0
#: Seconds :meth:`AsyncFleet.wait_sidecar` waits unless told, and how often it asks.
SIDECAR_START_TIMEOUT_S: Final = 60.0
SIDECAR_POLL_S: Final = 0.5

ProgressCallback = Callable[[Progress], object]


class AsyncFleet:
    def __init__(self, reader: KubeReader, sidecar: AsyncSidecar | None = None) -> None:
        self.reader = reader
        self.sidecar = sidecar

    @classmethod
    async def connect(
        cls,
        name: str,
        namespace: str = "default",
        *,
        kubeconfig: str | os.PathLike[str] | None = None,
        sidecar_url: str | None = None,
    ) -> AsyncFleet:
        """Credentials from the pod (in a cluster) or ``kubeconfig``; the sidecar at ``sidecar_url``
        or ``$DRS_SIDECAR_URL`` (none: the sidecar calls raise ``NoSidecar``)."""
        from drs_client.sidecar import sidecar_url as resolve

        try:
            url: str | None = resolve(sidecar_url)
        except NoSidecar:
            url = None
        try:
            api = await api_client(kubeconfig)
        except (ConfigException, OSError) as exc:
            raise FleetUnreadable(namespace, name, f"no Kubernetes credentials: {exc}") from exc
        reader = KubeReader(api, namespace, name)
        return cls(reader, None if url is None else AsyncSidecar(url))

    @property
    def name(self) -> str:
        return self.reader.name

    @property
    def namespace(self) -> str:
        return self.reader.namespace

    # -- the status ----------------------------------------------------------------------------

    async def get(self) -> FleetView:
        """The fleet as its status shows it now."""
        return await self.reader.view()

    async def urls(self) -> tuple[str, ...]:
        """The frontends' URLs, replica-major (NeMo-Gym picks ``sha256(session) % len``)."""
        return (await self.get()).urls

    async def engines(self) -> tuple[EngineView, ...]:
        return (await self.get()).engines

    async def engine_weights(self) -> dict[str, str | None]:
        """Engine name -> the weights version the status shows for it."""
        return (await self.get()).engine_weights()

    def watch(self) -> AsyncGenerator[FleetView, None]:
        """The view now, then every change (phase, readiness, URLs, engines, weights)."""
        return self.reader.watch()

    async def wait_ready(
        self,
        *,
        timeout_s: float = WAIT_TIMEOUT_S,
        progress: ProgressCallback | None = None,
        min_ready_replicas: int | None = None,
    ) -> FleetView:
        """Until the fleet serves (:meth:`FleetView.serves`): ``progress`` gets every change on the
        way. ``FleetInvalid`` at once for an invalid spec, ``WaitTimeout`` after ``timeout_s``."""
        wanted = "phase Ready" if min_ready_replicas is None else f"{min_ready_replicas} ready replica(s)"
        return await self._wait(lambda v: v.serves(min_ready_replicas), wanted, timeout_s, progress)

    async def wait_weights(
        self, version: str, *, timeout_s: float = WEIGHTS_TIMEOUT_S, progress: ProgressCallback | None = None
    ) -> FleetView:
        """Until the status shows ``version`` for the fleet and every engine."""

        def done(view: FleetView) -> bool:
            return view.weights_version == version and all(e.weights_version == version for e in view.engines)

        return await self._wait(done, f"weights {version} on every engine", timeout_s, progress)

    async def _wait(
        self,
        done: Callable[[FleetView], bool],
        wanted: str,
        timeout_s: float,
        progress: ProgressCallback | None,
    ) -> FleetView:
        started = time.monotonic()
        last: FleetView | None = None
        watch = self.watch()
        try:
            async with asyncio.timeout(timeout_s):
                async for view in watch:
                    last = view
                    if progress is not None:
                        progress(_progress(view, time.monotonic() - started))
                    if view.invalid:
                        raise FleetInvalid(view, view.message)
                    if done(view):
                        return view
        except TimeoutError:
            if last is None:
                raise
            raise WaitTimeout(last, time.monotonic() - started, wanted) from None
        finally:
            await watch.aclose()
        raise AssertionError("the watch ended without an error")  # pragma: no cover

    # -- the sidecar ---------------------------------------------------------------------------

    def _sidecar(self) -> AsyncSidecar:
        if self.sidecar is None:
            raise NoSidecar("this fleet client has no sidecar: pass sidecar_url= or set $DRS_SIDECAR_URL")
        return self.sidecar

    async def wait_sidecar(self, *, timeout_s: float = SIDECAR_START_TIMEOUT_S) -> None:
        """Until the sidecar answers its health route (a native sidecar container may start after
        the trainer's); ``SidecarUnreachable`` after ``timeout_s``."""
        sidecar = self._sidecar()
        deadline = time.monotonic() + timeout_s
        while not await sidecar.healthy():
            if time.monotonic() > deadline:
                raise SidecarUnreachable(sidecar.url, f"not healthy after {timeout_s:.0f}s")
            await asyncio.sleep(SIDECAR_POLL_S)

    async def refit(self, path: str, version: str, *, digest: str | None = None) -> FanOutReport:
        """Every engine loads ``path`` and serves it as ``version`` (``RefitIncomplete`` names those
        that did not; the sidecar keeps the weights as desired and loads them there later);
        ``digest``: the :mod:`drs_protocol.weights_digest` of what the trainer wrote there."""
        return await self._sidecar().refit(path, version, digest=digest)

    async def reset_prefix_cache(self) -> FanOutReport:
        return await self._sidecar().reset_prefix_cache()

    async def sleep(self, tags: Sequence[str] = ()) -> FanOutReport:
        return await self._sidecar().sleep(tags)

    async def wake(self, tags: Sequence[str] = ()) -> FanOutReport:
        return await self._sidecar().wake(tags)

    async def served_weights(self) -> FleetReport:
        """What every engine answers now (through the sidecar), with the desired and published weights."""
        return await self._sidecar().fleet()

    # -- lifetime ------------------------------------------------------------------------------

    async def close(self) -> None:
        await self.reader.close()
        if self.sidecar is not None:
            await self.sidecar.close()

    async def __aenter__(self) -> AsyncFleet:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def _progress(view: FleetView, elapsed_s: float) -> Progress:
    return Progress(
        phase=view.phase,
        ready_replicas=view.ready_replicas,
        replicas=view.replicas,
        urls=len(view.urls),
        message=view.message,
        elapsed_s=elapsed_s,
        view=view,
    )
