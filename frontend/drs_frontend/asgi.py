"""The HTTP surface: a plain ASGI app (no framework) in front of :class:`~drs_frontend.relay.Relay`.

Chosen over FastAPI by measurement (``bench/relay.py``: the same relay behind FastAPI routes
used up to ~15% more frontend CPU per turn, within the noise of the shared machine at best) and
because it has nothing FastAPI would add: five routes, and no request model worth validating
twice (the engines validate), so routing is a dict lookup.

=========================  =====================================================================
``POST /v1/chat/completions``  one turn (JSON or SSE)
``POST /v1/completions``       one turn (JSON or SSE)
``GET /health``                200 while the process serves (liveness)
``GET /ready``                 200 while at least one prefill and one decode engine answer /health
``GET /metrics``               Prometheus text (:mod:`drs_frontend.metrics`)
=========================  =====================================================================

A request body over ``limits.max_request_bytes`` gets 413 before it is read in full. Once a turn
has run for ``WATCH_AFTER_S``, a watcher waits for the client's ``http.disconnect`` and cancels
the turn, which closes the engine connection in use (the engine sees its client go away). Turns
that end sooner (most, against fast engines) never start the watcher task: it was a task, an
event wait and a cancellation per turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

from drs_protocol import fields

from drs_frontend import wire_json
from drs_frontend.config import FrontendConfig
from drs_frontend.health import HealthProber
from drs_frontend.metrics import CONTENT_TYPE_LATEST, FrontendMetrics
from drs_frontend.relay import JSON, Relay, Reply
from drs_frontend.shaping import Endpoint, error_body
from drs_frontend.tokenization import ChatTokenizer
from drs_frontend.upstream import UpstreamClient, build_upstream

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

ENDPOINTS: Final = {e.value: e for e in Endpoint}
CONVERSATION_HEADERS: Final = frozenset(h.encode() for h in fields.CONVERSATION_HEADERS)
#: Seconds a turn runs before a watcher task starts waiting for the client to disconnect (a
#: client gone sooner is noticed then: uvicorn remembers the disconnect).
WATCH_AFTER_S: Final = 0.02


class ClientGone(Exception):
    """The client disconnected before its request body was read."""


class FrontendApp:
    """``FrontendApp(config)`` is the ASGI callable uvicorn serves."""

    def __init__(
        self,
        config: FrontendConfig,
        *,
        upstream: UpstreamClient | None = None,
        chat_tokenizer: ChatTokenizer | None = None,
    ) -> None:
        self.config = config
        self.metrics = FrontendMetrics()
        self.upstream = upstream or build_upstream(
            config.upstream_client, connect_timeout=config.timeouts.connect, limits=config.limits
        )
        self.relay = Relay(config, upstream=self.upstream, metrics=self.metrics, chat_tokenizer=chat_tokenizer)
        self.prober = HealthProber(
            [self.relay.prefill, self.relay.decode],
            self.upstream,
            self.metrics,
            interval=config.health_interval,
            timeout=config.timeouts.health,
        )
        self.metrics.watch_in_flight(self._in_flight)
        self._prober_task: asyncio.Task[None] | None = None

    def _in_flight(self) -> list[tuple[str, str, int]]:
        return [
            (pool.role, e.url, e.in_flight)
            for pool in (self.relay.prefill, self.relay.decode)
            for e in pool.engines.values()
        ]

    # -- lifecycle -------------------------------------------------------------------------------

    async def startup(self) -> None:
        if self.config.tokenize and self.relay.chat_tokenizer is None:
            self.relay.chat_tokenizer = await asyncio.to_thread(load_chat_tokenizer, self.config)
        await self.upstream.start()
        self._prober_task = asyncio.create_task(self.prober.run(), name="health-prober")

    async def shutdown(self) -> None:
        if self._prober_task is not None:
            self._prober_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober_task
        await self.upstream.close()

    # -- ASGI ------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    log.exception("frontend startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        endpoint = ENDPOINTS.get(path)
        if endpoint is not None:
            if method != "POST":
                await _send_json(send, 405, error_body(405, f"{path} takes POST"))
                return
            await self._relay(endpoint, scope, receive, send)
        elif path == "/health" and method in ("GET", "HEAD"):
            await _send_json(send, 200, {"status": "ok"})
        elif path == "/ready" and method in ("GET", "HEAD"):
            ready = self.prober.ready()
            status = {
                "ready": ready,
                "prefill": self.relay.prefill.answering(),
                "decode": self.relay.decode.answering(),
            }
            await _send_json(send, 200 if ready else 503, status)
        elif path == "/metrics" and method == "GET":
            await _send(send, 200, CONTENT_TYPE_LATEST.encode(), self.metrics.render())
        else:
            await _send_json(send, 404, error_body(404, f"no route {method} {path}"))

    async def _relay(self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send) -> None:
        headers: dict[str, str] = {}
        length = -1
        for name, value in scope["headers"]:
            if name in CONVERSATION_HEADERS:
                headers.setdefault(name.decode(), value.decode("latin-1"))
            elif name == b"content-length":
                length = int(value) if value.isdigit() else -1
        limit = self.config.limits.max_request_bytes
        if length > limit:
            await _send_json(send, 413, error_body(413, f"request body of {length} bytes exceeds {limit}"))
            return
        try:
            raw = await _read_body(receive, limit)
        except ClientGone:
            self.metrics.disconnects.inc()
            return
        if raw is None:
            await _send_json(send, 413, error_body(413, f"request body exceeds {limit} bytes"))
            return
        await self._serve_turn(endpoint, raw, headers, receive, send)

    async def _serve_turn(
        self, endpoint: Endpoint, raw: bytes, headers: dict[str, str], receive: Receive, send: Send
    ) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        gone = False
        watcher: asyncio.Task[None] | None = None

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        def start_watching() -> None:
            nonlocal watcher
            watcher = loop.create_task(watch())

        timer = loop.call_later(WATCH_AFTER_S, start_watching)
        started = loop.time()
        try:
            try:
                reply = await self.relay.handle(endpoint, raw, headers)
            except Exception:
                log.exception("unexpected error serving %s", endpoint.value)
                reply = Reply(500, JSON, wire_json.dumps(error_body(500, "internal error in the frontend")))
            self.metrics.request_seconds_of(endpoint.value).observe(loop.time() - started)
            await _send_reply(send, reply)
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()
            self.metrics.disconnects.inc()
        finally:
            timer.cancel()
            if watcher is not None:
                watcher.cancel()


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None once it passes ``limit`` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _send(
    send: Send, status: int, content_type: bytes, body: bytes, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if extra:
        headers.extend(extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_json(send: Send, status: int, payload: Any) -> None:
    await _send(send, status, JSON.encode(), wire_json.dumps(payload))


async def _send_reply(send: Send, reply: Reply) -> None:
    if reply.stream is None:
        await _send(send, reply.status, reply.content_type.encode(), reply.body, reply.engine_headers())
        return
    stream = reply.stream
    async with contextlib.aclosing(stream):  # type: ignore[type-var]
        headers = [
            (b"content-type", reply.content_type.encode()),
            (b"cache-control", b"no-cache"),
            *reply.engine_headers(),
        ]
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        async for chunk in stream:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def load_chat_tokenizer(config: FrontendConfig) -> ChatTokenizer:
    """The configured tokenizer (default: the Qwen3 one) with its per-conversation cache."""
    from drs_protocol.chat import load_tokenizer

    tokenizer = load_tokenizer(config.tokenizer)
    return ChatTokenizer(
        tokenizer, max_entries=config.tokenize_cache.max_entries, max_bytes=config.tokenize_cache.max_bytes
    )
