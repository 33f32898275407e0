"""``drs engine``: run one engine server.

Flags override the config file. The port is bound before the model loads; if it cannot be bound
the command exits at once with status 1, naming the port.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import click
from drs_protocol import env
from drs_protocol.config import parse_config_json
from drs_protocol.enums import EngineBackend, Role, choices

from drs_engine.config import build_config, load_config_file

EXIT_BIND_FAILED = 1
EXIT_STARTUP_FAILED = 3


def read_control_token(token_file: str | None) -> str | None:
    """The control token: the file's content (stripped) if given, else the environment's."""
    if token_file:
        token = Path(token_file).read_text(encoding="utf-8").strip()
        if not token:
            raise click.ClickException(f"control token file {token_file} is empty")
        return token
    return os.environ.get(env.CONTROL_TOKEN, "").strip() or None


@click.command(name="engine")
@click.option(
    "--backend",
    type=click.Choice(choices(EngineBackend)),
    default=None,
    help="trtllm (GPU), torch (reference GPU engine in PyTorch) or sim (test double).",
)
@click.option("--role", type=click.Choice(choices(Role)), default=None)
@click.option("--port", type=click.IntRange(0, 65535), default=None, help="Listening port (0: any free port).")
@click.option("--host", default=None, help="Listening address (default 0.0.0.0).")
@click.option("--advertise-url", default=None, help="URL peers use to reach this engine (default http://HOST:PORT).")
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Engine config, YAML or JSON (drs_engine.config.EngineConfig).",
)
@click.option(
    "--config-json",
    envvar=env.ENGINE_CONFIG_JSON,
    default=None,
    help=f"Engine config as JSON text (else ${env.ENGINE_CONFIG_JSON}; the operator sets it from the role's ConfigMap).",
)
@click.option(
    "--control-token-file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help=f"File holding the control-API bearer token (else ${env.CONTROL_TOKEN}; none: control API off).",
)
@click.option(
    "--sim-speed",
    type=click.FloatRange(min=0.0),
    default=None,
    help="sim only: multiplier on simulated durations (0: no sleeping).",
)
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info")
def engine(
    backend: str | None,
    role: str | None,
    port: int | None,
    host: str | None,
    advertise_url: str | None,
    config_file: str | None,
    config_json: str | None,
    control_token_file: str | None,
    sim_speed: float | None,
    log_level: str,
) -> None:
    """Run one engine server (TensorRT-LLM, or the sim test double)."""
    from drs_protocol.listen import BindError
    from pydantic import ValidationError

    from drs_engine.server.runner import bind_socket, uvicorn_server

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_config(
            load_config_file(config_file)
            if config_file
            else parse_config_json(config_json, source=env.ENGINE_CONFIG_JSON),
            backend=backend,
            role=role,
            port=port,
            host=host,
            advertise_url=advertise_url,
            sim_speed=sim_speed,
        )
    except (ValidationError, ValueError, OSError) as exc:
        raise click.ClickException(f"invalid engine config: {exc}") from exc
    token = read_control_token(control_token_file)
    try:
        sock = bind_socket(config.host, config.port)
    except BindError as exc:
        click.echo(f"drs engine: {exc.strerror}", err=True)
        sys.exit(EXIT_BIND_FAILED)
    config = config.model_copy(update={"port": sock.getsockname()[1]})
    if token is None:
        click.echo(
            f"drs engine: no control token ({env.CONTROL_TOKEN} or --control-token-file): control API disabled",
            err=True,
        )
    click.echo(
        f"drs engine: {config.backend.value} {config.role.value} listening on {config.host}:{config.port}", err=True
    )
    server = uvicorn_server(config, token, log_level=log_level)
    try:
        server.run(sockets=[sock])
    except SystemExit as exc:  # uvicorn exits this way when the app's startup (model load) fails
        if exc.code in (0, None):
            raise
        started = False
    else:
        started = server.started
    if not started:
        click.echo(f"drs engine: failed to start on port {config.port} (see the log above)", err=True)
        sys.exit(EXIT_STARTUP_FAILED)
