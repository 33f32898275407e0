"""Two sessions building the control plane at once: one builds, the other waits and builds nothing.

Worktrees of this repository share ``~/.cache/drs``; without the lock their builds shared
``build-tmp`` and removed each other's half-built outputs (a helm build failed with "expected
binary helm not produced"). The Go build is replaced by a recorder; the lock is the real one.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from drs_devcluster import build


def test_concurrent_ensure_built_builds_each_target_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "go_version", lambda: "go1.26.8")
    monkeypatch.setattr(build, "_copy_kwok_stages", lambda bins: None)
    monkeypatch.setattr(build, "is_built", lambda bins: all((bins / b).is_file() for b in build.ALL_BINARIES))
    state = {"active": 0, "max_active": 0}
    built: list[str] = []
    guard = threading.Lock()

    def fake_build(target: build.GoTarget, bins: Path, go: str) -> None:
        with guard:
            state["active"] += 1
            state["max_active"] = max(state["max_active"], state["active"])
            built.append(target.name)
        time.sleep(0.05)  # a build takes time: the other thread must be inside ensure_built meanwhile
        for out in target.outputs:
            (bins / out).write_text("built")
        with guard:
            state["active"] -= 1

    monkeypatch.setattr(build, "_build_target", fake_build)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(build.ensure_built())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 2 and results[0] == results[1]
    assert state["max_active"] == 1
    assert sorted(built) == sorted(t.name for t in build._targets())
