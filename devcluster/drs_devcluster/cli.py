"""``drs dev``: build, start, inspect and stop the local control plane."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from . import build, profiles
from .cluster import DevCluster, DevClusterError
from .processes import PortInUseError

_state_dir = click.option(
    "--state-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Where the cluster keeps its files (default $DRS_DEV_STATE_DIR or ~/.cache/drs/dev).",
)
_port_base = click.option(
    "--port-base", type=click.IntRange(1024, 65000), default=None, help="First of the 127.0.0.1 ports it uses."
)


@click.group()
def dev() -> None:
    """Build and run the local control plane with simulated GPU nodes."""


@dev.command("build")
@click.option("--force", is_flag=True, help="Rebuild even when the cached binaries exist.")
def build_cmd(force: bool) -> None:
    """Compile etcd, kube-apiserver, kube-scheduler, kube-controller-manager, kubectl, kwok and helm."""
    try:
        bins = build.ensure_built(force=force)
    except build.BuildError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(str(bins))


@dev.command("images")
@click.option("--force", is_flag=True, help="Rebuild even when this source tree's images are cached.")
@click.option("--no-gym", is_flag=True, help="Skip the NeMo-Gym image (drs-gym, the Dockerfile's gym target).")
def images_cmd(force: bool, no_gym: bool) -> None:
    """Build the project's image (the top-level Dockerfile), the sandbox image and the NeMo-Gym
    image (its gym target), with no registry."""
    from . import images

    try:
        archives = images.ensure_all(force=force, gym=not no_gym)
    except images.ImageError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"{images.image_ref()} and {images.pause_ref()}: {archives[0]}")
    if not no_gym:
        click.echo(f"{images.gym_ref()}: {archives[1]}")


@dev.command("up")
@click.option("--profile", default="hgx", show_default=True, help=f"Node profile: {', '.join(profiles.PROFILES)}.")
@click.option("--nodes", "node_count", type=int, default=None, help="Number of simulated nodes (default per profile).")
@click.option(
    "--real-nodes",
    type=int,
    default=0,
    show_default=True,
    help="Real nodes (kubelet + containerd + CNI + kube-proxy, the project's image imported) beside "
    "the simulated ones; with --nodes 0, only real nodes. Needs root.",
)
@_state_dir
@_port_base
def up(profile: str, node_count: int | None, real_nodes: int, state_dir: Path | None, port_base: int | None) -> None:
    """Start etcd, apiserver, controller-manager, scheduler and kwok; create simulated GPU nodes."""
    from . import hostnet, images, nodeconfig, packages, realnodes

    cluster = DevCluster.at(state_dir, port_base)
    try:
        cluster.up(profile, node_count, real_nodes=real_nodes)
    except (
        profiles.ProfileError,
        DevClusterError,
        PortInUseError,
        build.BuildError,
        nodeconfig.RealNodeError,
        images.ImageError,
        packages.PackageError,
        hostnet.HostError,
        realnodes.RealNodeStartError,
    ) as exc:
        raise click.ClickException(str(exc)) from exc
    lay = cluster.layout
    click.echo(f"kubeconfig: {lay.kubeconfig}")
    click.echo(f"export KUBECONFIG={lay.kubeconfig}")
    click.echo(f"export PATH={lay.bin_dir}:$PATH   # kubectl {build.KUBERNETES_VERSION} and helm")


@dev.command("down")
@_state_dir
def down(state_dir: Path | None) -> None:
    """Stop every process of the dev cluster and remove its state."""
    stopped = DevCluster.at(state_dir).down()
    click.echo(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")


@dev.command("status")
@_state_dir
@click.option("-o", "output", type=click.Choice(["text", "json"]), default="text")
def status(state_dir: Path | None, output: str) -> None:
    """Say what runs."""
    info = DevCluster.at(state_dir).status()
    if output == "json":
        click.echo(json.dumps(info, indent=2))
        return
    comps = info["components"]
    if not comps:
        click.echo(f"no dev cluster in {info['stateDir']}")
        sys.exit(1)
    for name, c in comps.items():
        click.echo(f"{name:<26} pid {c['pid']:<8} {'running' if c['running'] else 'NOT RUNNING'}  {c['log']}")
    real = info.get("realNodes", {})
    if real:
        click.echo("real nodes:")
    for name, c in real.items():
        state = c["state"] if c["running"] else "NOT RUNNING"
        click.echo(f"  {name:<24} pid {c['pid']:<8} {state:<12} {c['log']}")
    if "nodes" in info:
        click.echo(f"nodes: {info['nodes']}")
        click.echo(f"export KUBECONFIG={info['kubeconfig']}")
    if not all(c["running"] for c in [*comps.values(), *real.values()]):
        sys.exit(1)


@dev.command("kubectl", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@_state_dir
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def kubectl(state_dir: Path | None, args: tuple[str, ...]) -> None:
    """Run the cluster's own kubectl (the apiserver's version) against the dev cluster."""
    cluster = DevCluster.at(state_dir)
    binary = build.bin_dir() / "kubectl"
    os.execve(str(binary), [str(binary), *args], {**os.environ, "KUBECONFIG": str(cluster.layout.kubeconfig)})


@dev.command("run-pods")
@_state_dir
@click.option("--foreground", is_flag=True, help="Run in this terminal; Ctrl-C stops it and its processes.")
def run_pods(state_dir: Path | None, foreground: bool) -> None:
    """Run the `drs` containers of hostNetwork pods on simulated nodes as local processes."""
    from .runner import run_foreground
    from .runner_daemon import start_runner

    cluster = DevCluster.at(state_dir)
    try:
        if foreground:
            sys.exit(run_foreground(cluster))
        tracked = start_runner(cluster)
    except DevClusterError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"pod runner watching (pid {tracked.pid}); log: {tracked.log}")


@dev.command("echo-server", hidden=True)
@click.option("--host", required=True, help="Address to bind (a node's loopback address).")
@click.option("--port", type=click.IntRange(1, 65535), required=True)
@click.option("--health-status", type=int, default=200, show_default=True, help="What GET /health answers.")
@click.option("--exit-after", type=float, default=None, help="Exit on its own after this many seconds.")
@click.option("--exit-code", type=int, default=3, show_default=True, help="The exit code of --exit-after.")
def echo_server(host: str, port: int, health_status: int, exit_after: float | None, exit_code: int) -> None:
    """A tiny HTTP server for tests of the pod runner (a test double)."""
    from .echo_server import serve

    sys.exit(serve(host, port, health_status, exit_after, exit_code))


if __name__ == "__main__":  # the detached pod runner: python -m drs_devcluster.cli run-pods --foreground
    dev()
