"""``drs gym-config``'s output through NeMo-Gym 0.7.0 itself: its config parser
(``GlobalConfigDictParser``, over ``+config_paths=[FILE]`` as ``gym env start`` takes them) and its
``vllm_model`` server's config model (``VLLMModelConfig``). Runs with Gym's own venv, ``.venv-gym``
(NeMo-Gym's test venv, ``make gym-install``; Gym is not a dependency of this project)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from drs_client.fleet import FleetView
from drs_client.gym import gym_config, render

ROOT = Path(__file__).resolve().parents[2]
GYM_PYTHON = ROOT / ".venv-gym" / "bin" / "python"

PARSE = """
import json
from nemo_gym.global_config import GlobalConfigDictParser, GlobalConfigDictParserConfig
from omegaconf import OmegaConf
from responses_api_models.vllm_model.app import VLLMModelConfig

config = GlobalConfigDictParser().parse(GlobalConfigDictParserConfig(skip_load_from_dotenv=True))
server = OmegaConf.to_container(config["policy_model"]["responses_api_models"]["vllm_model"], resolve=True)
model = VLLMModelConfig.model_validate({**server, "name": "vllm_model"})
print(json.dumps(model.model_dump(mode="json")))
"""


@pytest.mark.skipif(not GYM_PYTHON.exists(), reason="needs NeMo-Gym's venv .venv-gym (make gym-install)")
def test_gyms_own_parser_and_server_config_take_the_written_config(tmp_path: Path) -> None:
    view = FleetView(
        namespace="rl",
        name="pol",
        generation=1,
        observed_generation=1,
        phase="Ready",
        replicas=2,
        ready_replicas=2,
        updated_replicas=2,
        urls=("http://pol-r0-f0.rl.svc:8300", "http://pol-r1-f0.rl.svc:8301"),
        engines=(),
        weights_version=None,
        message="",
        model="policy",
        reasoning_parser="qwen3",
    )
    path = tmp_path / "gym_policy.yaml"
    path.write_text(render(gym_config(view), view))
    result = subprocess.run(
        [str(GYM_PYTHON), "-c", PARSE, f"+config_paths=[{path}]"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    model = json.loads(result.stdout.strip().splitlines()[-1])
    assert model["base_url"] == ["http://pol-r0-f0.rl.svc:8300/v1", "http://pol-r1-f0.rl.svc:8301/v1"]
    assert (model["model"], model["api_key"]) == ("policy", "drs")
    assert model["return_token_id_information"] is True
    assert model["request_prompt_and_generation_token_ids"] is False
    assert model["uses_reasoning_parser"] is True
    assert model["forward_session_id_as_conversation_id"] is True
