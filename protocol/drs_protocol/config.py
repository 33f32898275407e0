"""The base of the process configs the operator renders and the processes parse.

One key convention for both (:mod:`drs_protocol.engine_config`, :mod:`drs_protocol.frontend_config`):
camelCase on the wire, as in the DisaggReplicaSet resource, with the Python field names
(snake_case, TensorRT-LLM's spellings) accepted on input too. The operator renders a config by
constructing the model and dumping it with :func:`render`; ``drs engine`` and ``drs frontend``
validate the same model, so a field renamed on one side fails the other's tests. Unknown keys are
rejected: a typo in a rendered config must fail the pod, not be ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class CamelModel(BaseModel):
    """The one key convention: camelCase aliases (snake_case names accepted), unknown keys rejected.

    The rendered configs and the operator's own models of the resource (spec, status, metadata)
    derive from it; a subclass changes only what differs (``frozen``, or which unknown keys it
    keeps), and pydantic merges that into this config."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="forbid",
    )


class ConfigModel(CamelModel):
    """Base of the process configs the operator renders (:func:`render`) and the processes parse."""


def render(config: BaseModel) -> str:
    """The JSON the operator puts in a ConfigMap: the fields it set, camelCase, keys sorted."""
    data = config.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return json.dumps(data, sort_keys=True, indent=1)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The raw mapping in a YAML or JSON config file (JSON is YAML, but a ``.json`` file gets JSON errors)."""
    text = Path(path).read_text(encoding="utf-8")
    data: Any = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the config must be a mapping, got {type(data).__name__}")
    return data


def parse_config_json(text: str | None, *, source: str) -> dict[str, Any] | None:
    """A config given as JSON text (``--config-json`` or the env var named ``source``); None when empty."""
    if not text:
        return None
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{source}: the config must be a JSON object, got {type(data).__name__}")
    return data
