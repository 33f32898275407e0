"""``drs gym-config NAME``: NeMo-Gym's model-server config for a fleet (:mod:`drs_client.gym`).

Without ``--watch`` it writes the config once (to ``-o FILE``, else standard output). With
``--watch`` it keeps ``-o FILE`` (and ``--endpoint-file``) current as the fleet's status changes,
each write an atomic rename; while the fleet has no URLs the endpoint file is removed (Gym keeps
its last clients for ``endpoint_stale_grace_s``). It stops with status 1 when the fleet is deleted.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click

from drs_client.aio import AsyncFleet
from drs_client.errors import DrsClientError
from drs_client.fleet import FleetView, Progress
from drs_client.gym import DEFAULT_API_KEY, endpoint_file_text, gym_config, render, write_atomically


def _say(msg: str) -> None:
    click.echo(f"[drs gym-config] {msg}", err=True)


def _progress(p: Progress) -> None:
    _say(f"phase={p.phase} ready={p.ready_replicas}/{p.replicas} urls={p.urls} {p.message} (after {p.elapsed_s:.0f}s)")


@click.command("gym-config")
@click.argument("name")
@click.option("-n", "--namespace", default="default", show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="write here (default: stdout)")
@click.option("--watch", is_flag=True, help="keep the files current as the fleet changes (needs -o or --endpoint-file)")
@click.option(
    "--endpoint-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="also keep Gym's endpoint_file (one URL: a fleet of one frontend) and name it in the config",
)
@click.option("--wait", "wait_s", type=float, default=0.0, show_default=True, help="seconds to wait until it serves")
@click.option("--api-key", default=DEFAULT_API_KEY, show_default=True, help="policy_api_key (frontends ignore it)")
@click.option(
    "--conversation-id/--no-conversation-id",
    default=True,
    show_default=True,
    help="forward_session_id_as_conversation_id: keep each Gym session on its prefill engine",
)
@click.option(
    "--kubeconfig", type=click.Path(dir_okay=False, path_type=Path), help="default: in-cluster, else $KUBECONFIG"
)
def gym_config_command(
    name: str,
    namespace: str,
    output: Path | None,
    watch: bool,
    endpoint_file: Path | None,
    wait_s: float,
    api_key: str,
    conversation_id: bool,
    kubeconfig: Path | None,
) -> None:
    """Write NeMo-Gym's model-server config (vllm_model, training flags) for DisaggReplicaSet NAME."""
    if watch and output is None and endpoint_file is None:
        raise click.UsageError("--watch keeps files current: give -o FILE and/or --endpoint-file FILE")
    try:
        asyncio.run(_run(name, namespace, output, watch, endpoint_file, wait_s, api_key, conversation_id, kubeconfig))
    except DrsClientError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        sys.exit(130)


async def _run(
    name: str,
    namespace: str,
    output: Path | None,
    watch: bool,
    endpoint_file: Path | None,
    wait_s: float,
    api_key: str,
    conversation_id: bool,
    kubeconfig: Path | None,
) -> None:
    async with await AsyncFleet.connect(name, namespace, kubeconfig=kubeconfig) as fleet:
        if wait_s > 0:
            await fleet.wait_ready(timeout_s=wait_s, progress=_progress, min_ready_replicas=1)
        if not watch:
            _write(await fleet.get(), output, endpoint_file, api_key, conversation_id)
            return
        try:
            async for view in fleet.watch():
                _write(view, output, endpoint_file, api_key, conversation_id, watching=True)
        finally:
            if endpoint_file is not None:
                endpoint_file.unlink(missing_ok=True)


def _write(
    view: FleetView,
    output: Path | None,
    endpoint_file: Path | None,
    api_key: str,
    conversation_id: bool,
    *,
    watching: bool = False,
) -> None:
    if watching and not view.urls:
        if endpoint_file is not None and endpoint_file.exists():
            # said before the unlink: whoever waits for the file to go may stop this process at once
            _say(f"{view.namespace}/{view.name} has no URLs (phase {view.phase}): removing {endpoint_file}")
            endpoint_file.unlink()
        return
    config = gym_config(
        view,
        api_key=api_key,
        conversation_id=conversation_id,
        endpoint_file=None if endpoint_file is None else str(endpoint_file),
    )
    if endpoint_file is not None and write_atomically(endpoint_file, endpoint_file_text(view)):
        _say(f"wrote {endpoint_file}: {endpoint_file_text(view).strip()}")
    text = render(config, view)
    if output is None:
        click.echo(text, nl=False)
    elif write_atomically(output, text):
        _say(
            f"wrote {output}: {len(view.urls)} URL(s), phase {view.phase}, ready {view.ready_replicas}/{view.replicas}"
        )
