"""The Gym pod of `make demo` and tests/realnodes (``inpod.gym_objects``), as objects: its init
container's command is a ``drs gym-config`` command line the CLI accepts, writing the file the
main container (the drs-gym image) reads, through a volume they share; the Role lets the init
container wait on the fleet (``watch``); and ``drs dev images --no-gym`` is an option."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner
from drs_client.cli import gym_config_command
from drs_devcluster import images, inpod
from drs_devcluster.cli import dev


def objects() -> dict[str, Any]:
    objs = inpod.gym_objects("gym-rollouts", "rl", "pod-sim", "print('agent')", ["--block-tokens", "16"])
    return {o["kind"]: o for o in objs}


def test_the_init_container_writes_with_drs_gym_config_what_the_gym_container_reads() -> None:
    pod = objects()["Pod"]["spec"]
    (init,) = pod["initContainers"]
    (gym,) = pod["containers"]
    assert init["image"] == images.image_ref() and gym["image"] == images.gym_ref()
    assert init["command"][:3] == ["drs", "gym-config", "pod-sim"]
    args = init["command"][2:]
    ctx = gym_config_command.make_context("gym-config", list(args))  # the CLI accepts it
    assert ctx.params["namespace"] == "rl" and str(ctx.params["output"]) == inpod.GYM_CONFIG_FILE
    assert ctx.params["wait_s"] > 0
    assert gym["command"][:4] == ["python", "/client/client.py", "--config", inpod.GYM_CONFIG_FILE]
    assert gym["command"][4:] == ["--block-tokens", "16"]
    mounts = {m["name"]: m for m in gym["volumeMounts"]}
    (written,) = [m for m in init["volumeMounts"] if m["mountPath"] == inpod.GYM_CONFIG_DIR]
    assert mounts[written["name"]]["mountPath"] == inpod.GYM_CONFIG_DIR and mounts[written["name"]]["readOnly"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[written["name"]] and "emptyDir" in volumes[mounts["tmp"]["name"]]
    assert gym["securityContext"]["readOnlyRootFilesystem"] is True  # Gym writes only into /tmp


def test_the_role_allows_reading_and_watching_the_fleet_and_nothing_else() -> None:
    (rule,) = objects()["Role"]["rules"]
    assert rule == {"apiGroups": ["disagg.dev"], "resources": ["disaggreplicasets"], "verbs": ["get", "list", "watch"]}


@pytest.mark.parametrize("flag", ["--no-gym", "--force"])
def test_drs_dev_images_takes(flag: str) -> None:
    result = CliRunner().invoke(dev, ["images", "--help"])
    assert result.exit_code == 0 and flag in result.output


def test_the_pod_goes_to_the_node_named_when_one_is() -> None:
    objs = inpod.gym_objects("g", "rl", "pod-sim", "", [], node="real-000")
    pod = next(o for o in objs if o["kind"] == "Pod")
    assert pod["spec"]["nodeSelector"][inpod.HOSTNAME_LABEL] == "real-000"
    assert inpod.HOSTNAME_LABEL not in objects()["Pod"]["spec"]["nodeSelector"]
