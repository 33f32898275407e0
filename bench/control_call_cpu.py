"""CPU per control call of one engine app, over raw ASGI in this process (no sockets; one JSON line).

The app is ``drs_engine.server.app.create_app``'s, with a ``sim`` backend started; each call is an
in-memory HTTP scope with the control token, answered 200 (anything else stops the bench). Per
route: 200 calls to warm up, then ``--batches`` batches of ``--calls``, CPU by
``time.process_time``; the best batch's microseconds per call. What it isolates is the app's own
work per call (its middleware, routing and the control route), which ``bench/refit_scale.py`` pays
256 times per round with all engines in one process, beside the sockets and the event loop. To
compare two checkouts, run each one's code with ``PYTHONPATH`` (its ``engine_image`` and
``protocol`` folders) in alternation.

    python bench/control_call_cpu.py [--calls 2000] [--batches 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from drs_engine.config import build_config
from drs_engine.server.app import create_app
from drs_protocol.routes import CONTROL_ROUTES, CONTROL_WEIGHTS, ControlOp
from starlette.types import ASGIApp, Message

TOKEN = "control-call-cpu-token"
#: Calls before the measured batches.
WARM_UP = 200


def calls(checkpoint: Path) -> dict[str, tuple[str, str, bytes]]:
    """name -> (method, path, body) of each route measured: the announce and the load a refit
    sends each engine (the load of a 64-byte checkpoint with a cut-over already past, so it
    swaps at once: the sim backend's read, digest and swap are in its figure), and the GET."""
    load = {"path": str(checkpoint), "version": "v2", "effective_at": time.time()}
    return {
        "announce": (
            "POST",
            CONTROL_ROUTES[ControlOp.ANNOUNCE_WEIGHTS_TARGET],
            json.dumps({"version": "v2", "lease_s": 60}).encode(),
        ),
        "load": ("POST", CONTROL_ROUTES[ControlOp.LOAD_WEIGHTS], json.dumps(load).encode()),
        "get_weights": ("GET", CONTROL_WEIGHTS, b""),
    }


def http_scope(method: str, path: str, body: bytes) -> dict[str, Any]:
    headers = [
        (b"host", b"engine"),
        (b"authorization", b"Bearer " + TOKEN.encode()),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }


async def call(app: ASGIApp, method: str, path: str, body: bytes) -> None:
    """One request through ``app``; SystemExit unless it answers 200."""
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(http_scope(method, path, body), receive, send)
    if sent[0].get("status") != 200:
        raise SystemExit(f"{method} {path}: {sent}")


async def measure(count: int, batches: int) -> dict[str, Any]:
    sim = {"speed": 0, "weightsLoadSeconds": 0}
    config = build_config({"backend": "sim", "role": "prefill", "host": "127.0.0.1", "port": 0, "sim": sim})
    app = create_app(config, control_token=TOKEN)
    state = app.state.engine
    await state.start()
    out: dict[str, Any] = {"bench": "control_call_cpu", "calls": count, "batches": batches}
    tmp = tempfile.TemporaryDirectory()
    checkpoint = Path(tmp.name) / "model.safetensors"
    checkpoint.write_bytes(os.urandom(64))
    try:
        for name, (method, path, body) in calls(checkpoint).items():
            for _ in range(WARM_UP):
                await call(app, method, path, body)
            per_call = []
            for _ in range(batches):
                started = time.process_time()
                for _ in range(count):
                    await call(app, method, path, body)
                per_call.append((time.process_time() - started) / count * 1e6)
            out[f"{name}_us"] = round(min(per_call), 1)
    finally:
        await state.close()
        tmp.cleanup()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--batches", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.calls, args.batches))), flush=True)


if __name__ == "__main__":
    main()
