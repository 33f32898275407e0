"""NeMo-Gym's model-server config for a fleet (``drs gym-config``), and its endpoint file.

NeMo-Gym 0.7.0 ships ``responses_api_models/vllm_model/configs/vllm_model_for_training.yaml``: the
``vllm_model`` server under ``policy_model.responses_api_models``, its ``base_url``, ``api_key``
and ``model`` taken from the top-level ``policy_base_url``, ``policy_api_key`` and
``policy_model_name`` (OmegaConf interpolations; NeMo RL fills those three), and the training flags
``return_token_id_information: true`` and ``request_prompt_and_generation_token_ids: false``.
:func:`gym_config` writes the same keys with the same interpolations and sets the three values
from the fleet: ``policy_base_url`` is ``status.urls``, each with the OpenAI base path ``/v1`` (a
list: Gym's server picks ``sha256(session) % len(base_url)``, the fleet's own rule; its client posts
to ``base_url + "/chat/completions"``), ``policy_model_name`` the served
model name. It adds ``forward_session_id_as_conversation_id: true`` (a ``VLLMModelConfig`` field
of 0.7.0, off by default there): each Gym session is sent as ``conversation_params`` so the
frontend keeps a conversation on the prefill engine holding its prefix.
``uses_reasoning_parser`` follows ``spec.model.parsers.reasoning``.

Gym 0.7.0's ``endpoint_file`` holds **one** URL (its server reads the file's stripped text as the
single ``base_url`` and rebinds to it when the file's mtime changes; a missing or empty file is
"unpublished", tolerated for ``endpoint_stale_grace_s``). :func:`endpoint_file_text` is that text;
a fleet with more than one URL has no endpoint-file form (``GymConfigError`` says so).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Final

import yaml
from drs_protocol.routes import OPENAI_BASE_PATH

from drs_client.errors import DrsClientError
from drs_client.fleet import FleetView

#: The NeMo-Gym release whose shipped training config this follows.
GYM_VERSION: Final = "0.7.0"
#: Where the model server's config sits in Gym's merged config.
SERVER_PATH: Final = ("policy_model", "responses_api_models", "vllm_model")
#: ``api_key`` Gym sends (the frontends do not check one).
DEFAULT_API_KEY: Final = "drs"


class GymConfigError(DrsClientError):
    """A fleet that cannot be written as the config or endpoint file asked for (names why)."""


def gym_config(
    view: FleetView,
    *,
    api_key: str = DEFAULT_API_KEY,
    conversation_id: bool = True,
    endpoint_file: str | None = None,
) -> dict[str, Any]:
    """Gym's config for ``view``'s fleet (``GymConfigError`` when the status has no URLs yet)."""
    if not view.urls:
        raise GymConfigError(
            f"DisaggReplicaSet {view.namespace}/{view.name} has no status.urls yet (phase {view.phase}): "
            "wait until it serves"
        )
    if not view.model:
        raise GymConfigError(f"DisaggReplicaSet {view.namespace}/{view.name}: spec.model has no path")
    server: dict[str, Any] = {
        "entrypoint": "app.py",
        "base_url": "${policy_base_url}",
        "api_key": "${policy_api_key}",
        "model": "${policy_model_name}",
        "return_token_id_information": True,
        "request_prompt_and_generation_token_ids": False,
        "uses_reasoning_parser": view.reasoning_parser is not None,
        "forward_session_id_as_conversation_id": conversation_id,
    }
    if endpoint_file is not None:
        server["endpoint_file"] = endpoint_file
    return {
        "policy_base_url": base_urls(view),
        "policy_api_key": api_key,
        "policy_model_name": view.model,
        SERVER_PATH[0]: {SERVER_PATH[1]: {SERVER_PATH[2]: server}},
    }


def base_urls(view: FleetView) -> list[str]:
    """Gym's ``base_url`` list: each frontend URL of the status, replica-major, with the OpenAI base
    path (Gym's client posts to ``base_url + "/chat/completions"``)."""
    return [url.rstrip("/") + OPENAI_BASE_PATH for url in view.urls]


def render(config: dict[str, Any], view: FleetView) -> str:
    """The config as YAML, with a header naming the fleet it came from."""
    header = (
        f"# NeMo-Gym {GYM_VERSION} model-server config for DisaggReplicaSet {view.namespace}/{view.name}\n"
        f"# (drs gym-config; {len(view.urls)} frontend URL(s) from status.urls, replica-major)\n"
    )
    return header + yaml.safe_dump(config, sort_keys=False)


def endpoint_file_text(view: FleetView) -> str:
    """What Gym 0.7.0's ``endpoint_file`` holds for this fleet: its one base URL and a newline."""
    if len(view.urls) != 1:
        raise GymConfigError(
            f"DisaggReplicaSet {view.namespace}/{view.name} has {len(view.urls)} URLs; NeMo-Gym {GYM_VERSION}'s "
            "endpoint_file holds one (its server reads the whole file as one base_url): use the config's "
            "base_url list (drs gym-config -o FILE --watch keeps it current)"
        )
    return base_urls(view)[0] + "\n"


def write_atomically(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` by a rename in the same directory (a reader sees the old file or the
    new one, never half); False when the file already holds exactly that."""
    try:
        if path.read_text() == text:
            return False
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True
