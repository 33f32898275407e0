"""Every contract between two processes is spelled once, in ``drs_protocol``, and both sides use it.

The scan reads the non-test code's syntax trees (docstrings aside): a route path, an environment
variable name, a header name or a role/backend/router enum spelled outside ``drs_protocol`` is drift, reported
with its file and line. The CRD's enums and bounds, the command lines' choices and the rendered
configs are checked against the same definitions.
"""

from __future__ import annotations

import ast
import enum
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from drs_protocol import enums, env, fields, routes
from drs_protocol.config import render
from drs_protocol.control import CollectiveUpdate, LoadWeights
from drs_protocol.engine_config import EngineConfig
from drs_protocol.frontend_config import FrontendConfig
from drs_protocol.limits import MAX_WEIGHTS_VERSION_CHARS
from drs_protocol.weights_digest import DIGEST_PATTERN

ROOT = Path(__file__).resolve().parents[2]
#: Non-test code: the source roots, the benchmarks and the examples.
CODE_ROOTS = (
    "cli",
    "operator",
    "frontend",
    "engine_image",
    "protocol",
    "devcluster",
    "sidecar",
    "client",
    "bench",
    "examples",
)
PROTOCOL = ROOT / "protocol" / "drs_protocol"
#: A literal that looks like a path of one of the project's HTTP APIs.
ROUTE_LIKE = re.compile(r"^/(v1/|control(/|$)|health$|healthz$|ready$|metrics$|server_info$)")
#: Literals that are other programs' endpoints, not ours (the dev cluster probes etcd, kwok and
#: the Kubernetes components on their own health routes).
NOT_OURS = {
    ("devcluster/drs_devcluster/cluster.py", "/health"),
    ("devcluster/drs_devcluster/cluster.py", "/healthz"),
    # kubelet, kube-proxy and CoreDNS of a real dev node
    ("devcluster/drs_devcluster/realnodes.py", "/healthz"),
    ("devcluster/drs_devcluster/realnodes.py", "/ready"),
    # the kube-apiserver's metrics, read by the scale benchmark
    ("bench/operator_scale.py", "/metrics"),
}
#: Example clients that stand for a user's program outside the project (the in-pod Gym client
#: sends its turns with httpx, as NeMo-Gym would; the Gym pod's agent runs in NeMo-Gym's venv,
#: where drs_protocol is not, and talks to Gym's own server): they spell the public paths.
EXTERNAL_CLIENTS = ("examples/gym_client.py", "examples/load_client.py", "examples/gym_agent.py")
#: A literal that looks like one of the project's environment variables.
ENV_LIKE = re.compile(r"^DRS_[A-Z0-9_]+$")
SHARED_ENUMS: tuple[type[enum.StrEnum], ...] = (
    enums.Role,
    enums.EngineBackend,
    enums.CtxRouter,
    enums.GenRouter,
    enums.Precision,
)


