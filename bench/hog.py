"""A controlled CPU load for benchmarks that compare two modes under load (not a test).

:func:`hogging` starts ``processes`` processes that each spin for ``duty`` of every ``period_s``
and sleep the rest, for as long as the ``with`` block runs: a steady, known share of the machine's
cores taken from the fleet under test, unlike the machine's own load, which comes and goes. The
benchmark reports the duty in its configuration, beside the load average it saw.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from collections.abc import Iterator

#: each hog's cycle: spin ``duty`` of it, sleep the rest
PERIOD_S = 0.01


def _spin(duty: float, period_s: float) -> None:
    busy = duty * period_s
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < busy:
            pass
        time.sleep(max(0.0, period_s - (time.perf_counter() - start)))


@contextlib.contextmanager
def hogging(duty: float, processes: int = 1, period_s: float = PERIOD_S) -> Iterator[None]:
    """``processes`` spinning processes at ``duty`` (0 < duty <= 1) for the block; 0: none."""
    if not 0.0 <= duty <= 1.0:
        raise ValueError(f"duty: {duty} is not within 0..1")
    if duty == 0.0 or processes == 0:
        yield
        return
    context = multiprocessing.get_context("spawn")
    hogs = [context.Process(target=_spin, args=(duty, period_s), daemon=True) for _ in range(processes)]
    for hog in hogs:
        hog.start()
    try:
        yield
    finally:
        for hog in hogs:
            hog.terminate()
        for hog in hogs:
            hog.join(5)


def loadavg() -> list[float]:
    """The 1, 5 and 15-minute load averages, rounded (for a benchmark's JSON line)."""
    return [round(x, 2) for x in os.getloadavg()]
