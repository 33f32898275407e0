"""The HTTP client to the engines, behind one small interface (:class:`UpstreamClient`).

Three implementations, chosen between by ``bench/relay.py`` (frontend CPU per two-leg turn):
``raw`` (the default: asyncio protocols + httptools for the JSON POSTs, aiohttp for streams and
probes), ``aiohttp``, and ``httpx`` (about ten times the CPU of the other two).
"""

from drs_frontend.upstream.base import UpstreamClient, UpstreamResponse, UpstreamStream, build_upstream

__all__ = ["UpstreamClient", "UpstreamResponse", "UpstreamStream", "build_upstream"]