def _python_files() -> Iterator[Path]:
    for root in CODE_ROOTS:
        yield from sorted((ROOT / root).rglob("*.py"))


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _string_literals(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, value)`` of every string literal of ``path`` but its docstrings (f-string parts included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = _docstring_nodes(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def _literals_outside_protocol() -> list[tuple[str, int, str]]:
    return [
        (str(path.relative_to(ROOT)), line, value)
        for path in _python_files()
        if PROTOCOL not in path.parents
        for line, value in _string_literals(path)
    ]


def _contract_paths() -> set[str]:
    paths = {e.value for e in routes.Endpoint} | {r.value for r in routes.TrainerRoute}
    paths |= {routes.HEALTH, routes.READY, routes.METRICS, routes.HEALTHZ, routes.SERVER_INFO, routes.MODELS}
    paths.add(routes.KV_EXPORT)
    return paths | {routes.CONTROL_WEIGHTS, *routes.CONTROL_ROUTES.values()}


def _contract_env_names() -> set[str]:
    return {value for value in vars(env).values() if isinstance(value, str) and re.fullmatch(r"[A-Z][A-Z0-9_]*", value)}


def test_every_control_op_but_the_version_read_has_one_post_route() -> None:
    assert set(routes.CONTROL_ROUTES) == set(routes.ControlOp) - {routes.ControlOp.GET_WEIGHTS_VERSION}
    every = [*routes.CONTROL_ROUTES.values(), routes.CONTROL_WEIGHTS]
    assert len(set(every)) == len(every)


def test_no_route_path_is_spelled_outside_drs_protocol() -> None:
    contract = _contract_paths()
    drift = [
        f"{where}:{line}: {value!r}"
        for where, line, value in _literals_outside_protocol()
        if (value in contract or ROUTE_LIKE.match(value))
        and (where, value) not in NOT_OURS
        and where not in EXTERNAL_CLIENTS
    ]
    assert not drift, "route paths belong in drs_protocol.routes:\n" + "\n".join(drift)


#: A control-API or trainer-API path inside a message ("POST /control/weights/load first").
ROUTE_INSIDE = re.compile(r"(?<![\w./-])/(v1|control)/[a-z_]")


def test_no_message_spells_an_operations_path() -> None:
    drift = [
        f"{where}:{line}: {value!r}"
        for where, line, value in _literals_outside_protocol()
        if ROUTE_INSIDE.search(value) and not ROUTE_LIKE.match(value) and where not in EXTERNAL_CLIENTS
    ]
    assert not drift, "name the path from drs_protocol.routes in messages too:\n" + "\n".join(drift)


def test_no_contract_env_name_is_spelled_outside_drs_protocol() -> None:
    contract = _contract_env_names()
    drift = [f"{where}:{line}: {value!r}" for where, line, value in _literals_outside_protocol() if value in contract]
    assert not drift, "environment variable names belong in drs_protocol.env:\n" + "\n".join(drift)


def _contract_headers() -> set[str]:
    names = {fields.HEADER_PREFILL_ENGINE, fields.HEADER_DECODE_ENGINE, fields.HEADER_WEIGHTS_VERSION}
    return names | set(fields.CONVERSATION_HEADERS) | {fields.CONTROL_AUTH_CHALLENGE_HEADER}


def test_no_header_name_is_spelled_outside_drs_protocol() -> None:
    contract = _contract_headers()
    drift = [
        f"{where}:{line}: {value!r}"
        for where, line, value in _literals_outside_protocol()
        if (value.lower() in contract or value.lower().startswith("x-drs-")) and where not in EXTERNAL_CLIENTS
    ]
    assert not drift, "header names belong in drs_protocol.fields:\n" + "\n".join(drift)


def test_the_control_api_credential_round_trips() -> None:
    ((header, value),) = fields.control_auth("s3cret").items()
    assert header == fields.CONTROL_AUTH_HEADER and fields.bearer_token(value) == "s3cret"
    assert fields.bearer_token("bearer  s3cret ") == "s3cret"
    assert fields.bearer_token("Basic s3cret") is None and fields.bearer_token("Bearer ") is None


def test_every_drs_env_name_is_defined_once_in_non_test_code() -> None:
    seen: dict[str, list[str]] = {}
    for path in _python_files():
        for line, value in _string_literals(path):
            if ENV_LIKE.match(value):
                seen.setdefault(value, []).append(f"{path.relative_to(ROOT)}:{line}")
    twice = {name: places for name, places in seen.items() if len(places) > 1}
    assert not twice, f"an environment variable name spelled in more than one place: {twice}"
    assert {name for name in _contract_env_names() if ENV_LIKE.match(name)} <= set(seen)


#: Where the processes live (not the operator, which only renders names into pods).
PROCESS_ROOTS = ("cli", "frontend", "engine_image", "devcluster", "sidecar", "client", "examples")


def _env_names_read_by_processes() -> set[str]:
    """The drs_protocol.env names a process's code refers to (``env.NAME`` or ``from
    drs_protocol.env import NAME``): the names some process reads or sets for another."""
    names: set[str] = set()
    for root in PROCESS_ROOTS:
        for path in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "env":
                    names.add(node.attr)
                elif isinstance(node, ast.ImportFrom) and node.module == "drs_protocol.env":
                    names.update(alias.name for alias in node.names)
    values = {name: value for name, value in vars(env).items() if isinstance(value, str)}
    return {values[name] for name in names if name in values}


def _env_names_set_in(node: object) -> Iterator[str]:
    """Every ``env: [{name: …}]`` name of a Kubernetes manifest, however deep."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "env" and isinstance(value, list):
                yield from (e["name"] for e in value if isinstance(e, dict) and "name" in e)
            yield from _env_names_set_in(value)
    elif isinstance(node, list):
        for item in node:
            yield from _env_names_set_in(item)


def test_the_examples_set_only_the_contracts_env_names() -> None:
    read = _contract_env_names() & _env_names_read_by_processes()
    drift = []
    for path in sorted((ROOT / "examples").rglob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            names = set(_env_names_set_in(document))
            drift += [f"{path.relative_to(ROOT)}: {n}" for n in sorted(names) if ENV_LIKE.match(n) and n not in read]
    assert not drift, "an example sets a variable no process reads (drs_protocol.env):\n" + "\n".join(drift)


def test_the_example_check_sees_an_unread_name() -> None:
    """The check above can fail: a name no process refers to is not counted as read."""
    assert "DRS_NOT_A_CONTRACT" not in _env_names_read_by_processes()
    assert env.SIDECAR_URL in _env_names_read_by_processes()


def _enum_definitions(tree: ast.AST) -> Iterator[tuple[int, set[str]]]:
    """String sets that define a closed set of names: an Enum's members, a ``Literal[...]``, a
    ``click.Choice([...])``, a tuple or list of two or more strings."""
    for node in ast.walk(tree):
        strings: list[ast.expr] = []
        if isinstance(node, ast.ClassDef) and any("Enum" in ast.unparse(base) for base in node.bases):
            strings = [s.value for s in node.body if isinstance(s, ast.Assign)]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("Literal"):
            strings = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
        elif isinstance(node, ast.Tuple | ast.List | ast.Set) and len(node.elts) >= 2:
            strings = list(node.elts)
        values = {s.value for s in strings if isinstance(s, ast.Constant) and isinstance(s.value, str)}
        if values:
            yield node.lineno if hasattr(node, "lineno") else 0, values


def test_role_backend_and_router_names_are_enumerated_only_in_drs_protocol() -> None:
    drift = []
    for path in _python_files():
        if PROTOCOL in path.parents:
            continue
        for line, values in _enum_definitions(ast.parse(path.read_text(encoding="utf-8"))):
            for shared in SHARED_ENUMS:
                names = set(enums.choices(shared))
                if len(values & names) >= 2:
                    drift.append(f"{path.relative_to(ROOT)}:{line}: {sorted(values)} re-enumerates {shared.__name__}")
    assert not drift, "enumerate shared names with drs_protocol.enums:\n" + "\n".join(drift)


def test_no_shared_name_is_compared_as_a_literal() -> None:
    """``role == "prefill"`` drifts silently when the name changes; ``role == Role.PREFILL`` fails."""
    shared = {value for enum_class in SHARED_ENUMS for value in enums.choices(enum_class)}
    drift = []
    for path in _python_files():
        where = str(path.relative_to(ROOT))
        if PROTOCOL in path.parents or where in EXTERNAL_CLIENTS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare):
                literals = [c.value for c in (node.left, *node.comparators) if isinstance(c, ast.Constant)]
                drift += [f"{where}:{node.lineno}: {value!r}" for value in literals if value in shared]
    assert not drift, "compare with the drs_protocol.enums member:\n" + "\n".join(drift)


def _crd_spec_schema() -> dict[str, object]:
    crd = yaml.safe_load((ROOT / "crds" / "disagg.dev_disaggreplicasets.yaml").read_text())
    schema: dict[str, object] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_the_crd_enums_and_the_weights_version_bound_come_from_drs_protocol() -> None:
    props = _crd_spec_schema()["properties"]
    assert isinstance(props, dict)
    spec = props["spec"]["properties"]
    assert spec["engine"]["properties"]["backend"]["enum"] == enums.choices(enums.EngineBackend)
    assert spec["router"]["properties"]["ctx"]["enum"] == enums.choices(enums.CtxRouter)
    assert spec["router"]["properties"]["gen"]["enum"] == enums.choices(enums.GenRouter)
    status = props["status"]["properties"]
    weights = status["weights"]["properties"]["version"]
    assert weights["maxLength"] == MAX_WEIGHTS_VERSION_CHARS
    engine = status["replicaStatuses"]["items"]["properties"]["engines"]["items"]["properties"]
    assert engine["weightsVersion"]["maxLength"] == MAX_WEIGHTS_VERSION_CHARS
    assert engine["weightsDigest"]["pattern"] == DIGEST_PATTERN


def test_every_side_bounds_the_weights_version_alike() -> None:
    from drs_protocol.control import IpcUpdate, Refit, TrainerCollectiveUpdate, TrainerIpcUpdate

    for model in (LoadWeights, CollectiveUpdate, IpcUpdate, Refit, TrainerCollectiveUpdate, TrainerIpcUpdate):
        assert model.model_json_schema()["properties"]["version"]["maxLength"] == MAX_WEIGHTS_VERSION_CHARS


def test_the_frontend_node_id_bound_is_the_snowflakes_everywhere() -> None:
    from drs_operator.api.status import FrontendStatus
    from drs_protocol.snowflake import NODE_IDS, SnowflakeMinter

    SnowflakeMinter(NODE_IDS - 1)
    with pytest.raises(ValueError):
        SnowflakeMinter(NODE_IDS)
    for model in (FrontendConfig, FrontendStatus):
        assert model.model_json_schema()["properties"]["nodeId"]["maximum"] == NODE_IDS - 1, model.__name__
    props = _crd_spec_schema()["properties"]
    assert isinstance(props, dict)
    assert props["spec"]["properties"]["frontend"]["properties"]["workers"]["maximum"] == NODE_IDS


@pytest.mark.parametrize(
    ("command", "option", "shared"),
    [
        ("engine", "--backend", enums.EngineBackend),
        ("engine", "--role", enums.Role),
        ("frontend", "--ctx-router", enums.CtxRouter),
        ("frontend", "--gen-router", enums.GenRouter),
    ],
)
def test_command_line_choices_are_the_shared_names(command: str, option: str, shared: type[enum.StrEnum]) -> None:
    from drs_cli.main import main as cli

    result = CliRunner().invoke(cli, [command, "--help"], terminal_width=500)
    assert result.exit_code == 0, result.output
    line = next(ln for ln in result.output.splitlines() if ln.strip().startswith(option))
    assert "[" + "|".join(enums.choices(shared)) + "]" in line


def test_the_operators_rendered_configs_parse_as_the_processes_parse_them() -> None:
    from drs_devcluster.profiles import build_nodes
    from drs_engine.config import build_config
    from drs_frontend.config import load_config
    from drs_operator.api.spec import DisaggReplicaSetSpec
    from drs_operator.manifests.engines import build_engine_config
    from drs_operator.manifests.frontends import build_frontend_config
    from drs_operator.nodepool import nodes_from_manifests
    from drs_operator.placement import place
    from drs_operator.plan import plan

    spec = DisaggReplicaSetSpec.model_validate(
        {
            "replicas": 1,
            "model": {"path": "/models/m", "maxModelLen": 4096},
            "decode": {"tensorParallelSize": 2, "maxBatchSize": 8},
            "engine": {"backend": "sim", "simOptions": {"speed": 0, "tokensPerBlock": 16}},
            "router": {"ctx": "round_robin"},
        }
    )
    fleet = plan(spec, "fleet")
    engine = build_engine_config(spec, fleet, enums.Role.DECODE)
    rendered_engine = json.loads(render(engine))
    assert build_config(rendered_engine) == engine
    assert engine.sim.tokens_per_block == 16 and engine.max_batch_size == 8
    assert {"tensorParallelSize", "maxBatchSize", "trtllmKwargs"} <= set(rendered_engine)
    assert rendered_engine["model"]["maxModelLen"] == 4096
    placement = place(fleet, nodes_from_manifests(build_nodes("hgx", 1)), None)
    frontend = build_frontend_config(spec, fleet, fleet.replicas[0], placement.replica(0), "ns", {})
    rendered_frontend = json.loads(render(frontend))
    assert rendered_frontend["ctxRouter"] == "round_robin" and "ctx_router" not in rendered_frontend
    assert load_config(None, {}, rendered_frontend) == frontend
    assert isinstance(frontend, FrontendConfig) and isinstance(engine, EngineConfig)
