"""``drs gym-config``'s output is NeMo-Gym 0.7.0's training model-server config, as Gym loads it.

``SHIPPED`` is what NeMo-Gym 0.7.0 (PyPI ``nemo-gym==0.7.0``) ships as
``responses_api_models/vllm_model/configs/vllm_model_for_training.yaml``: the server's keys under
``policy_model.responses_api_models.vllm_model`` with their values (interpolations of the
top-level ``policy_*`` keys NeMo RL fills, and the training flags), read from that wheel. The
written config is loaded with OmegaConf, as Gym's config parser does, and resolved.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from drs_client.fleet import FleetView
from drs_client.gym import SERVER_PATH, GymConfigError, endpoint_file_text, gym_config, render, write_atomically
from omegaconf import OmegaConf

#: NeMo-Gym 0.7.0's vllm_model_for_training.yaml, key by key (value as shipped).
SHIPPED: dict[str, Any] = {
    "entrypoint": "app.py",
    "base_url": "${policy_base_url}",
    "api_key": "${policy_api_key}",
    "model": "${policy_model_name}",
    "return_token_id_information": True,
    "request_prompt_and_generation_token_ids": False,
    "uses_reasoning_parser": True,
}
#: Fields of Gym 0.7.0's VLLMModelConfig (responses_api_models/vllm_model/app.py) we may add, with their types.
ALSO_GYM_FIELDS: dict[str, type] = {"forward_session_id_as_conversation_id": bool, "endpoint_file": str}
#: VLLMModelConfig's types of the shipped keys once resolved (base_url: Union[str, List[str]]).
RESOLVED_TYPES: dict[str, tuple[type, ...]] = {
    "entrypoint": (str,),
    "base_url": (str, list),
    "api_key": (str,),
    "model": (str,),
    "return_token_id_information": (bool,),
    "request_prompt_and_generation_token_ids": (bool,),
    "uses_reasoning_parser": (bool,),
}


def view(urls: tuple[str, ...] = ("http://f0:8300", "http://f1:8301"), reasoning: str | None = "qwen3") -> FleetView:
    return FleetView(
        namespace="rl",
        name="pol",
        generation=1,
        observed_generation=1,
        phase="Ready",
        replicas=2,
        ready_replicas=2,
        updated_replicas=2,
        urls=urls,
        engines=(),
        weights_version=None,
        message="",
        model="policy",
        reasoning_parser=reasoning,
    )


def server_of(config: Any) -> Any:
    for key in SERVER_PATH:
        config = config[key]
    return config


def test_the_config_has_the_shipped_keys_and_values_and_resolves_to_the_status_urls(tmp_path: Path) -> None:
    path = tmp_path / "gym.yaml"
    path.write_text(render(gym_config(view()), view()))
    loaded = OmegaConf.load(path)
    raw = server_of(OmegaConf.to_container(loaded, resolve=False))
    assert {k: raw[k] for k in SHIPPED} == SHIPPED
    assert set(raw) - set(SHIPPED) <= set(ALSO_GYM_FIELDS)
    resolved = server_of(OmegaConf.to_container(loaded, resolve=True))
    for key, types in RESOLVED_TYPES.items():
        assert isinstance(resolved[key], types), (key, resolved[key])
    for key, type_ in ALSO_GYM_FIELDS.items():
        assert key not in resolved or isinstance(resolved[key], type_)
    # replica-major, as the status lists them, each with the path Gym's OpenAI client posts below
    assert resolved["base_url"] == ["http://f0:8300/v1", "http://f1:8301/v1"]
    assert (resolved["model"], resolved["api_key"]) == ("policy", "drs")
    assert resolved["forward_session_id_as_conversation_id"] is True


def test_a_fleet_without_a_reasoning_parser_tells_gym_not_to_expect_one() -> None:
    assert server_of(gym_config(view(reasoning=None)))["uses_reasoning_parser"] is False


def test_a_fleet_without_urls_has_no_config_yet() -> None:
    with pytest.raises(GymConfigError, match=r"rl/pol has no status.urls yet \(phase Ready\)"):
        gym_config(view(urls=()))


def test_gyms_endpoint_file_holds_one_url_so_a_wider_fleet_is_refused_with_why() -> None:
    assert endpoint_file_text(view(urls=("http://f0:8300",))) == "http://f0:8300/v1\n"
    with pytest.raises(GymConfigError, match=r"has 2 URLs; NeMo-Gym 0\.7\.0's endpoint_file holds one"):
        endpoint_file_text(view())


def test_files_are_replaced_by_a_rename_and_an_unchanged_text_is_not_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "gym.yaml"
    assert write_atomically(path, "a: 1\n")
    inode = path.stat().st_ino
    assert not write_atomically(path, "a: 1\n") and path.stat().st_ino == inode
    assert write_atomically(path, "a: 2\n") and path.stat().st_ino != inode
    assert yaml.safe_load(path.read_text()) == {"a": 2}
    assert os.listdir(path.parent) == ["gym.yaml"], "no temporary file left behind"


def test_the_command_needs_a_file_to_keep_current_when_watching() -> None:
    from click.testing import CliRunner
    from drs_cli.main import main as drs

    result = CliRunner().invoke(drs, ["gym-config", "pol", "--watch"])
    assert result.exit_code == 2 and "give -o FILE and/or --endpoint-file FILE" in result.output
    assert "gym-config" in CliRunner().invoke(drs, ["--help"]).output


def test_every_openai_route_is_below_the_base_path_gyms_base_url_ends_with() -> None:
    from drs_protocol.routes import OPENAI_BASE_PATH, Endpoint

    assert all(e.value.startswith(OPENAI_BASE_PATH + "/") for e in Endpoint)
