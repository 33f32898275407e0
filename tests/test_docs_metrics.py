"""docs/operating.md's metric tables are the processes' registries: every metric a process
registers has its row (name, type, help text as the code says it), and every row names one."""

from __future__ import annotations

import re
from pathlib import Path

from drs_engine.metrics import EngineMetrics
from drs_frontend.metrics import FrontendMetrics
from drs_operator.metrics import OperatorMetrics
from drs_sidecar.metrics import SidecarMetrics
from prometheus_client import CollectorRegistry

DOC = Path(__file__).resolve().parents[1] / "docs" / "operating.md"
ROW = re.compile(r"^\| `(drs_[a-z_]+)` \| (\w+) \| (.*) \|$", re.MULTILINE)


def _rows(registry: CollectorRegistry) -> set[tuple[str, str, str]]:
    return {(m.name + ("_total" if m.type == "counter" else ""), m.type, m.documentation) for m in registry.collect()}


def _registered() -> set[tuple[str, str, str]]:
    frontend = FrontendMetrics()
    frontend.watch_in_flight(lambda: [])  # registered by the app at start-up
    registries = [
        OperatorMetrics.create().registry,
        frontend.registry,
        EngineMetrics(backend="sim", role="prefill", test_double=True).registry,
        SidecarMetrics().registry,
    ]
    return set().union(*(_rows(r) for r in registries))


def test_every_registered_metric_has_its_row_and_every_row_is_registered() -> None:
    documented = {(name, kind, text) for name, kind, text in ROW.findall(DOC.read_text())}
    registered = _registered()
    assert not registered - documented, f"metrics without their row in {DOC.name}: {sorted(registered - documented)}"
    assert not documented - registered, f"rows in {DOC.name} no process registers: {sorted(documented - registered)}"
