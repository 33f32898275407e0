"""A ``trtllm`` engine catches up from a ``trtllm`` peer after a refit with no checkpoint path, on
the strict TensorRT-LLM contract double (real ``drs engine`` processes; see ``test_trtllm_contract``).

The peer keeps the trainer-layout bytes of its collective update (the worker extension's
``retain_to``: TensorRT-LLM's own parameters are fused, not the trainer's layout), streams them,
and the late engine writes the stream to a file and has its workers load it
(``load_weights_from_packed``): same digest, same tokens. What it cannot prove: GPU copies, the
real ``model_loader.reload``, disk speed.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from drs_protocol import env
from drs_protocol.routes import CONTROL_WEIGHTS, CONTROL_WEIGHTS_STREAM
from drs_protocol.weights_state import DesiredWeights

from .test_trtllm_contract import AUTH, chat, log_events, tokens, trtllm_engine

INIT = {"rank_prefix": 0, "ip": "127.0.0.1", "port": 29500, "world_size": 2, "train_world_size": 1}
INFO = {"state_dict_info": {"w": [[64, 32], "bfloat16"], "b": [[32], "torch.float32"]}}


def retain(tmp_path: Path, name: str) -> dict[str, str]:
    return {env.WEIGHTS_RETAIN_DIR: str(tmp_path / f"{name}-kept")}


def collective_refit(url: str, version: str) -> str:
    """Refit the engine at ``url`` over the (double's) collective; the digest it holds after."""
    assert httpx.post(url + "/control/collective/init", json=INIT, headers=AUTH).status_code == 200
    assert httpx.post(url + "/control/collective/prepare", json=INFO, headers=AUTH).status_code == 200
    updated = httpx.post(url + "/control/collective/update", json={"version": version}, headers=AUTH)
    assert updated.status_code == 200, updated.text
    digest: str = httpx.get(url + CONTROL_WEIGHTS, headers=AUTH).json()["weights_digest"]
    return digest


def late_env(tmp_path: Path, name: str, desired: DesiredWeights, peer: str) -> dict[str, str]:
    return {
        **retain(tmp_path, name),
        env.DESIRED_WEIGHTS_JSON: desired.model_dump_json(exclude_none=True),
        env.WEIGHTS_PEERS_JSON: json.dumps([peer]),
    }


def test_a_late_trtllm_engine_catches_up_from_a_peer_after_a_pathless_refit(tmp_path: Path) -> None:
    with trtllm_engine(tmp_path, "a", env=retain(tmp_path, "a")) as peer:
        digest = collective_refit(peer, "v3")
        assert digest is not None
        desired = DesiredWeights(version="v3", digest=digest)
        with trtllm_engine(tmp_path, "b", env=late_env(tmp_path, "b", desired, peer)) as late:
            held = httpx.get(late + CONTROL_WEIGHTS, headers=AUTH).json()
            assert held["weights_version"] == "v3" and held["weights_digest"] == digest
            assert held["catch_up"]["phase"] == "reached" and held["catch_up"]["reached_from"] == peer
            assert tokens(chat(late)) == tokens(chat(peer)), "the peer's bytes: the peer's tokens"
            # and it is a peer in turn: a third engine catches up from the one that caught up
            with trtllm_engine(tmp_path, "c", env=late_env(tmp_path, "c", desired, late)) as third:
                assert httpx.get(third + CONTROL_WEIGHTS, headers=AUTH).json()["weights_digest"] == digest
    loads = [e for e in log_events(tmp_path, "b") if e["event"] == "rpc" and e["method"] == "load_weights_from_packed"]
    assert len(loads) == 1, "the workers loaded the peer's bytes from the file, once"


def test_a_peer_without_a_kept_copy_of_the_weights_it_holds_refuses_to_stream_naming_why(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "model-00001.safetensors").write_bytes(b"weights-v2")
    with trtllm_engine(tmp_path, "a", env=retain(tmp_path, "a")) as url:
        collective_refit(url, "v3")
        assert httpx.get(url + CONTROL_WEIGHTS_STREAM, headers=AUTH).status_code == 200
        loaded = httpx.post(
            url + "/control/weights/load", json={"path": str(checkpoint), "version": "v4"}, headers=AUTH
        )
        assert loaded.status_code == 200, loaded.text
        refused = httpx.get(url + CONTROL_WEIGHTS_STREAM, headers=AUTH)
        assert refused.status_code == 501 and "came from a checkpoint path" in refused.text
        assert not (tmp_path / "a-kept" / "weights.bin").exists(), "the copy of v3 is not kept once v4 serves"
