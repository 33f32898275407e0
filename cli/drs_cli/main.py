"""``drs``: every command of the project behind one console script.

Subcommands live beside the code they drive (``drs_devcluster.cli``, ``drs_operator.cli``, …)
and are imported only when invoked, so ``drs engine`` never imports kopf and ``drs frontend``
never imports the Kubernetes client.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

#: name -> "module:attribute" of a click command or group.
SUBCOMMANDS: dict[str, str] = {
    "dev": "drs_devcluster.cli:dev",
    "crd": "drs_operator.cli:crd",
    "plan": "drs_operator.cli:plan",
    "operator": "drs_operator.run:operator",
    "engine": "drs_engine.cli:engine",
    "frontend": "drs_frontend.cli:frontend",
    "sidecar": "drs_sidecar.cli:sidecar",
    "gym-config": "drs_client.cli:gym_config_command",
}

HELP = {
    "dev": "Build and run the local control plane with simulated GPU nodes.",
    "crd": "Print the CustomResourceDefinition generated from the API models.",
    "plan": "Show the engine and frontend layout of a DisaggReplicaSet before applying it.",
    "operator": "Run the DisaggReplicaSet operator.",
    "engine": "Run one engine server (TensorRT-LLM or the sim test double).",
    "frontend": "Run one frontend relay in front of a replica.",
    "sidecar": "Refit every engine of a DisaggReplicaSet for the trainer (runs in the trainer's pod).",
    "gym-config": "Write NeMo-Gym's model-server config for a DisaggReplicaSet (and keep it current).",
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported when first used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = SUBCOMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            return _unavailable(cmd_name, str(exc))
        command: Any = getattr(module, attr)
        if not isinstance(command, click.Command):
            raise TypeError(f"{target} is not a click command")
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, HELP.get(name, "")) for name in self.list_commands(ctx)])


def _unavailable(name: str, why: str) -> click.Command:
    @click.command(name=name, help=HELP.get(name, ""))
    def _cmd() -> None:
        raise click.ClickException(f"`drs {name}` is not available in this installation: {why}")

    return _cmd


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="disagg-replicaset", prog_name="drs")
def main() -> None:
    """DisaggReplicaSet: prefill/decode-disaggregated TensorRT-LLM fleets on Kubernetes."""
