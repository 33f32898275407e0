"""The operator's calls to engines: ``GET /control/weights`` on every serving engine, bounded.

:class:`EngineClient` is the one place the operator makes an HTTP call to an engine: every
request goes through :meth:`EngineClient._get`, which adds the fleet's control-API bearer token
(read from the fleet's ``<name>-control`` Secret, :func:`control_token`), so another header
(a different credential) is added in one place.

:meth:`EngineClient.observe` asks every target at once, at most :data:`OBSERVE_CONCURRENCY` in
flight, each call within :data:`OBSERVE_CALL_S`, and returns within :data:`OBSERVE_BUDGET_S`
whatever happens: a call still running then is cancelled and its engine is unknown for this
pass. An engine that refuses, times out or answers outside the contract (``WeightsInfo``) is
unknown too, never holding anything (``drs_operator.engine_observation``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Final

import httpx
from drs_protocol import fields, routes
from drs_protocol.control import CatchUpPhase, WeightsInfo
from drs_protocol.routes import CONTROL_WEIGHTS
from drs_protocol.token_source import GENERATIONS_HEADER, KEY_NEXT, KEY_TOKEN, parse_generations
from drs_protocol.weights_state import HeldWeights
from pydantic import ValidationError

from drs_operator.api import names
from drs_operator.api.objects import Manifest
from drs_operator.engine_observation import Observation, Target
from drs_operator.manifests.rotation import secret_keys

log = logging.getLogger(__name__)

#: Seconds for one engine's ``GET /control/weights`` (connect included): the engine answers from
#: memory, so a slower answer means a busy or sick engine, unknown for this pass.
OBSERVE_CALL_S: Final = 2.0
#: Seconds one reconcile pass waits for all its engines' answers at most (the script goes on then).
OBSERVE_BUDGET_S: Final = 3.0
#: Calls in flight at once per pass.
OBSERVE_CONCURRENCY: Final = 32
#: Idle connections expire before the engines' uvicorn keep-alive (5 s) closes them.
KEEPALIVE_S: Final = 2.0


def secret_token(secrets: Mapping[str, Manifest], secret_name: str) -> str | None:
    """The token a live token Secret asks callers to present (``drs_operator.manifests.rotation``):
    its ``token`` key, or ``next`` while a re-created Secret has none; None when there is no such
    Secret or neither key is readable. The one reader of both the control and the serving token."""
    keys = secret_keys(secrets.get(secret_name) or {})
    return keys.get(KEY_TOKEN) or keys.get(KEY_NEXT) or None


def control_token(secrets: Mapping[str, Manifest], drs: str) -> str | None:
    """The fleet's control-API token from its live ``<drs>-control`` Secret, or None."""
    return secret_token(secrets, names.control_secret_name(drs))


def serving_token(secrets: Mapping[str, Manifest], drs: str) -> str | None:
    """The fleet's serving token from its live ``<drs>-serving`` Secret, or None."""
    return secret_token(secrets, names.serving_secret_name(drs))


