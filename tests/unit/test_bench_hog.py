"""``bench/hog.py``: the controlled load a benchmark runs beside its fleet starts, spins and stops."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from bench.hog import hogging


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_a_hog_spins_for_the_block_and_is_gone_after_it() -> None:
    before = set(multiprocessing.active_children())  # other tests' children, if any
    with hogging(1.0, processes=1):
        hogs = [p for p in multiprocessing.active_children() if p not in before]
        assert len(hogs) == 1 and hogs[0].pid is not None
        pid = hogs[0].pid
        deadline = time.monotonic() + 20
        while _cpu_seconds(pid) < 0.3 and time.monotonic() < deadline:  # it spins: CPU time accrues
            time.sleep(0.05)
        assert _cpu_seconds(pid) >= 0.3
    assert hogs[0] not in multiprocessing.active_children() and not hogs[0].is_alive()


def test_no_duty_starts_nothing_and_a_duty_outside_0_to_1_is_refused_by_name() -> None:
    before = set(multiprocessing.active_children())
    with hogging(0.0, processes=4):
        assert set(multiprocessing.active_children()) == before
    with pytest.raises(ValueError, match="duty"), hogging(1.5):
        pass


@pytest.mark.parametrize(
    ("argv", "named"),
    [(["--hog-duty", "2"], "--hog-duty: 2 is not within 0..1"), (["--hog-procs", "-1"], "--hog-procs: -1 is below 0")],
)
def test_the_benchmark_refuses_a_hog_it_cannot_run_naming_the_flag(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.grpo import parse_args

    with pytest.raises(SystemExit) as stopped:
        parse_args(argv)
    assert stopped.value.code == 2
    assert named in capsys.readouterr().err
