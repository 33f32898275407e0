"""Reading the frontend config: a YAML/JSON file or JSON text, with command-line flags on top.

The model (:class:`~drs_protocol.frontend_config.FrontendConfig`) lives in ``drs_protocol``: the
operator renders it per replica and this package parses it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from drs_protocol.config import read_config_file
from drs_protocol.enums import CtxRouter, GenRouter
from drs_protocol.frontend_config import FrontendConfig, Limits, Timeouts, TokenizeCache, UpstreamClientName
from pydantic.alias_generators import to_camel

__all__ = [
    "CtxRouter",
    "FrontendConfig",
    "GenRouter",
    "Limits",
    "Timeouts",
    "TokenizeCache",
    "UpstreamClientName",
    "load_config",
    "read_config_file",
]


def load_config(path: Path | None, overrides: dict[str, Any], base: dict[str, Any] | None = None) -> FrontendConfig:
    """``base`` (or the file's settings) with ``overrides`` (flags that were given) on top, validated."""
    data = read_config_file(path) if path is not None else dict(base or {})
    for key, value in overrides.items():
        if value is not None:
            data.pop(to_camel(key), None)  # a flag wins over the file's camelCase key
            data[key] = value
    return FrontendConfig.model_validate(data)
