"""``drs operator``'s flags reach the operator's options: the write limits from a flag or their
``DRS_OPERATOR_*`` variable (the flag wins), the throttle's defaults otherwise."""

from __future__ import annotations

from typing import Any

import kopf
import pytest
from click.testing import CliRunner
from drs_operator.kube.throttle import Limits
from drs_operator.manifests.policies import OperatorPods
from drs_operator.run import Options, operator

OFF = ["--metrics-port", "0", "--health-port", "0"]


def _options(monkeypatch: pytest.MonkeyPatch, args: list[str], env: dict[str, str]) -> Options:
    ran: dict[str, Any] = {}
    monkeypatch.setattr(kopf, "run", lambda **kwargs: ran.update(kwargs))
    result = CliRunner().invoke(operator, [*OFF, *args], env=env)
    assert result.exit_code == 0, result.output
    options: Options = ran["memo"].options
    return options


def test_write_limits_default_to_the_throttles(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _options(monkeypatch, [], {}).limits == Limits()


def test_write_limits_from_flags_and_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"DRS_OPERATOR_BURST": "9", "DRS_OPERATOR_QPS": "3"}
    options = _options(monkeypatch, ["--qps", "7", "--max-in-flight", "2", "--workers", "5"], env)
    assert options.limits == Limits(max_in_flight=2, qps=7.0, burst=9)
    assert options.workers == 5


def test_a_limit_out_of_range_names_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    result = CliRunner().invoke(operator, [*OFF, "--burst", "0"])
    assert result.exit_code == 2 and "--burst" in result.output


def test_the_operators_pods_from_the_charts_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"DRS_OPERATOR_POD_LABELS": "app.kubernetes.io/name=drs-operator", "POD_NAMESPACE": "ops"}
    options = _options(monkeypatch, [], env)
    assert options.operator == OperatorPods("ops", {"app.kubernetes.io/name": "drs-operator"})


def test_outside_a_pod_it_admits_no_pods_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DRS_OPERATOR_POD_LABELS", raising=False)
    assert _options(monkeypatch, [], {}).operator is None


@pytest.mark.parametrize(
    ("labels", "namespace", "words"),
    [
        ("app", "ops", "a label is key=value"),
        ("app=drs", "", "needs $POD_NAMESPACE"),
    ],
)
def test_bad_pod_labels_name_the_flag_and_its_variable(labels: str, namespace: str, words: str) -> None:
    result = CliRunner().invoke(operator, OFF, env={"DRS_OPERATOR_POD_LABELS": labels, "POD_NAMESPACE": namespace})
    assert result.exit_code == 2
    assert "--pod-labels" in result.output and "$DRS_OPERATOR_POD_LABELS" in result.output and words in result.output
