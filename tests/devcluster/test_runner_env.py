"""The pod runner's env and argv resolution: what a kubelet would give the container, pure."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from drs_devcluster.runner_env import (
    NODE_IP_ENV,
    EnvResolutionError,
    expand,
    field_value,
    is_drs_command,
    local_argv,
    mapping_for,
    referenced_objects,
    resolve,
)
from hypothesis import given
from hypothesis import strategies as st

# ---------------------------------------------------------------------------- $(VAR) expansion

# The kubelet's own cases (k8s.io/kubernetes third_party/forked/golang/expansion/expand_test.go,
# v1.36.3), run against both context layouts it tests: one map, and two maps searched in order.
ONE_CONTEXT = {"VAR_A": "A", "VAR_B": "B", "VAR_C": "C", "VAR_REF": "$(VAR_A)", "VAR_EMPTY": ""}
TWO_CONTEXTS = ({"VAR_A": "A", "VAR_EMPTY": ""}, {"VAR_B": "B", "VAR_C": "C", "VAR_REF": "$(VAR_A)"})
KUBELET_CASES = [
    ("whole string", "$(VAR_A)", "A"),
    ("repeat", "$(VAR_A)-$(VAR_A)", "A-A"),
    ("beginning", "$(VAR_A)-1", "A-1"),
    ("middle", "___$(VAR_B)___", "___B___"),
    ("end", "___$(VAR_C)", "___C"),
    ("compound", "$(VAR_A)_$(VAR_B)_$(VAR_C)", "A_B_C"),
    ("escape and expand", "$$(VAR_B)_$(VAR_A)", "$(VAR_B)_A"),
    ("compound escape", "$$(VAR_A)_$$(VAR_B)", "$(VAR_A)_$(VAR_B)"),
    ("mixed in escapes", "f000-$$VAR_A", "f000-$VAR_A"),
    ("backslash escape ignored", "foo\\$(VAR_C)bar", "foo\\Cbar"),
    ("double backslash ignored", "foo\\\\$(VAR_C)bar", "foo\\\\Cbar"),
    ("lots of backslashes", "foo\\\\\\\\$(VAR_A)bar", "foo\\\\\\\\Abar"),
    ("nested var references", "$(VAR_A$(VAR_B))", "$(VAR_A$(VAR_B))"),
    ("nested var references second type", "$(VAR_A$(VAR_B)", "$(VAR_A$(VAR_B)"),
    ("value is a reference and is not expanded again", "$(VAR_REF)", "$(VAR_A)"),
    ("value is a reference twice", "%%$(VAR_REF)--$(VAR_REF)%%", "%%$(VAR_A)--$(VAR_A)%%"),
    ("empty var", "foo$(VAR_EMPTY)bar", "foobar"),
    ("unterminated expression", "foo$(VAR_Awhoops!", "foo$(VAR_Awhoops!"),
    ("expression without operator", "f00__(VAR_A)__", "f00__(VAR_A)__"),
    ("shell special vars pass through", "$?_boo_$!", "$?_boo_$!"),
    ("bare operators are ignored", "$VAR_A", "$VAR_A"),
    ("undefined vars are passed through", "$(VAR_DNE)", "$(VAR_DNE)"),
    ("even operators, var undefined", "$$$$$$(BIG_MONEY)", "$$$(BIG_MONEY)"),
    ("even operators, var defined", "$$$$$$(VAR_A)", "$$$(VAR_A)"),
    ("odd operators, var undefined", "$$$$$$$(GOOD_ODDS)", "$$$$(GOOD_ODDS)"),
    ("odd operators, var defined", "$$$$$$$(VAR_A)", "$$$A"),
    ("missing open expression", "$VAR_A)", "$VAR_A)"),
    ("shell syntax ignored", "${VAR_A}", "${VAR_A}"),
    ("trailing incomplete expression not consumed", "$(VAR_B)_______$(A", "B_______$(A"),
    ("trailing incomplete empty expression not consumed", "$(VAR_C)_______$(", "C_______$("),
    ("operator at end of input is preserved", "$(VAR_A)foobarzab$", "Afoobarzab$"),
    ("shell escaped incomplete expression", "foo-\\$(VAR_A", "foo-\\$(VAR_A"),
    ("lots of $( in middle", "--$($($($($--", "--$($($($($--"),
    ("lots of $( in beginning", "$($($($($--foo$(", "$($($($($--foo$("),
    ("lots of $( at end", "foo0--$($($($(", "foo0--$($($($("),
    ("escaped operators in names are not escaped", "$(foo$$var)", "$(foo$$var)"),
    ("newline not expanded", "\n", "\n"),
    ("dollar before a non-ASCII character", "$£FOO", "$£FOO"),
    ("dollar before a multi-byte character in the middle", "prefix-$€-suffix", "prefix-$€-suffix"),
    ("dollar before a Chinese character", "$中文", "$中文"),
    ("empty reference stays as written", "$()", "$()"),
]


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in KUBELET_CASES], ids=[c[0] for c in KUBELET_CASES])
def test_expansion_matches_the_kubelet_with_one_context(text: str, expected: str) -> None:
    assert expand(text, mapping_for(ONE_CONTEXT)) == expected


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in KUBELET_CASES], ids=[c[0] for c in KUBELET_CASES])
def test_expansion_matches_the_kubelet_with_two_contexts_searched_in_order(text: str, expected: str) -> None:
    assert expand(text, mapping_for(*TWO_CONTEXTS)) == expected


def test_the_first_context_that_defines_a_name_wins() -> None:
    assert expand("$(X)", mapping_for({"X": "pod"}, {"X": "extra"})) == "pod"


@given(st.text())
def test_escaping_every_dollar_gives_the_text_back_literally(text: str) -> None:
    assert expand(text.replace("$", "$$"), mapping_for({"A": "x", "": "y"})) == text


@given(st.text(alphabet=st.characters(blacklist_characters="$")))
def test_text_without_a_dollar_is_never_changed(text: str) -> None:
    assert expand(text, mapping_for({"A": "x"})) == text


# ---------------------------------------------------------------------------- pods and objects


def pod(env: list[dict[str, Any]] | None = None, **container: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "p-0",
            "namespace": "ns",
            "uid": "0123456789abcdef",
            "labels": {"disagg.dev/role": "prefill", "app": "x"},
            "annotations": {"disagg.dev/weights": "v7"},
        },
        "spec": {
            "nodeName": "hgx-001",
            "serviceAccountName": "engine",
            "hostNetwork": True,
            "containers": [
                {
                    "name": "engine",
                    "image": "drs/engine:dev",
                    "command": container.pop("command", ["drs", "engine"]),
                    "args": container.pop("args", []),
                    "env": env or [],
                    **container,
                }
            ],
        },
        "status": {
            "phase": "Running",
            "hostIP": "127.0.1.2",
            "hostIPs": [{"ip": "127.0.1.2"}],
            "podIP": "127.0.1.2",
            "podIPs": [{"ip": "127.0.1.2"}],
        },
    }


def secret(**data: str) -> dict[str, Any]:
    return {"data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}


def config_map(**data: str) -> dict[str, Any]:
    return {"data": data}


def env_of(
    p: dict[str, Any], secrets: dict[str, Any] | None = None, cms: dict[str, Any] | None = None
) -> dict[str, str]:
    return resolve(p, secrets or {}, cms or {}).env


FIELD_CASES = [
    ("metadata.name", "p-0"),
    ("metadata.namespace", "ns"),
    ("metadata.uid", "0123456789abcdef"),
    ("metadata.labels['disagg.dev/role']", "prefill"),
    ("metadata.labels['missing']", ""),
    ("metadata.annotations['disagg.dev/weights']", "v7"),
    ("spec.nodeName", "hgx-001"),
    ("spec.serviceAccountName", "engine"),
    ("status.hostIP", "127.0.1.2"),
    ("status.hostIPs", "127.0.1.2"),
    ("status.podIP", "127.0.1.2"),
    ("status.podIPs", "127.0.1.2"),
]


@pytest.mark.parametrize(("path", "expected"), FIELD_CASES, ids=[f"fieldRef {c[0]}" for c in FIELD_CASES])
def test_a_field_ref_reads_the_pod_field_the_kubelet_reads(path: str, expected: str) -> None:
    p = pod([{"name": "V", "valueFrom": {"fieldRef": {"fieldPath": path}}}])
    assert env_of(p)["V"] == expected


def test_dual_stack_ip_lists_are_joined_with_commas_and_the_first_is_the_ip() -> None:
    p = pod()
    p["status"]["podIPs"] = [{"ip": "127.0.1.2"}, {"ip": "::1"}]
    assert field_value(p, "status.podIPs") == "127.0.1.2,::1"
    assert field_value(p, "status.podIP") == "127.0.1.2"


@pytest.mark.parametrize(
    ("path", "api_version", "message"),
    [
        ("status.phase", "v1", "not supported for env"),
        ("metadata.labels", "v1", "not supported for env"),
        ("spec.containers['x']", "v1", "does not support a subscript"),
        ("metadata.name", "v2", "apiVersion 'v2'"),
    ],
    ids=[
        "a field the kubelet does not give env",
        "all labels at once",
        "a subscript on a plain field",
        "apiVersion v2",
    ],
)
def test_an_unsupported_field_ref_is_a_named_problem(path: str, api_version: str, message: str) -> None:
    p = pod([{"name": "V", "valueFrom": {"fieldRef": {"fieldPath": path, "apiVersion": api_version}}}])
    with pytest.raises(EnvResolutionError, match=message):
        env_of(p)


def test_secret_key_refs_are_base64_decoded() -> None:
    p = pod([{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}}])
    assert env_of(p, secrets={"creds": secret(token="s3cr3t ünïcode")})["TOKEN"] == "s3cr3t ünïcode"


def test_config_map_key_refs_read_data() -> None:
    p = pod([{"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode"}}}])
    assert env_of(p, cms={"cfg": config_map(mode="fast")})["MODE"] == "fast"


def test_config_map_key_refs_ignore_binary_data_like_the_kubelet() -> None:
    p = pod([{"name": "BLOB", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "blob"}}}])
    with pytest.raises(EnvResolutionError, match="key 'blob' not found in configmap 'cfg'"):
        env_of(p, cms={"cfg": {"binaryData": {"blob": "AAEC"}}})


MISSING_CASES = [
    ("secretKeyRef", {}, "secret 'creds' not found"),
    ("secretKeyRef", {"creds": secret(other="x")}, "key 'token' not found in secret 'creds'"),
    ("configMapKeyRef", {}, "configmap 'creds' not found"),
    ("configMapKeyRef", {"creds": config_map(other="x")}, "key 'token' not found in configmap 'creds'"),
]
MISSING_IDS = ["secret missing", "secret key missing", "configmap missing", "configmap key missing"]


@pytest.mark.parametrize(("kind", "objects", "message"), MISSING_CASES, ids=MISSING_IDS)
def test_a_missing_required_ref_is_a_problem_that_names_it(kind: str, objects: dict[str, Any], message: str) -> None:
    p = pod([{"name": "V", "valueFrom": {kind: {"name": "creds", "key": "token"}}}])
    secrets, cms = (objects, {}) if kind == "secretKeyRef" else ({}, objects)
    with pytest.raises(EnvResolutionError, match=message):
        env_of(p, secrets, cms)


@pytest.mark.parametrize(("kind", "objects", "message"), MISSING_CASES, ids=MISSING_IDS)
def test_a_missing_optional_ref_leaves_the_variable_unset(kind: str, objects: dict[str, Any], message: str) -> None:
    p = pod([{"name": "V", "valueFrom": {kind: {"name": "creds", "key": "token", "optional": True}}}])
    secrets, cms = (objects, {}) if kind == "secretKeyRef" else ({}, objects)
    assert "V" not in env_of(p, secrets, cms)


def test_every_problem_is_reported_at_once() -> None:
    p = pod(
        [
            {"name": "A", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k"}}},
            {"name": "B", "valueFrom": {"configMapKeyRef": {"name": "nada", "key": "k"}}},
            {"name": "C", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
        ]
    )
    with pytest.raises(EnvResolutionError) as err:
        env_of(p)
    assert len(err.value.problems) == 3
    assert "resourceFieldRef is not supported by the local pod runner" in err.value.problems[2]


def test_secret_data_that_is_not_base64_is_a_problem() -> None:
    p = pod([{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}])
    with pytest.raises(EnvResolutionError, match="not valid base64"):
        env_of(p, secrets={"s": {"data": {"k": "not base64!"}}})


def test_env_from_adds_prefixed_keys_and_env_overrides_them() -> None:
    p = pod(
        [{"name": "CFG_MODE", "value": "explicit"}],
        envFrom=[
            {"configMapRef": {"name": "cfg"}, "prefix": "CFG_"},
            {"secretRef": {"name": "creds"}},
        ],
    )
    env = env_of(p, secrets={"creds": secret(TOKEN="t")}, cms={"cfg": config_map(MODE="fast", LEVEL="3")})
    assert env["CFG_MODE"] == "explicit" and env["CFG_LEVEL"] == "3" and env["TOKEN"] == "t"


def test_a_later_env_from_source_overrides_an_earlier_one() -> None:
    p = pod(envFrom=[{"configMapRef": {"name": "a"}}, {"configMapRef": {"name": "b"}}])
    assert env_of(p, cms={"a": config_map(X="a"), "b": config_map(X="b")})["X"] == "b"


def test_env_from_a_missing_object_is_a_problem_unless_optional() -> None:
    with pytest.raises(EnvResolutionError, match="envFrom: secret 'gone' not found"):
        env_of(pod(envFrom=[{"secretRef": {"name": "gone"}}]))
    assert env_of(pod(envFrom=[{"secretRef": {"name": "gone", "optional": True}}])) == {}


def test_a_value_sees_only_variables_declared_before_it() -> None:
    p = pod(
        [
            {"name": "LATE_REF", "value": "<$(B)>"},
            {"name": "B", "value": "b"},
            {"name": "EARLY_REF", "value": "<$(B)>"},
        ]
    )
    env = env_of(p)
    assert env["LATE_REF"] == "<$(B)>" and env["EARLY_REF"] == "<b>"


def test_a_value_can_reference_a_field_ref_and_an_env_from_key_declared_before_it() -> None:
    p = pod(
        [
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "URL", "value": "http://$(POD):$(PORT)/$$(POD)"},
        ],
        envFrom=[{"configMapRef": {"name": "cfg"}}],
    )
    assert env_of(p, cms={"cfg": config_map(PORT="8000")})["URL"] == "http://p-0:8000/$(POD)"


def test_value_from_results_are_never_expanded() -> None:
    p = pod(
        [
            {"name": "A", "value": "a"},
            {"name": "RAW", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "raw"}}},
        ]
    )
    assert env_of(p, cms={"cfg": config_map(raw="$(A)$$")})["RAW"] == "$(A)$$"


def test_an_entry_with_neither_value_nor_value_from_is_set_empty() -> None:
    assert env_of(pod([{"name": "EMPTY"}]))["EMPTY"] == ""


def test_command_and_args_are_expanded_against_the_whole_environment() -> None:
    p = pod(
        [
            {"name": "PORT", "value": "18001"},
            {"name": "ROLE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['disagg.dev/role']"}}},
        ],
        command=["drs", "engine", "--role=$(ROLE)"],
        args=["--host", "$(DRS_NODE_IP)", "--port", "$(PORT)", "--literal", "$$(PORT)", "--unknown", "$(NOPE)"],
    )
    resolved = resolve(p, {}, {}, extra_env={NODE_IP_ENV: "127.0.1.2"})
    assert resolved.argv == [
        "drs", "engine", "--role=prefill", "--host", "127.0.1.2", "--port", "18001",
        "--literal", "$(PORT)", "--unknown", "$(NOPE)",
    ]  # fmt: skip


def test_the_node_ip_is_set_and_visible_to_values_but_the_pod_may_override_it() -> None:
    extra = {NODE_IP_ENV: "127.0.1.2"}
    plain = resolve(pod([{"name": "BIND", "value": "$(DRS_NODE_IP):80"}]), {}, {}, extra)
    assert plain.env[NODE_IP_ENV] == "127.0.1.2" and plain.env["BIND"] == "127.0.1.2:80"
    overridden = resolve(pod([{"name": NODE_IP_ENV, "value": "0.0.0.0"}]), {}, {}, extra)
    assert overridden.env[NODE_IP_ENV] == "0.0.0.0"


def test_a_value_with_a_nul_byte_cannot_be_set_in_a_process_environment() -> None:
    p = pod([{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}])
    with pytest.raises(EnvResolutionError, match="NUL byte"):
        env_of(p, secrets={"s": secret(k="a\x00b")})


def test_referenced_objects_lists_every_secret_and_config_map_once() -> None:
    p = pod(
        [
            {"name": "A", "valueFrom": {"secretKeyRef": {"name": "s1", "key": "k"}}},
            {"name": "B", "valueFrom": {"secretKeyRef": {"name": "s1", "key": "j"}}},
            {"name": "C", "valueFrom": {"configMapKeyRef": {"name": "c1", "key": "k"}}},
            {"name": "D", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        envFrom=[{"secretRef": {"name": "s2"}}, {"configMapRef": {"name": "c2"}}],
    )
    refs = referenced_objects(p["spec"]["containers"][0])
    assert refs.secrets == {"s1", "s2"} and refs.config_maps == {"c1", "c2"}


# ---------------------------------------------------------------------------- the drs contract


@pytest.mark.parametrize(
    ("command", "runs"),
    [
        (["drs", "engine"], True),
        (["drs"], True),
        (["python", "-m", "drs"], False),
        ([], False),
        (["/usr/bin/drs"], False),
    ],
    ids=["drs engine", "bare drs", "python -m drs", "no command (image entrypoint)", "an absolute path to drs"],
)
def test_only_a_command_starting_with_drs_is_ours(command: list[str], runs: bool) -> None:
    assert is_drs_command({"command": command}) is runs


def test_drs_is_replaced_by_the_console_script_run_by_the_runners_python() -> None:
    assert local_argv(["drs", "engine", "--port", "1"], "/venv/bin/python", "/venv/bin/drs") == [
        "/venv/bin/python", "/venv/bin/drs", "engine", "--port", "1",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="not a drs command line"):
        local_argv(["bash", "-c", "x"], "/venv/bin/python", "/venv/bin/drs")
