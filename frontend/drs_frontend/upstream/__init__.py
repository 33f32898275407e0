"""The HTTP client to the engines, behind one small interface (:class:`UpstreamClient`).

Three implementations, chosen between by ``bench/relay.py`` (frontend CPU per two-leg turn):
``aiohttp`` (the default), ``raw`` (asyncio protocols + httptools for the JSON POSTs, aiohttp for
streams and probes: within measurement noise of aiohttp on the shared 2-core machine, so the
widely used client stays the default), and ``httpx`` (six to ten times the CPU of the others).
"""

from drs_frontend.upstream.base import UpstreamClient, UpstreamResponse, UpstreamStream, build_upstream

__all__ = ["UpstreamClient", "UpstreamResponse", "UpstreamStream", "build_upstream"]
