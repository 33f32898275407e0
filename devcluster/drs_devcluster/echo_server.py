"""``drs dev echo-server``: the smallest real server, for tests of the local pod runner.

A test double, named as one: it is not part of any data path. It answers

* ``GET /health`` with the current health status (``--health-status``, default 200);
* ``POST /health?status=CODE`` by changing that status (so a test can flip readiness);
* ``GET /info`` with JSON: pid, argv, working directory, host, port;
* ``GET /env/NAME`` with the value of environment variable NAME (404 when unset).

It exits non-zero at once, naming the address, when it cannot bind; with ``--exit-after S`` it
exits on its own after S seconds with ``--exit-code`` (a crashing container).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import urllib.parse
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from drs_protocol.routes import HEALTH


class _State:
    def __init__(self, health_status: int) -> None:
        self.health_status = health_status
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        if url.path == HEALTH:
            with self.server.state.lock:
                code = self.server.state.health_status
            self._reply(code, {"status": code})
        elif url.path == "/info":
            host, port = self.server.server_address[:2]
            self._reply(200, {"pid": os.getpid(), "argv": sys.argv, "cwd": os.getcwd(), "host": host, "port": port})
        elif url.path.startswith("/env/"):
            name = urllib.parse.unquote(url.path.removeprefix("/env/"))
            if name in os.environ:
                self._reply(200, {"name": name, "value": os.environ[name]})
            else:
                self._reply(404, {"error": f"{name} is not set"})
        else:
            self._reply(404, {"error": "not found"})

    def do_POST(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        if url.path != HEALTH or not query.get("status", [""])[0].isdigit():
            self._reply(400, {"error": "POST /health?status=CODE"})
            return
        with self.server.state.lock:
            self.server.state.health_status = int(query["status"][0])
        self._reply(200, {"status": self.server.state.health_status})

    def _reply(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code, HTTPStatus(code).phrase if code in HTTPStatus._value2member_map_ else "")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        sys.stderr.write(f"echo-server {self.address_string()} {format % args}\n")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], state: _State) -> None:
        super().__init__(address, _Handler)
        self.state = state


def serve(host: str, port: int, health_status: int = 200, exit_after_s: float | None = None, exit_code: int = 3) -> int:
    """Serve until killed (or until ``exit_after_s``); return the exit code."""
    try:
        server = _Server((host, port), _State(health_status))
    except OSError as exc:
        print(f"echo-server: cannot bind {host}:{port}: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"echo-server: listening on {host}:{port} (pid {os.getpid()})", file=sys.stderr, flush=True)
    if exit_after_s is not None:
        timer = threading.Timer(exit_after_s, server.shutdown)
        timer.daemon = True
        timer.start()
    server.serve_forever(poll_interval=0.2)
    server.server_close()
    if exit_after_s is not None:
        print(f"echo-server: exiting with {exit_code} after {exit_after_s}s", file=sys.stderr, flush=True)
        return exit_code
    return 0
