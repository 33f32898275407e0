"""The trainer's library is importable without kopf (and without the operator's Kubernetes layer)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["drs_client", "drs_client.cli", "drs_client.gym"])
def test_importing_the_trainer_library_imports_no_kopf(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        "bad = sorted(m for m in sys.modules if m == 'kopf' or m.startswith(('kopf.', 'drs_operator.kube', "
        "'drs_operator.handlers', 'drs_operator.reconcile', 'drs_sidecar', 'drs_frontend', 'drs_engine')))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_the_check_fails_when_kopf_is_imported() -> None:
    code = "import sys, drs_client, kopf\nassert 'kopf' not in sys.modules\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
