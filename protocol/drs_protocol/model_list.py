"""``GET /v1/models``: OpenAI's model-list answer, defined once for the engine (which builds it) and
the frontend (which relays an engine's, checked against the same model).

The shape is OpenAI's ``Model`` / ``SyncPage[Model]`` (``id``, ``object: "model"``, ``created``,
``owned_by``; the list ``{"object": "list", "data": [...]}``): the ``openai`` SDK's
``client.models.list()`` and NeMo-Gym's ``create_models`` read it.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field

#: ``owned_by`` of every model a drs engine serves.
OWNER: Final = "drs"


class ModelCard(BaseModel):
    """One served model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, description="the served model name (what a request's `model` names)")
    object: Literal["model"] = "model"
    created: int = Field(ge=0, description="Unix seconds: when this engine process started serving it")
    owned_by: str = OWNER


class ModelList(BaseModel):
    """The answer of ``GET /v1/models``: at least one model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(min_length=1)


def model_list(name: str, created: int) -> ModelList:
    """The list of the one model an engine serves."""
    return ModelList(data=[ModelCard(id=name, created=created)])
