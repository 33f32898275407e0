"""The ``torch`` backend's join of a trainer's refit group answers within the step's ``timeout_s``,
naming what was slow: the trainer's store slow to accept a connection, or a group that did not form
(a rank that did not join: hung). torch's TCPStore connect outruns the timeout it is given by its
retry delay (3.7 s for 2.4 s on this machine), which the sidecar, waiting a little longer than
``timeout_s``, would name ``hung``. Real ``torch.distributed`` over gloo on the CPU: a port nobody
listens on, and a trainer's real store whose trainer rank never joins."""

from __future__ import annotations

import asyncio
import socket
import time
from datetime import timedelta

import pytest
from drs_engine.errors import CollectiveError
from drs_protocol.control import CollectiveInit

TIMEOUT_S = 2.4
#: the event loop's own lateness on this shared 2-core machine, beyond the step's timeout
SLACK_S = 0.3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


async def join(port: int) -> tuple[float, str]:
    """A ``torch`` engine's weights manager (CPU) joining as rank 1 of 2; (seconds, the error)."""
    import torch
    from drs_engine.backends.torch.model import resolve_model
    from drs_engine.backends.torch.weights.manager import WeightsManager
    from drs_engine.backends.torch.worker import GpuWorker

    cpu = torch.device("cpu")
    worker = GpuWorker(cpu)
    manager = WeightsManager(resolve_model("random:tiny"), version="v0", device=cpu, dtype=torch.float32, worker=worker)
    params = CollectiveInit(
        ip="127.0.0.1", port=port, train_world_size=1, rank_prefix=0, world_size=2, timeout_s=TIMEOUT_S
    )
    started = time.monotonic()
    try:
        with pytest.raises(CollectiveError) as raised:
            await manager.init_collective(params)
        return time.monotonic() - started, str(raised.value)
    finally:
        worker.close()


def test_a_store_slow_to_accept_is_named_within_the_timeout() -> None:
    port = free_port()  # nobody listens: torch's connect retries past its timeout
    took, why = asyncio.run(join(port))
    assert took <= TIMEOUT_S + SLACK_S, f"answered after {took:.2f}s for timeout_s {TIMEOUT_S}: {why}"
    assert f"store at 127.0.0.1:{port} did not accept a connection within {TIMEOUT_S:g}s" in why, why
    assert "slow to connect" in why and why.startswith("rank 1:"), why


def test_a_group_whose_trainer_never_joins_is_named_hung_within_the_timeout() -> None:
    import torch.distributed as dist
    from drs_protocol.weights_pack import STORE_KEY_BACKEND, STORE_KEY_TARGET_BYTES

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    store.set(STORE_KEY_BACKEND, "gloo")
    store.set(STORE_KEY_TARGET_BYTES, str(1 << 20))
    took, why = asyncio.run(join(port))  # the trainer (rank 0) hosts the store and never joins
    assert took <= TIMEOUT_S + SLACK_S, f"answered after {took:.2f}s for timeout_s {TIMEOUT_S}: {why}"
    assert "group of 2 ranks did not form within" in why and why.startswith("rank 1:"), why
    del store


def test_a_store_whose_trainer_publishes_no_group_is_named_within_the_timeout() -> None:
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    took, why = asyncio.run(join(port))  # the trainer's store answers; its backend is never set
    assert took <= TIMEOUT_S + SLACK_S, f"answered after {took:.2f}s for timeout_s {TIMEOUT_S}: {why}"
    assert f"connected to the trainer's store at 127.0.0.1:{port}" in why and "hung" in why, why
    assert "cannot reach" not in why, why  # it was reached
    del store
