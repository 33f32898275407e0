"""Reading the engine config: a YAML/JSON file or JSON text, with command-line flags laid over it.

The model itself (:class:`~drs_protocol.engine_config.EngineConfig`) lives in ``drs_protocol``: the
operator renders it and this package parses it. ``drs engine --config FILE`` reads it; flags
override the file (``--backend``, ``--role``, ``--host``, ``--port``, ``--advertise-url``,
``--sim-speed``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from drs_protocol.config import read_config_file
from drs_protocol.engine_config import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_PORT,
    SIM_DEFAULT_MODEL,
    CacheTransceiverSpec,
    EngineConfig,
    ModelSpec,
    SimSpec,
)
from drs_protocol.enums import EngineBackend, Role
from pydantic.alias_generators import to_camel

#: The engine's name for :class:`~drs_protocol.enums.EngineBackend`.
BackendName = EngineBackend

__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "DEFAULT_PORT",
    "SIM_DEFAULT_MODEL",
    "BackendName",
    "CacheTransceiverSpec",
    "EngineConfig",
    "ModelSpec",
    "Role",
    "SimSpec",
    "build_config",
    "load_config_file",
]


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The raw mapping in a YAML or JSON engine config file."""
    return read_config_file(path)


def build_config(file_data: dict[str, Any] | None = None, **overrides: Any) -> EngineConfig:
    """The config from a file's mapping with flag values laid over it (``None`` overrides are skipped).

    Override keys are field names (snake_case); ``sim_speed`` sets ``sim.speed``.
    """
    data: dict[str, Any] = dict(file_data or {})
    sim_speed = overrides.pop("sim_speed", None)
    for key, value in overrides.items():
        if value is not None:
            data.pop(to_camel(key), None)
            data[key] = value
    if sim_speed is not None:
        sim = dict(data.get("sim") or {})
        sim.pop("speed", None)
        sim["speed"] = sim_speed
        data["sim"] = sim
    if "model" not in data and str(data.get("backend")) == EngineBackend.SIM:
        data["model"] = {"path": SIM_DEFAULT_MODEL}
    return EngineConfig.model_validate(data)
