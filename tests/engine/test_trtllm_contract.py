"""``drs engine --backend trtllm`` end to end against the strict TensorRT-LLM contract double.

Each engine is a real ``drs engine`` process with ``tests/engine/trtllm_contract_double`` (a
package named ``tensorrt_llm`` generated from ``trtllm/surface.json``; a TEST DOUBLE, not
TensorRT-LLM) on ``PYTHONPATH``. What this proves: the backend constructs ``AsyncLLM`` with only
recorded keywords, calls only recorded methods with recorded argument names, reads only recorded
result attributes, calls worker methods that our worker extension really defines with arguments
that bind, checks every worker result, and degrades with named reasons on an older release. What
it cannot prove: anything about real GPUs, kernels, KV transfer or NCCL.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from drs_protocol.chat import default_tokenizer_dir
from drs_protocol.weights_digest import digest_bytes

DOUBLE = Path(__file__).parent / "trtllm_contract_double"
DRS = Path(sys.executable).parent / "drs"
TOKEN = "contract-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
MESSAGES = [{"role": "user", "content": "Count the primes below thirty, then say which is largest."}]


@contextmanager
def trtllm_engine(tmp_path: Path, name: str, *, env: dict[str, str] | None = None, **config: Any) -> Iterator[str]:
    """A ``drs engine --backend trtllm`` process on the contract double; yields its base URL."""
    model = tmp_path / "model"  # one checkpoint: both engines serve the same weights
    model.mkdir(exist_ok=True)
    data = {
        "backend": "trtllm",
        "model": {"path": str(model), "tokenizer": str(default_tokenizer_dir()), "maxModelLen": 4096},
    }
    data.update(config)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    environ = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(DOUBLE), os.environ.get("PYTHONPATH", "")]),
        "DRS_CONTROL_TOKEN": TOKEN,
        "TRTLLM_DOUBLE_LOG": str(tmp_path / f"{name}.log"),
        **(env or {}),
    }
    argv = [str(DRS), "engine", "--config", str(path), "--host", "127.0.0.1", "--port", "0", "--log-level", "warning"]
    process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=environ)
    try:
        assert process.stderr is not None
        line = process.stderr.readline()
        match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        assert match, line + (process.stderr.read() if process.poll() is not None else "")
        url = f"http://127.0.0.1:{match.group(1)}"
        deadline = time.monotonic() + 120
        while not _healthy(url):
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "engine never became healthy"
            time.sleep(0.2)  # polling the health route itself, bounded by the deadline
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - only if shutdown hangs
            process.kill()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def log_events(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / f"{name}.log").read_text().splitlines()]


def chat(url: str, **body: Any) -> httpx.Response:
    payload = {"model": "m", "messages": MESSAGES, "max_tokens": 8, **body}
    return httpx.post(url + "/v1/chat/completions", json=payload, timeout=60)


def tokens(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    ids: list[int] = response.json()["choices"][0]["token_ids"]
    return ids


def test_a_turn_split_over_two_trtllm_engines_gives_the_tokens_of_one_whole_turn(tmp_path: Path) -> None:
    with (
        trtllm_engine(tmp_path, "prefill", role="prefill") as prefill,
        trtllm_engine(tmp_path, "decode", role="decode") as decode,
    ):
        info = httpx.get(prefill + "/server_info").json()
        assert info["backend"] == "trtllm" and info["engine"]["degraded_features"] == {}
        context = chat(
            prefill,
            disaggregated_params={"request_type": "context_only", "disagg_request_id": 2**41 + 5},
            conversation_params={"conversation_id": "conv-1"},
        )
        assert context.status_code == 200, context.text
        choice = context.json()["choices"][0]
        params = choice["disaggregated_params"]
        assert params["ctx_request_id"] == 2**41 + 5
        assert params["ctx_info_endpoint"] == "tcp://127.0.0.1:47001"  # TensorRT-LLM's, never our HTTP URL
        assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 1
        generation = chat(
            decode,
            prompt_token_ids=context.json()["prompt_token_ids"],
            disaggregated_params={**params, "request_type": "generation_only"},
        )
        whole = chat(decode)
        assert tokens(generation) == tokens(whole)
        assert tokens(generation)[0] == params["first_gen_tokens"][0]
        tampered = {
            **params,
            "request_type": "generation_only",
            "first_gen_tokens": [params["first_gen_tokens"][0] + 1],
        }
        assert (
            chat(decode, prompt_token_ids=context.json()["prompt_token_ids"], disaggregated_params=tampered).status_code
            >= 400
        )
    generates = [e for e in log_events(tmp_path, "prefill") if e["event"] == "generate"]
    assert generates[0]["conversation_params"].startswith("ConversationParams(conversation_id='conv-1'")


def test_refit_from_a_path_and_over_the_collective_changes_the_weights_and_false_is_a_failure(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "model-00001.safetensors").write_bytes(b"weights-v2")
    empty = tmp_path / "empty"
    empty.mkdir()
    with trtllm_engine(tmp_path, "e", tensorParallelSize=2) as url:
        before = tokens(chat(url))
        assert httpx.get(url + "/control/weights", headers=AUTH).json()["weights_digest"] is None, "no update yet"
        refused = httpx.post(url + "/control/weights/load", json={"path": str(empty), "version": "bad"}, headers=AUTH)
        # a path the worker extension would refuse is a 400 naming it before any worker is asked
        assert refused.status_code == 400 and "no .safetensors files" in refused.text
        loaded = httpx.post(
            url + "/control/weights/load", json={"path": str(checkpoint), "version": "v2"}, headers=AUTH
        )
        assert loaded.status_code == 200, loaded.text
        # the worker extension's digest of what it handed the engine, every worker agreeing
        assert loaded.json()["weights_digest"] == digest_bytes(b"weights-v2")
        after_load = tokens(chat(url))
        assert after_load != before
        early = httpx.post(url + "/control/collective/update", json={"version": "v3"}, headers=AUTH)
        assert early.status_code >= 400 and "returned False on worker rank(s) [0, 1]" in early.text
        init = {"rank_prefix": 2, "ip": "127.0.0.1", "port": 29500, "world_size": 6, "train_world_size": 2}
        assert httpx.post(url + "/control/collective/init", json=init, headers=AUTH).status_code == 200
        bad = httpx.post(
            url + "/control/collective/prepare", json={"state_dict_info": {"w": [[2, 2], "fp7"]}}, headers=AUTH
        )
        assert bad.status_code == 400 and "state_dict_info['w']" in bad.text
        info = {"state_dict_info": {"w": [[2, 2], "bfloat16"], "b": [[2], "torch.float32"]}}
        assert httpx.post(url + "/control/collective/prepare", json=info, headers=AUTH).status_code == 200
        updated = httpx.post(url + "/control/collective/update", json={"version": "v3"}, headers=AUTH)
        assert updated.status_code == 200, updated.text
        assert tokens(chat(url)) not in (before, after_load)
        assert httpx.get(url + "/control/weights", headers=AUTH).json()["weights_version"] == "v3"
    rpcs = [e["method"] for e in log_events(tmp_path, "e") if e["event"] == "rpc"]
    assert rpcs.count("reset_prefix_cache") >= 2  # after the load and after the collective update


def test_sleep_resets_the_prefix_cache_then_releases_every_tag_and_wake_resumes(tmp_path: Path) -> None:
    with trtllm_engine(tmp_path, "e") as url:
        assert tokens(chat(url))
        unknown = httpx.post(url + "/control/memory/release", json={"tags": ["gpu_soul"]}, headers=AUTH)
        assert unknown.status_code == 400 and "gpu_soul" in unknown.text
        released = httpx.post(url + "/control/memory/release", json={"tags": []}, headers=AUTH)
        assert released.status_code == 200, released.text
        tags = released.json()["result"]["released"]
        assert tags[-1] == "kv_cache" and "model" in tags and not any(t.startswith("_") for t in tags)
        assert chat(url).status_code == 503
        assert httpx.post(url + "/control/memory/resume", json={"tags": []}, headers=AUTH).status_code == 200
        assert tokens(chat(url))
    events = [e for e in log_events(tmp_path, "e") if e["event"] in ("rpc", "init")]
    assert "sleep_config" in events[0]["kwargs"] and "max_input_len" in events[0]["kwargs"]
    methods = [e["method"] for e in events[1:]]
    sleep_at = methods.index("sleep")
    assert methods[sleep_at - 1] == "reset_prefix_cache"
    assert methods[sleep_at + 1] == "wakeup"


def test_on_an_older_release_missing_features_degrade_with_named_reasons(tmp_path: Path) -> None:
    with trtllm_engine(tmp_path, "old", env={"TRTLLM_DOUBLE_RELEASE": "older"}) as url:
        degraded = httpx.get(url + "/server_info").json()["engine"]["degraded_features"]
        assert set(degraded) == {"conversation_params_unsupported", "ctx_usage_unsupported", "sleep_config_unavailable"}
        usage = {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}
        context = chat(
            url, disaggregated_params={"request_type": "context_only"}, conversation_params={"conversation_id": "c"}
        )
        params = context.json()["choices"][0]["disaggregated_params"]
        generation = chat(
            url,
            prompt_token_ids=context.json()["prompt_token_ids"],
            disaggregated_params={**params, "request_type": "generation_only", "ctx_usage": usage},
        )
        assert generation.status_code == 200, generation.text
        assert httpx.post(url + "/control/memory/release", json={"tags": []}, headers=AUTH).status_code == 501


def test_a_prompt_over_trtllms_token_budget_is_a_400_context_length_exceeded(tmp_path: Path) -> None:
    with trtllm_engine(tmp_path, "small", maxNumTokens=16) as url:
        refused = chat(url, messages=[{"role": "user", "content": "word " * 64}])
        assert refused.status_code == 400
        assert refused.json()["error"]["message"].startswith("context length exceeded: The sum of prompt length")
        assert tokens(chat(url, messages=[{"role": "user", "content": "hi"}]))
