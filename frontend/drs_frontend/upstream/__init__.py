"""The HTTP client to the engines, behind one small interface (:class:`UpstreamClient`).

Three implementations, chosen between by ``bench/relay.py`` (frontend CPU per two-leg turn):
``raw`` (the default: asyncio protocols + httptools for the JSON POSTs, aiohttp for streams and
probes; ~0.48 ms of frontend CPU per turn against ~0.75 ms with ``aiohttp``, in interleaved rounds
once it reused its connections), ``aiohttp``, and ``httpx`` (six to ten times the CPU of the others).
"""

from drs_frontend.upstream.base import UpstreamClient, UpstreamResponse, UpstreamStream
from drs_frontend.upstream.factory import build_upstream

__all__ = ["UpstreamClient", "UpstreamResponse", "UpstreamStream", "build_upstream"]
