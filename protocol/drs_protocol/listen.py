"""Bind the listening socket before anything else, the rule every server of the project follows.

A server that cannot bind its port must exit at once naming it, never load a model or a tokenizer
first, and never look alive while another process answers its health checks (the reference
system hit exactly that). The engine and the frontend bind with :func:`bind_socket`, then hand
the socket to uvicorn.

The socket is made with ``IPPROTO_TCP`` and ``TCP_NODELAY`` (accepted connections inherit it on
Linux): asyncio's own event loop turns Nagle's algorithm off only on a connection whose socket says
``proto == IPPROTO_TCP``, and ``socket.socket(family, SOCK_STREAM)`` says 0. Without it a server on
that loop (the engines and frontends of ``bench/`` and the tests, a gang's rank workers) that writes
an answer in two writes (uvicorn: the head, then the body) holds the second until the client's
delayed ACK, about 40 ms on Linux loopback, for every answer (measured: ``bench/lookup_cost.py``,
docs/grpo-routing.md). uvloop, which serves the engines and frontends in their pods, sets it anyway.
"""

from __future__ import annotations

import socket


class BindError(OSError):
    """The port cannot be bound; the message names what wanted it, the host and the port."""


def bind_socket(host: str, port: int, *, what: str, backlog: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0: any free port), or :class:`BindError`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise BindError(exc.errno, f"cannot bind the {what} port {host}:{port}: {exc.strerror or exc}") from exc
    sock.set_inheritable(True)
    return sock
