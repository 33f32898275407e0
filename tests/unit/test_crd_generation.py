"""The generated CRD: no drift from the committed file, structural, CEL rules well-formed."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from drs_operator.api import DisaggReplicaSetSpec, RoleSpec
from drs_operator.api.rules import RESOURCE_RULES, ROLE_RULES, SPEC_RULES
from drs_operator.crd import SchemaError, build_crd, openapi_schema, render_crd
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "crds" / "disagg.dev_disaggreplicasets.yaml"

CRD = build_crd()
VERSION = CRD["spec"]["versions"][0]
ROOT = VERSION["schema"]["openAPIV3Schema"]
SPEC = ROOT["properties"]["spec"]


def test_the_committed_crd_is_the_generated_one() -> None:
    assert COMMITTED.read_text() == render_crd(), (
        "crds/disagg.dev_disaggreplicasets.yaml is stale: run `drs crd > crds/disagg.dev_disaggreplicasets.yaml`"
    )


def test_the_committed_crd_parses_to_the_built_one() -> None:
    assert yaml.safe_load(COMMITTED.read_text()) == CRD


def test_identity_subresources_and_columns() -> None:
    spec = CRD["spec"]
    assert CRD["metadata"]["name"] == "disaggreplicasets.disagg.dev"
    assert (spec["group"], spec["scope"], VERSION["name"]) == ("disagg.dev", "Namespaced", "v1alpha1")
    assert spec["names"]["kind"] == "DisaggReplicaSet" and spec["names"]["plural"] == "disaggreplicasets"
    assert spec["names"]["shortNames"] == ["drs"]
    assert VERSION["served"] and VERSION["storage"]
    assert VERSION["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    assert [c["name"] for c in VERSION["additionalPrinterColumns"]] == [
        "Replicas",
        "Ready",
        "GPUs",
        "Phase",
        "Weights",
        "Age",
    ]
    for column in VERSION["additionalPrinterColumns"][:-1]:
        assert resolve(ROOT, column["jsonPath"]) is not None, column


def walk(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for name, prop in schema.get("properties", {}).items():
        yield from walk(prop, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}.*")


def resolve(schema: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The sub-schema at a dotted path (``.a.b``), or None."""
    node: dict[str, Any] | None = schema
    for part in path.strip(".").split("."):
        node = (node or {}).get("properties", {}).get(part)
    return node


@pytest.mark.parametrize("where", ["spec", "status"], ids=lambda w: f"the {w} schema is structural")
def test_structural(where: str) -> None:
    for path, node in walk(ROOT["properties"][where], where):
        assert not {"$ref", "anyOf", "oneOf", "allOf", "title", "const", "nullable", "$defs"} & node.keys(), path
        assert "type" in node, f"{path} has no type"
        assert node.get("additionalProperties") is not False, path
        if node["type"] == "object":
            assert (
                "properties" in node
                or "additionalProperties" in node
                or node.get("x-kubernetes-preserve-unknown-fields")
            ), f"{path}: an object needs properties, additionalProperties or preserve-unknown-fields"
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            assert node.get(key, True) is True, f"{path}.{key} must be the OpenAPI v3.0 boolean"


def test_unknown_fields_are_preserved_only_where_free_form() -> None:
    preserved = {path for path, node in walk(SPEC, "spec") if node.get("x-kubernetes-preserve-unknown-fields")}
    assert preserved == {
        "spec.model.volume",
        "spec.engine.simOptions",
        "spec.prefill.trtllmKwargs",
        "spec.prefill.template",
        "spec.decode.trtllmKwargs",
        "spec.decode.template",
        "spec.frontend.resources",
        "spec.frontend.template",
        "spec.trtllm.kwargs",
        "spec.template",
        # Kubernetes' own NetworkPolicyPeer parts, passed through to the per-replica policies
        "spec.networkPolicy.engineClients[].podSelector",
        "spec.networkPolicy.engineClients[].namespaceSelector",
        "spec.networkPolicy.engineClients[].ipBlock",
    }


def test_spec_lists_and_maps_are_bounded() -> None:
    for path, node in walk(SPEC, "spec"):
        if node["type"] == "array":
            assert "maxItems" in node, path
        if node["type"] == "object" and "additionalProperties" in node:
            assert "maxProperties" in node, path


def test_blocks_default_to_empty_objects_so_their_own_defaults_apply() -> None:
    for block in (
        "engine",
        "prefill",
        "decode",
        "frontend",
        "router",
        "trtllm",
        "network",
        "networkPolicy",
        "topology",
        "images",
    ):
        assert SPEC["properties"][block]["default"] == {}, block
    assert SPEC["required"] == ["model"]
    assert SPEC["properties"]["prefill"]["properties"]["engines"]["default"] == 1
    assert SPEC["properties"]["frontend"]["properties"]["basePort"]["default"] == 8300
    assert "default" not in SPEC["properties"]["replicas"], (
        "replicas has no default: it is exclusive with inferenceGPUs"
    )


def rules_at(node: dict[str, Any]) -> list[dict[str, Any]]:
    return list(node.get("x-kubernetes-validations", []))


def test_cel_rules_sit_on_the_objects_they_constrain() -> None:
    assert rules_at(SPEC) == [r.to_schema() for r in SPEC_RULES]
    for role in ("prefill", "decode"):
        assert rules_at(SPEC["properties"][role]) == [r.to_schema() for r in ROLE_RULES]
    assert rules_at(ROOT) == [r.to_schema() for r in RESOURCE_RULES]


SELF_PATH = re.compile(r"self((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


@pytest.mark.parametrize(
    ("where", "schema"),
    [("spec", SPEC), ("spec.prefill", SPEC["properties"]["prefill"]), ("<root>", ROOT)],
    ids=["spec rules", "role rules", "root rules"],
)
def test_every_field_a_cel_rule_reads_exists_and_every_field_path_resolves(where: str, schema: dict[str, Any]) -> None:
    for rule in rules_at(schema):
        for match in SELF_PATH.finditer(rule["rule"]):
            path = match.group(1)
            path = re.sub(r"\.(matches|size|contains)$", "", path)
            if path.startswith(".metadata."):
                assert path in (".metadata.name", ".metadata.generateName"), path
                continue
            assert resolve(schema, path) is not None, f"{where}: {rule['rule']} reads unknown {path}"
        if "fieldPath" in rule:
            assert resolve(schema, rule["fieldPath"]) is not None, rule["fieldPath"]
        assert "\n" not in rule["message"] and rule["reason"].startswith("FieldValue")


def test_fields_a_role_may_not_set_are_in_the_schema_so_cel_can_reject_them() -> None:
    role = SPEC["properties"]["decode"]["properties"]
    assert {"precision", "maxModelLen", "parsers"} <= role.keys()


def test_default_blocks_are_valid_models() -> None:
    RoleSpec.model_validate(SPEC["properties"]["prefill"]["default"])
    DisaggReplicaSetSpec.model_validate({"replicas": 1, "model": {"path": "/m"}})


class _Union(BaseModel):
    x: int | str


class _Bare(BaseModel):
    y: dict[str, Any]
    z: dict[str, int]


def test_a_union_has_no_structural_schema() -> None:
    with pytest.raises(SchemaError, match="union of 2 types"):
        openapi_schema(_Union)


def test_free_form_and_typed_maps_translate() -> None:
    schema = openapi_schema(_Bare)
    assert schema["properties"]["y"] == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    assert schema["properties"]["z"] == {"type": "object", "additionalProperties": {"type": "integer"}}
