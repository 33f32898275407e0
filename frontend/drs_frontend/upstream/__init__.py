"""The HTTP client to the engines, behind one small interface (:class:`UpstreamClient`).

Two implementations: aiohttp (the default, chosen by ``bench/relay.py``) and httpx.
"""

from drs_frontend.upstream.base import UpstreamClient, UpstreamResponse, UpstreamStream, build_upstream

__all__ = ["UpstreamClient", "UpstreamResponse", "UpstreamStream", "build_upstream"]