class EngineClient:
    """Engine HTTP calls of the operator, one shared connection pool."""

    def __init__(
        self,
        *,
        call_s: float = OBSERVE_CALL_S,
        budget_s: float = OBSERVE_BUDGET_S,
        concurrency: int = OBSERVE_CONCURRENCY,
    ) -> None:
        self.call_s = call_s
        self.budget_s = budget_s
        self.concurrency = concurrency
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            limits = httpx.Limits(
                max_connections=self.concurrency,
                max_keepalive_connections=self.concurrency,
                keepalive_expiry=KEEPALIVE_S,
            )
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.call_s), limits=limits)
        return self._client

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def _get(self, url: str, route: str, token: str) -> httpx.Response:
        """The one engine request: ``GET url+route`` with the control API's credentials."""
        return await self._http().get(url + route, headers=fields.control_auth(token), timeout=self.call_s)

    async def weights(self, target: Target, token: str) -> Observation:
        """What ``target`` answers it holds; an :class:`Observation` without ``held`` saying why not."""
        serving = target.serving
        try:
            response = await self._get(target.url, CONTROL_WEIGHTS, token)
        except httpx.TimeoutException:
            return Observation(target.engine, None, f"no answer within {self.call_s:g}s", serving)
        except httpx.HTTPError as exc:
            return Observation(target.engine, None, f"unreachable: {exc}", serving)
        if response.status_code != 200:
            return Observation(target.engine, None, f"answered {response.status_code}", serving)
        try:
            info = WeightsInfo.model_validate_json(response.content)
            held = HeldWeights(version=info.weights_version, digest=info.weights_digest)
        except ValidationError as exc:
            return Observation(target.engine, None, f"its answer breaks the control API's contract: {exc}", serving)
        return Observation(target.engine, held, serving=serving, catch_up=catch_up_reason(info))

    async def observe(self, targets: Sequence[Target], token: str | None) -> list[Observation]:
        """Every target's :meth:`weights`, within :attr:`budget_s` in all (late ones: unknown)."""
        if not targets:
            return []
        if token is None:
            return [Observation(t.engine, None, "no control token (the fleet's Secret)") for t in targets]
        gate = asyncio.Semaphore(self.concurrency)

        async def one(target: Target) -> Observation:
            async with gate:
                return await self.weights(target, token)

        tasks = [asyncio.create_task(one(t)) for t in targets]
        done, late = await asyncio.wait(tasks, timeout=self.budget_s)
        for task in late:
            task.cancel()
        if late:
            await asyncio.gather(*late, return_exceptions=True)
            log.warning("%d engine(s) did not answer within the pass's %gs budget", len(late), self.budget_s)
        out = []
        for target, task in zip(targets, tasks, strict=True):
            if task not in done or task.cancelled():
                out.append(Observation(target.engine, None, f"no answer within the pass's {self.budget_s:g}s budget"))
            elif (exc := task.exception()) is not None:
                out.append(Observation(target.engine, None, f"the call failed: {exc!r}"))
            else:
                out.append(task.result())
        return out

    async def token_generations(self, urls: Mapping[str, str]) -> dict[str, dict[str, int]]:
        """Pod name -> the token Secret generations its ``/health`` answer says it holds
        (``token_source.GENERATIONS_HEADER``; an open route: no credential is sent). Pods that do
        not answer within :attr:`budget_s`, or answer without a readable header, are left out."""
        if not urls:
            return {}
        gate = asyncio.Semaphore(self.concurrency)

        async def one(url: str) -> dict[str, int] | None:
            async with gate:
                try:
                    response = await self._http().get(url + routes.HEALTH, timeout=self.call_s)
                    return parse_generations(response.headers.get(GENERATIONS_HEADER))
                except (httpx.HTTPError, ValueError) as exc:
                    log.info("%s: no token generations: %s", url, exc)
                    return None

        names = list(urls)
        tasks = [asyncio.create_task(one(urls[n])) for n in names]
        done, late = await asyncio.wait(tasks, timeout=self.budget_s)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        return {n: r for n, t in zip(names, tasks, strict=True) if t in done and (r := t.result()) is not None}


#: The longest catch-up reason kept from an engine's answer (a condition message stays readable).
MAX_CATCH_UP_REASON_CHARS: Final = 300


def catch_up_reason(info: WeightsInfo) -> str | None:
    """Why the engine is not at the desired weights it started under (None: it is, or says nothing)."""
    catch_up = info.catch_up
    if catch_up is None or catch_up.phase is not CatchUpPhase.PENDING:
        return None
    if catch_up.last_error is None:
        return f"catching up from {catch_up.source}"
    reason = f"catching up from {catch_up.source}, attempt {catch_up.attempts} failed: {catch_up.last_error}"
    return reason if len(reason) <= MAX_CATCH_UP_REASON_CHARS else reason[: MAX_CATCH_UP_REASON_CHARS - 1] + "…"
