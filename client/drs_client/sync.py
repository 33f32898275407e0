""":class:`Fleet`: the same client for a trainer without an event loop of its own (or one that must
not block it). It runs an :class:`~drs_client.aio.AsyncFleet` on a private event loop in a daemon
thread and waits for each call; it works whether or not the calling thread runs an event loop.

::

    with Fleet.connect("pod-sim", namespace="default") as fleet:
        view = fleet.wait_ready(timeout_s=300, progress=print)
        fleet.refit("/models/step-7", "step-7")
        for view in fleet.watch():            # blocks between changes
            ...
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Coroutine, Generator, Sequence
from typing import Any, Final, TypeVar

from drs_protocol.control import IpcBuffer
from drs_protocol.trainer_api import CollectiveInitReport, FanOutReport, FleetReport

from drs_client.aio import SIDECAR_START_TIMEOUT_S, WAIT_TIMEOUT_S, WEIGHTS_TIMEOUT_S, AsyncFleet, ProgressCallback
from drs_client.fleet import EngineView, FleetView
from drs_client.sidecar import AsyncSidecar, sidecar_url

T = TypeVar("T")

#: Seconds to wait for the private loop's thread to stop at :meth:`Fleet.close`.
CLOSE_TIMEOUT_S: Final = 10.0


class _LoopThread:
    """An event loop running forever in a daemon thread; :meth:`run` waits for one coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="drs-client", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self.loop.close()


class Fleet:
    """The blocking face of :class:`~drs_client.aio.AsyncFleet` (same methods, same errors). A
    progress callback runs on the client's own thread: it must not call this Fleet (that would
    wait for itself)."""

    def __init__(self, fleet: AsyncFleet, loop: _LoopThread) -> None:
        self._fleet = fleet
        self._loop = loop

    @classmethod
    def connect(
        cls,
        name: str,
        namespace: str = "default",
        *,
        kubeconfig: str | os.PathLike[str] | None = None,
        sidecar_url: str | None = None,
    ) -> Fleet:
        loop = _LoopThread()
        try:
            fleet = loop.run(AsyncFleet.connect(name, namespace, kubeconfig=kubeconfig, sidecar_url=sidecar_url))
        except BaseException:
            loop.stop()
            raise
        return cls(fleet, loop)

    @property
    def name(self) -> str:
        return self._fleet.name

    @property
    def namespace(self) -> str:
        return self._fleet.namespace

    def _run(self, awaitable: Awaitable[T]) -> T:
        async def wrapped() -> T:
            return await awaitable

        return self._loop.run(wrapped())

    def get(self) -> FleetView:
        return self._run(self._fleet.get())

    def urls(self) -> tuple[str, ...]:
        return self._run(self._fleet.urls())

    def engines(self) -> tuple[EngineView, ...]:
        return self._run(self._fleet.engines())

    def engine_weights(self) -> dict[str, str | None]:
        return self._run(self._fleet.engine_weights())

    def wait_ready(
        self,
        *,
        timeout_s: float = WAIT_TIMEOUT_S,
        progress: ProgressCallback | None = None,
        min_ready_replicas: int | None = None,
    ) -> FleetView:
        """As :meth:`AsyncFleet.wait_ready`; ``progress`` is called on the client's own thread."""
        return self._run(
            self._fleet.wait_ready(timeout_s=timeout_s, progress=progress, min_ready_replicas=min_ready_replicas)
        )

    def wait_weights(
        self, version: str, *, timeout_s: float = WEIGHTS_TIMEOUT_S, progress: ProgressCallback | None = None
    ) -> FleetView:
        return self._run(self._fleet.wait_weights(version, timeout_s=timeout_s, progress=progress))

    def watch(self) -> Generator[FleetView, None, None]:
        """The view now, then every change; blocks between changes. Close it (or leave the loop) to stop."""
        stream = self._fleet.watch()
        try:
            while True:
                try:
                    yield self._run(anext(stream))
                except StopAsyncIteration:
                    return
        finally:
            self._run(stream.aclose())

    def wait_sidecar(self, *, timeout_s: float = SIDECAR_START_TIMEOUT_S) -> None:
        self._run(self._fleet.wait_sidecar(timeout_s=timeout_s))

    def refit(self, path: str, version: str, *, digest: str | None = None) -> FanOutReport:
        return self._run(self._fleet.refit(path, version, digest=digest))

    def reset_prefix_cache(self) -> FanOutReport:
        return self._run(self._fleet.reset_prefix_cache())

    def sleep(self, tags: Sequence[str] = ()) -> FanOutReport:
        return self._run(self._fleet.sleep(tags))

    def wake(self, tags: Sequence[str] = ()) -> FanOutReport:
        return self._run(self._fleet.wake(tags))

    def served_weights(self) -> FleetReport:
        return self._run(self._fleet.served_weights())

    def close(self) -> None:
        try:
            self._run(self._fleet.close())
        finally:
            self._loop.stop()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Sidecar:
    """The blocking face of :class:`~drs_client.sidecar.AsyncSidecar`, for a trainer that knows only
    its sidecar's URL (``url``, else ``$DRS_SIDECAR_URL``). Safe to call from several threads at
    once (a collective step is in flight in one while the trainer joins the group in another)."""

    def __init__(self, url: str | None = None) -> None:
        self._loop = _LoopThread()
        self._sidecar = AsyncSidecar(sidecar_url(url))

    @property
    def url(self) -> str:
        return self._sidecar.url

    def _run(self, awaitable: Awaitable[T]) -> T:
        async def wrapped() -> T:
            return await awaitable

        return self._loop.run(wrapped())

    def healthy(self) -> bool:
        return self._run(self._sidecar.healthy())

    def refit(self, path: str, version: str, *, digest: str | None = None) -> FanOutReport:
        return self._run(self._sidecar.refit(path, version, digest=digest))

    def reset_prefix_cache(self) -> FanOutReport:
        return self._run(self._sidecar.reset_prefix_cache())

    def sleep(self, tags: Sequence[str] = ()) -> FanOutReport:
        return self._run(self._sidecar.sleep(tags))

    def wake(self, tags: Sequence[str] = ()) -> FanOutReport:
        return self._run(self._sidecar.wake(tags))

    def collective_init(self, ip: str, port: int, train_world_size: int) -> CollectiveInitReport:
        return self._run(self._sidecar.collective_init(ip, port, train_world_size))

    def collective_prepare(self, state_dict_info: dict[str, Any]) -> FanOutReport:
        return self._run(self._sidecar.collective_prepare(state_dict_info))

    def collective_update(
        self,
        version: str,
        *,
        drain: bool = True,
        recompute_kv: bool = False,
        path: str | None = None,
        digest: str | None = None,
    ) -> FanOutReport:
        return self._run(
            self._sidecar.collective_update(version, drain=drain, recompute_kv=recompute_kv, path=path, digest=digest)
        )

    def ipc_update(
        self,
        version: str,
        state_dict_info: dict[str, Any],
        buffers: Sequence[IpcBuffer | dict[str, Any]],
        *,
        path: str | None = None,
        digest: str | None = None,
    ) -> FanOutReport:
        return self._run(self._sidecar.ipc_update(version, state_dict_info, buffers, path=path, digest=digest))

    def fleet(self) -> FleetReport:
        return self._run(self._sidecar.fleet())

    def close(self) -> None:
        try:
            self._run(self._sidecar.close())
        finally:
            self._loop.stop()

    def __enter__(self) -> Sidecar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
