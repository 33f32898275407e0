"""The sidecar's metrics: the engine-call counter's children bound once per (op, result)
(``SidecarMetrics.count_engine_call``) count as ``labels()`` per call did."""

from __future__ import annotations

from drs_protocol.routes import ControlOp
from drs_sidecar.metrics import SidecarMetrics


def sample(text: str, labels: str) -> float:
    prefix = f"drs_sidecar_engine_calls_total{labels} "
    return float(next(line for line in text.splitlines() if line.startswith(prefix))[len(prefix) :])


def test_engine_calls_count_per_op_and_result() -> None:
    metrics = SidecarMetrics()
    for op, ok in [
        (ControlOp.LOAD_WEIGHTS, True),
        (ControlOp.LOAD_WEIGHTS, True),
        (ControlOp.LOAD_WEIGHTS, False),
        (ControlOp.ANNOUNCE_WEIGHTS_TARGET, True),
    ]:
        metrics.count_engine_call(op.value, ok)
    text = metrics.render().decode()
    assert sample(text, '{op="load_weights",result="ok"}') == 2
    assert sample(text, '{op="load_weights",result="failed"}') == 1
    assert sample(text, '{op="announce_weights_target",result="ok"}') == 1
    assert 'op="announce_weights_target",result="failed"' not in text
