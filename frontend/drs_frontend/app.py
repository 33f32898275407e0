"""The frontend's routes, on :mod:`drs_frontend.httpserver`, in front of :class:`~drs_frontend.relay.Relay`.

=========================  =====================================================================
``POST /v1/chat/completions``  one turn (JSON or SSE)
``POST /v1/completions``       one turn (JSON or SSE)
``GET /health``                200 while the process serves (liveness)
``GET /ready``                 200 while at least one prefill and one decode engine answer /health
``GET /metrics``               Prometheus text (:mod:`drs_frontend.metrics`)
``GET /v1/models``             OpenAI's model list, an engine's (:mod:`drs_frontend.model_list`)
=========================  =====================================================================

Six routes and no request model worth validating twice (the engines validate), so routing is a
dict lookup and no web framework sits here (FastAPI, then a plain ASGI app on uvicorn, were
measured: ``bench/relay.py``). The server answers bodies over ``limits.max_request_bytes`` with
413 before the relay sees them, and cancels a turn whose client disconnects (counted in
``drs_frontend_client_disconnects_total``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Final

from drs_protocol import fields, routes
from drs_protocol.auth import Realm
from drs_protocol.errors import error_body
from drs_protocol.routes import Endpoint
from drs_protocol.token_source import GENERATIONS_HEADER, TokenSource, format_generations

from drs_frontend import wire_json
from drs_frontend.config import FrontendConfig
from drs_frontend.engine_info import adopt_block_tokens
from drs_frontend.health import HealthProber
from drs_frontend.httpserver import HttpServer, Request, Response, ServerLimits
from drs_frontend.metrics import CONTENT_TYPE_LATEST, FrontendMetrics
from drs_frontend.model_list import relay_model_list
from drs_frontend.relay import JSON, Relay
from drs_frontend.reload import watch_config
from drs_frontend.reply import Reply
from drs_frontend.routing.conversation import ConversationRouter
from drs_frontend.tokenization import ChatTokenizer
from drs_frontend.upstream import UpstreamClient, build_upstream

log = logging.getLogger(__name__)

ENDPOINTS: Final = {e.value: e for e in Endpoint}
CONVERSATION_HEADERS: Final = frozenset(h.encode() for h in fields.CONVERSATION_HEADERS)
JSON_TYPE: Final = JSON.encode()
NO_CACHE: Final = (b"cache-control", b"no-cache")


def json_response(status: int, payload: Any) -> Response:
    return Response(status, wire_json.dumps(payload))


def error_response(status: int, message: str) -> Response:
    """The server's own answers (413, 400, 500…), OpenAI-shaped like the relay's."""
    return json_response(status, error_body(status, message))


class FrontendApp:
    """``FrontendApp(config)``: :meth:`handle` is the server's handler; :meth:`startup` and
    :meth:`shutdown` bracket serving."""

    def __init__(
        self,
        config: FrontendConfig,
        *,
        upstream: UpstreamClient | None = None,
        chat_tokenizer: ChatTokenizer | None = None,
        serving_token: str | TokenSource | None = None,
    ) -> None:
        self.config = config
        self.metrics = FrontendMetrics()
        #: what this frontend presents to its engines (re-read from the mounted Secret: rotation)
        self.serving_tokens = TokenSource.of(serving_token)
        self.upstream = upstream or build_upstream(
            config.upstream_client,
            connect_timeout=config.timeouts.connect,
            limits=config.limits,
            serving_token=self.serving_tokens,
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
        #: prefixBlockTokens not configured: learning it from the prefill engines (engine_info)
        self._block_task: asyncio.Task[int] | None = None
        #: configWatch: applying changed fallback pools from the mounted config (reload)
        self._watch_task: asyncio.Task[None] | None = None
        #: re-reading the mounted serving token Secret (``drs_protocol.token_source``)
        self._token_task: asyncio.Task[None] | None = None

    def _in_flight(self) -> list[tuple[str, str, int]]:
        return [
            (pool.role, e.url, e.in_flight)
            for pool in (self.relay.prefill, self.relay.decode)
            for e in pool.engines.values()
        ]

    def server(self) -> HttpServer:
        """An :class:`HttpServer` serving this app under its config's limits."""
        limits = ServerLimits(max_body_bytes=self.config.limits.max_request_bytes)
        return HttpServer(
            self.handle, limits=limits, error_response=error_response, on_disconnect=self.metrics.disconnects.inc
        )

    # -- lifecycle -------------------------------------------------------------------------------

    async def startup(self) -> None:
        if self.config.tokenize and self.relay.chat_tokenizer is None:
            self.relay.chat_tokenizer = await asyncio.to_thread(load_chat_tokenizer, self.config)
        await self.upstream.start()
        self._prober_task = asyncio.create_task(self.prober.run(), name="health-prober")
        self._token_task = asyncio.create_task(self.serving_tokens.run(), name="serving-token")
        if self.config.config_watch:
            self._watch_task = asyncio.create_task(
                watch_config(
                    Path(self.config.config_watch),
                    self.relay.prefill,
                    self.relay.decode,
                    interval=self.config.health_interval,
                ),
                name="config-watch",
            )
        router = self.relay.ctx_router
        if "prefix_block_tokens" not in self.config.model_fields_set and isinstance(router, ConversationRouter):
            self._block_task = asyncio.create_task(
                adopt_block_tokens(
                    router,
                    self.relay.prefill,
                    self.upstream,
                    interval=self.config.health_interval,
                    timeout=self.config.timeouts.health,
                ),
                name="block-size",
            )

    async def shutdown(self) -> None:
        for task in (self._prober_task, self._block_task, self._watch_task, self._token_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.upstream.close()

    # -- routes ----------------------------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        path = request.path
        method = request.method
        endpoint = ENDPOINTS.get(path)
        if endpoint is not None:
            if method != "POST":
                return error_response(405, f"{path} takes POST")
            return await self._turn(endpoint, request)
        if path == routes.HEALTH and method in ("GET", "HEAD"):
            held = format_generations({str(Realm.SERVING): self.serving_tokens})  # no token, its generation
            headers = [(GENERATIONS_HEADER.encode(), held.encode())] if held else []
            return Response(200, wire_json.dumps({"status": "ok"}), headers=headers)
        if path == routes.READY and method in ("GET", "HEAD"):
            ready = self.prober.ready()
            status = {
                "ready": ready,
                "prefill": self.relay.prefill.answering(),
                "decode": self.relay.decode.answering(),
            }
            return json_response(200 if ready else 503, status)
        if path == routes.METRICS and method == "GET":
            return Response(200, self.metrics.render(), CONTENT_TYPE_LATEST.encode())
        if path == routes.MODELS and method == "GET":
            pools = (self.relay.prefill, self.relay.decode)
            code, body = await relay_model_list(pools, self.upstream, self.config.timeouts.models)
            return Response(code, body)
        return error_response(404, f"no route {method} {path}")

    async def _turn(self, endpoint: Endpoint, request: Request) -> Response:
        headers: dict[str, str] = {}
        for name, value in request.headers:
            if name in CONVERSATION_HEADERS:
                headers.setdefault(name.decode(), value.decode("latin-1"))
        started = time.perf_counter()
        try:
            reply = await self.relay.handle(endpoint, request.body, headers)
        except Exception:
            log.exception("unexpected error serving %s", endpoint.value)
            reply = Reply(500, JSON, wire_json.dumps(error_body(500, "internal error in the frontend")))
        self.metrics.request_seconds_of(endpoint.value).observe(time.perf_counter() - started)
        content_type = JSON_TYPE if reply.content_type == JSON else reply.content_type.encode()
        if reply.stream is None:
            return Response(reply.status, reply.body, content_type, reply.engine_headers())
        return Response(reply.status, b"", content_type, [NO_CACHE, *reply.engine_headers()], stream=reply.stream)


def load_chat_tokenizer(config: FrontendConfig) -> ChatTokenizer:
    """The configured tokenizer (default: the Qwen3 one) with its per-conversation cache."""
    from drs_protocol.chat import load_tokenizer

    tokenizer = load_tokenizer(config.tokenizer)
    return ChatTokenizer(
        tokenizer, max_entries=config.tokenize_cache.max_entries, max_bytes=config.tokenize_cache.max_bytes
    )
