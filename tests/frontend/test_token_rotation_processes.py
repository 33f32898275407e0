"""Token rotation across real ``drs engine`` and ``drs frontend`` processes, as the operator's pods
run them: each reads its tokens from a directory named by ``DRS_SERVING_TOKEN_DIR`` /
``DRS_CONTROL_TOKEN_DIR`` (a mounted Secret), never from the environment's token variables.

While four clients send turns through the frontend without pause, the test writes the operator's
phases into each process's own directory (the presenter first in phases 1 and 2) and waits for
each process's own log line saying its token changed (the line names no token); after the last
step (``previous`` dropped), 50 more turns. Every turn answers 200; the engines then refuse the old serving and control
tokens and take the new ones; no token appears in any process's output.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
from drs_devcluster.runner_volumes import write_files
from drs_protocol import auth, env

from .test_frontend_cli import DRS, free_port

OLD, NEW = "1" * 64, "2" * 64
CONTROL_OLD, CONTROL_NEW = "3" * 64, "4" * 64
BODY = {"model": "sim", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
CHANGED = "serving token changed"


def write(directory: Path, **keys: str) -> None:
    write_files(directory, {k: v.encode() for k, v in keys.items()})


@contextlib.contextmanager
def process(argv: list[str], log: Path, variables: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    base = {k: v for k, v in os.environ.items() if k not in (env.SERVING_TOKEN, env.CONTROL_TOKEN)}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env={**base, **variables}, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def ready(client: httpx.AsyncClient, url: str) -> None:
    """Until the frontend answers ``/ready`` 200: both engines up (a loaded machine: tens of seconds)."""
    async with asyncio.timeout(120):
        while True:
            with contextlib.suppress(httpx.TransportError):
                if (await client.get(url + "/ready")).status_code == 200:
                    return
            await asyncio.sleep(0.1)


async def changed(log: Path, times: int) -> None:
    """Until the process has logged ``times`` changes of its serving token (its own re-read)."""
    async with asyncio.timeout(15):
        while log.read_text(errors="replace").count(CHANGED) < times:
            await asyncio.sleep(0.05)


async def test_a_rotation_across_engine_and_frontend_processes_loses_no_turn(tmp_path: Path) -> None:
    names = ("prefill", "decode", "frontend")
    serving = {n: tmp_path / f"{n}-serving" for n in names}
    control = {n: tmp_path / f"{n}-control" for n in names[:2]}
    logs = {n: tmp_path / f"{n}.log" for n in names}
    for directory in serving.values():
        write(directory, token=OLD)
    for directory in control.values():
        write(directory, token=CONTROL_OLD)
    ports = {n: free_port() for n in names}
    urls = {n: f"http://127.0.0.1:{ports[n]}" for n in names}

    def engine(role: str) -> list[str]:
        return [
            DRS,
            "engine",
            "--backend",
            "sim",
            "--role",
            role,
            "--host",
            "127.0.0.1",
            "--port",
            str(ports[role]),
            "--sim-speed",
            "0",
        ]

    def dirs(name: str) -> dict[str, str]:
        found = {env.SERVING_TOKEN_DIR: str(serving[name])}
        if name in control:
            found[env.CONTROL_TOKEN_DIR] = str(control[name])
        return found

    frontend = [
        DRS,
        "frontend",
        "--prefill",
        urls["prefill"],
        "--decode",
        urls["decode"],
        "--host",
        "127.0.0.1",
        "--port",
        str(ports["frontend"]),
    ]
    with (
        process(engine("prefill"), logs["prefill"], dirs("prefill")),
        process(engine("decode"), logs["decode"], dirs("decode")),
        process(frontend, logs["frontend"], dirs("frontend")),
    ):
        async with httpx.AsyncClient(timeout=30) as client:
            await ready(client, urls["frontend"])
            ok, failed, stop = [0], [], asyncio.Event()

            async def turns() -> None:
                while not stop.is_set():
                    resp = await client.post(urls["frontend"] + "/v1/chat/completions", json=BODY)
                    if resp.status_code == 200:
                        ok[0] += 1
                    else:
                        failed.append(f"{resp.status_code} {resp.text[:200]}")

            clients = [asyncio.create_task(turns()) for _ in range(4)]
            for keys, control_keys in (
                ({"token": OLD, "next": NEW}, {"token": CONTROL_OLD, "next": CONTROL_NEW}),
                ({"token": NEW, "previous": OLD}, {"token": CONTROL_NEW, "previous": CONTROL_OLD}),
            ):
                for name in ("frontend", "decode", "prefill"):  # the presenter first
                    seen = logs[name].read_text(errors="replace").count(CHANGED)
                    write(serving[name], **keys)
                    if name in control:
                        write(control[name], **control_keys)
                    await changed(logs[name], seen + 1)
            # the end: `previous` dropped; nothing observable changes within the held grace (60 s)
            for name in ("prefill", "decode", "frontend"):
                write(serving[name], token=NEW)
                if name in control:
                    write(control[name], token=CONTROL_NEW)
            async with asyncio.timeout(60):
                target = ok[0] + 50
                while ok[0] < target and not failed:
                    await asyncio.sleep(0.05)
            turns_during = ok[0]
            stop.set()
            await asyncio.gather(*clients)

            async def status(url: str, token: str) -> int:
                return (await client.get(url, headers=auth.bearer(token))).status_code

            new_ok = await status(urls["prefill"] + "/v1/models", NEW)
            control_ok = await status(urls["decode"] + "/control/weights", CONTROL_NEW)
            # the held grace keeps OLD accepted for 60 s after `token` changed; the control source
            # also holds CONTROL_OLD: only tokens never held are refused at once
            stranger = await status(urls["prefill"] + "/v1/models", "5" * 64)
    print(f"rotation across processes: {turns_during} turns, {len(failed)} failed")
    assert failed == [], failed[:3]
    assert turns_during > 0
    assert (new_ok, control_ok, stranger) == (200, 200, 401)
    output = "".join(log.read_text(errors="replace") for log in logs.values())
    assert not [t for t in (OLD, NEW, CONTROL_OLD, CONTROL_NEW) if t in output]
