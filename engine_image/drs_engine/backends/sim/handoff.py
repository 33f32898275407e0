"""The ``sim`` backend's KV handoff, both ends (part of the test double).

A context-only leg leaves its prefix state (:class:`~drs_engine.kv_store.ContextState`, the
double's "KV") in a bounded store under ``ctx_request_id``; the decode engine fetches it once as
JSON over HTTP from ``ctx_info_endpoint`` (``GET /v1/disagg/kv/{ctx_request_id}``), checks it is
its own (digest, prompt, first token) and continues from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import httpx
from drs_protocol.routes import kv_export_path
from drs_protocol.token_source import TokenSource

from drs_engine.backends.base import ContextHandoff, LegRequest
from drs_engine.backends.handoff import (
    ContextSource,
    check_received,
    context_request_id,
    context_source,
    decode_opaque,
    encode_opaque,
    left_context,
    missing_here,
    raise_for_fetch_status,
)
from drs_engine.backends.sim.model import PrefixState, TokenChoice
from drs_engine.config import SimSpec
from drs_engine.errors import ContextMismatchError, KvTransferError
from drs_engine.kv_store import ContextState, ContextStore
from drs_engine.peer_auth import peer_auth

#: Timeouts of the decode engine's KV fetch from a prefill engine.
KV_FETCH_TIMEOUT: Final = httpx.Timeout(connect=2.0, read=30.0, write=30.0, pool=5.0)
#: Idle connections expire before the peer's uvicorn keep-alive timeout (5 s) closes them, so a
#: fetch never goes out on a connection the prefill engine is closing.
KV_FETCH_LIMITS: Final = httpx.Limits(max_connections=64, max_keepalive_connections=32, keepalive_expiry=2.0)
#: A fetch that failed before the prefill engine answered (a closed idle connection) is sent once more.
KV_FETCH_RETRYABLE: Final = (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError)
OPAQUE_STATE_KIND: Final = "drs-sim-kv/1"


@dataclass(frozen=True, slots=True)
class ReceivedContext:
    """A context fetched from a prefill engine, checked to be this leg's."""

    state: PrefixState
    first: TokenChoice
    cached_tokens: int
    weights_version: str


class SimHandoff:
    """The context store (prefill side) and the HTTP fetch (decode side)."""

    def __init__(
        self, spec: SimSpec, endpoint: str, peer_headers: TokenSource | Mapping[str, str] | None = None
    ) -> None:
        self.endpoint = endpoint
        #: what the KV fetch presents to a prefill engine (the fleet's serving token)
        self._peer_auth, self._peer_headers = peer_auth(peer_headers)
        self._store: ContextStore[ContextState] = ContextStore(
            capacity=spec.kv_store_capacity, ttl_seconds=spec.kv_store_ttl_seconds
        )
        self._client: httpx.AsyncClient | None = None

    def open(self) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=KV_FETCH_TIMEOUT, limits=KV_FETCH_LIMITS, headers=self._peer_headers, auth=self._peer_auth
            )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def __len__(self) -> int:
        """Context states left for decode engines and not fetched yet."""
        return len(self._store)

    def clear(self) -> int:
        """Drop every unfetched state (the KV pool is gone); returns how many."""
        return self._store.clear()

    # ---- the prefill engine's side ---------------------------------------------------------

    def leave(
        self, leg: LegRequest, state: PrefixState, first: TokenChoice, version: str, *, cached_tokens: int
    ) -> ContextHandoff:
        digest = state.digest()
        self._store.put(
            ContextState(
                ctx_request_id=context_request_id(leg),
                prompt_token_ids=list(leg.prompt_token_ids),
                first_gen_token=first.token_id,
                first_gen_logprob=first.logprob,
                first_gen_top_logprobs=list(first.top_logprobs),
                chain_hex=state.chain.hex(),
                tail=list(state.tail),
                digest=digest,
                weights_version=version,
                cached_tokens=cached_tokens,
            )
        )
        opaque = {
            "kind": OPAQUE_STATE_KIND,
            "digest": digest,
            "prompt_len": len(leg.prompt_token_ids),
            "weights_version": version,
        }
        return left_context(leg, first, opaque=encode_opaque(opaque), endpoint=self.endpoint)

    def export(self, ctx_request_id: int) -> dict[str, Any]:
        """Hand over (and forget) a context state."""
        state = self._store.take(ctx_request_id)
        if state is None:
            raise missing_here(ctx_request_id)
        return state.to_wire()

    # ---- the decode engine's side ----------------------------------------------------------

    async def receive(self, leg: LegRequest) -> ReceivedContext:
        """Fetch the context state from the prefill engine and check it is this request's."""
        source = context_source(leg)
        ctx_id = source.ctx_request_id
        body = await self._fetch(source)
        try:
            ctx = ContextState.from_wire(body)
        except (KeyError, ValueError, TypeError) as exc:
            raise KvTransferError(f"malformed context state for ctx_request_id {ctx_id}: {exc}") from exc
        state = PrefixState(chain=bytes.fromhex(ctx.chain_hex), tail=list(ctx.tail), length=len(ctx.prompt_token_ids))
        if state.digest() != ctx.digest:
            raise ContextMismatchError(f"context state for ctx_request_id {ctx_id} is corrupt (digest mismatch)")
        check_received(leg, ctx_id, ctx.prompt_token_ids, ctx.first_gen_token)
        dp = leg.request.disaggregated_params
        expected = decode_opaque(dp.encoded_opaque_state if dp is not None else None, OPAQUE_STATE_KIND).get("digest")
        if isinstance(expected, str) and expected != ctx.digest:
            raise ContextMismatchError(
                f"context state for ctx_request_id {ctx_id} does not match encoded_opaque_state",
                param="disaggregated_params.encoded_opaque_state",
            )
        first = TokenChoice(
            token_id=ctx.first_gen_token,
            logprob=ctx.first_gen_logprob,
            top_logprobs=tuple(ctx.first_gen_top_logprobs[: leg.top_logprobs]) if leg.top_logprobs else (),
        )
        cached = dp.ctx_usage.cached_tokens() if dp is not None and dp.ctx_usage is not None else ctx.cached_tokens
        return ReceivedContext(state, first, cached, ctx.weights_version)

    async def _fetch(self, source: ContextSource) -> dict[str, Any]:
        if self._client is None:
            raise KvTransferError("the sim backend is not started")
        url = source.endpoint + kv_export_path(source.ctx_request_id)
        try:
            try:
                response = await self._client.get(url)
            except KV_FETCH_RETRYABLE:
                response = await self._client.get(url)
        except httpx.HTTPError as exc:
            raise KvTransferError(
                f"cannot fetch context state for ctx_request_id {source.ctx_request_id} from {source.endpoint}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        raise_for_fetch_status(source, response.status_code, response.text if response.status_code != 200 else "")
        body = response.json()
        if not isinstance(body, dict):
            raise KvTransferError(f"context state for ctx_request_id {source.ctx_request_id} is not a JSON object")
        return body
