"""Start one NeMo-Gym server the way ``gym env start`` (``nemo_gym.cli.env.RunHelper``) starts it.

Run with ``.venv-gym``'s interpreter: ``python gym_launch.py SERVER_KEY OVERRIDE...``, the overrides
in Gym's own command-line syntax (Hydra: ``+config_paths=[...]``, ``++a.b=c``). Gym's own config
parser (``GlobalConfigDictParser``) resolves them with the YAML files they name, as it does for
``gym env start``; then, as ``RunHelper._start`` does for each server, the process becomes the
server's entrypoint, run by this interpreter in the server's folder, with the resolved config in
``NEMO_GYM_CONFIG_DICT`` and the server's key in ``NEMO_GYM_CONFIG_PATH``. Left out: Ray and the
head server, which ``RunHelper`` starts for servers that use them (``vllm_model`` uses neither:
``ray_enabled = False``), and the per-server ``uv`` venv (``.venv-gym`` is that venv).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from nemo_gym.global_config import (
    NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME,
    NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME,
    GlobalConfigDictParser,
    GlobalConfigDictParserConfig,
)
from omegaconf import OmegaConf


def main() -> None:
    server_key = sys.argv.pop(1)  # what is left of argv is Gym's command line, as Hydra reads it
    config = GlobalConfigDictParser().parse(GlobalConfigDictParserConfig(skip_load_from_dotenv=True))
    (server_type,) = config[server_key]
    (server_name,) = config[server_key][server_type]
    server = config[server_key][server_type][server_name]
    package = importlib.import_module(f"{server_type}.{server_name}")
    folder = Path(package.__file__).parent  # type: ignore[arg-type]
    env = {
        **os.environ,
        NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME: OmegaConf.to_yaml(config),
        NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME: server_key,
    }
    print(f"[gym_launch] {server_key}: {server_type}/{server_name} on {server.host}:{server.port}", flush=True)
    os.chdir(folder)
    os.execve(sys.executable, [sys.executable, str(server.entrypoint)], env)


if __name__ == "__main__":
    main()
