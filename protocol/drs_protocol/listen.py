"""Bind the listening socket before anything else, the rule every server of the project follows.

A server that cannot bind its port must exit at once naming it, never load a model or a tokenizer
first, and never look alive while another process answers its health checks (the reference
system hit exactly that). The engine and the frontend bind with :func:`bind_socket`, then hand
the socket to uvicorn.
"""

from __future__ import annotations

import socket


class BindError(OSError):
    """The port cannot be bound; the message names what wanted it, the host and the port."""


def bind_socket(host: str, port: int, *, what: str, backlog: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0: any free port), or :class:`BindError`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise BindError(exc.errno, f"cannot bind the {what} port {host}:{port}: {exc.strerror or exc}") from exc
    sock.set_inheritable(True)
    return sock
