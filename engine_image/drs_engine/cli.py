"""``drs engine``: run one engine server.

Flags override the config file. The port is bound before the model loads; if it cannot be bound
the command exits at once with status 1, naming the port.

An engine wider than a node (``DRS_WORLD_SIZE`` > 1, set by the operator) runs as a gang: rank 0
is the leader (Ray head + engine server), ranks above join its Ray cluster and serve only
``/health`` (``drs_engine.gang``). A lost gang ends the process with status 4, so the pod restarts.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import TYPE_CHECKING

import click
from drs_protocol import env
from drs_protocol.config import parse_config_json
from drs_protocol.enums import EngineBackend, Role, choices
from drs_protocol.token_source import TokenSource, token_source

from drs_engine.config import build_config, load_config_file
from drs_engine.gang.spec import EXIT_GANG_LOST, GangSpec
from drs_engine.weights.desired import DesiredWeightsError, weights_from_env

if TYPE_CHECKING:
    from drs_protocol.engine_config import EngineConfig

EXIT_BIND_FAILED = 1
EXIT_STARTUP_FAILED = 3


def read_token_option(token_file: str | None, env_name: str, dir_env_name: str, what: str) -> TokenSource:
    """A token source (``drs_protocol.token_source``): the Secret mounted at ``$dir_env_name``
    (re-read while the engine runs), else the file's content if given, else ``$env_name``."""
    directory = os.environ.get(dir_env_name) or None
    try:
        source = token_source(directory, token_file, os.environ.get(env_name), f"{what} token")
    except OSError as exc:
        raise click.ClickException(f"{what} token file: {exc}") from exc
    if token_file and not directory and source.current is None:
        raise click.ClickException(f"{what} token file {token_file} is empty")
    return source


def read_control_token(token_file: str | None) -> TokenSource:
    """The control token source: ``$DRS_CONTROL_TOKEN_DIR``, else the file, else ``$DRS_CONTROL_TOKEN``."""
    return read_token_option(token_file, env.CONTROL_TOKEN, env.CONTROL_TOKEN_DIR, "control")


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
    "--serving-token-file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help=f"File holding the fleet's serving token (else ${env.SERVING_TOKEN}; none: serving routes open to anyone).",
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
    serving_token_file: str | None,
    sim_speed: float | None,
    log_level: str,
) -> None:
    """Run one engine server (TensorRT-LLM, or the sim test double)."""
    from drs_protocol.listen import BindError
    from pydantic import ValidationError

    from drs_engine.gang.spec import GangSpecError, gang_from_env
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
    try:
        gang = gang_from_env(os.environ)
    except GangSpecError as exc:
        raise click.ClickException(f"invalid gang: {exc}") from exc
    token = read_control_token(control_token_file)
    serving_token = read_token_option(serving_token_file, env.SERVING_TOKEN, env.SERVING_TOKEN_DIR, "serving")
    try:
        weights = weights_from_env(os.environ)
    except DesiredWeightsError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        sock = bind_socket(config.host, config.port)
    except BindError as exc:
        click.echo(f"drs engine: {exc.strerror}", err=True)
        sys.exit(EXIT_BIND_FAILED)
    config = config.model_copy(update={"port": sock.getsockname()[1]})
    if gang is not None and not gang.is_leader:
        sys.exit(_run_rank(gang, config.host, config.port, sock, log_level, serving_token))
    _say_how_it_serves(config, token, serving_token, gang)
    server = uvicorn_server(config, token, serving_token=serving_token, log_level=log_level, gang=gang, **weights)
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
    fatal = server.state.fatal
    if fatal is not None:
        click.echo(f"drs engine: the gang is lost ({fatal}); exiting so that the engine restarts as a whole", err=True)
        sys.exit(EXIT_GANG_LOST)


def _say_how_it_serves(
    config: EngineConfig, token: TokenSource, serving_token: TokenSource, gang: GangSpec | None
) -> None:
    """The start's lines on stderr: where it listens, which tokens guard it, its gang."""
    if not token.configured:
        click.echo(
            f"drs engine: no control token ({env.CONTROL_TOKEN} or --control-token-file): control API disabled",
            err=True,
        )
    click.echo(
        f"drs engine: {config.backend.value} {config.role.value} listening on {config.host}:{config.port}", err=True
    )
    if not serving_token.configured:
        click.echo(
            f"drs engine: no serving token ({env.SERVING_TOKEN} or --serving-token-file): serving routes open to anyone",
            err=True,
        )
    if gang is not None:
        click.echo(
            f"drs engine: leader of a gang of {gang.world_size} ranks (Ray head on port {gang.ray_port})", err=True
        )


def _run_rank(
    gang: GangSpec, host: str, port: int, sock: socket.socket, log_level: str, serving_token: TokenSource
) -> int:
    """A rank above 0: join the leader's Ray cluster and serve ``/health`` (its exit code)."""
    import asyncio

    from drs_engine.gang.worker import serve_worker

    if host in ("0.0.0.0", "::", ""):
        raise click.ClickException("--host must be this pod's address for an engine wider than a node (Ray binds it)")
    leader = gang.leader_address if ":" not in gang.leader_address else f"[{gang.leader_address}]"
    click.echo(
        f"drs engine: rank {gang.rank} of {gang.world_size}, joining the leader at {leader}:{port} "
        f"(Ray {gang.ray_address}); /health on {host}:{port}",
        err=True,
    )
    return asyncio.run(serve_worker(gang, host, f"http://{leader}:{port}", sock, log_level, serving_token))
