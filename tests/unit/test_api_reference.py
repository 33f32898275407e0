"""docs/api-reference.md is generated from the API models (``drs crd --api-reference``): a test
fails when the committed page and the models disagree (regenerate with ``make crd``)."""

from __future__ import annotations

from pathlib import Path

from drs_operator.api import DisaggReplicaSetSpec
from drs_operator.api_reference import render_api_reference

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "api-reference.md"


def test_the_committed_api_reference_is_the_generated_one() -> None:
    assert PAGE.read_text(encoding="utf-8") == render_api_reference(), "run `make crd` to regenerate it"


def test_every_spec_block_and_backend_option_has_a_section() -> None:
    page = render_api_reference()
    for field in DisaggReplicaSetSpec.model_fields.values():
        assert f"| `{field.alias}`" in page
    for block in ("spec.engine", "spec.engine.sim", "spec.engine.torch", "spec.networkPolicy.engineClients[]"):
        assert f"## `{block}`\n" in page
    assert "One of `auto`, `http`, `cuda_ipc`." in page
