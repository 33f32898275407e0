"""Refit safety on the ``trtllm`` backend, against the strict TensorRT-LLM contract double.

A generation leg that decodes across a weights update (a load, or the collective update) is
submitted again over its prompt plus the tokens it has passed on, so every token after
``weights_boundary`` is what the new weights produce over that context. The double models what
TensorRT-LLM does with a request in flight across an update: its later steps run the new weights
over KV of the old ones (tokens neither weights would give). Real ``drs engine`` processes (see
``test_trtllm_contract``); the double streams one step per ``TRTLLM_DOUBLE_STEP_S``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from drs_protocol.fields import HEADER_WEIGHTS_VERSION
from drs_protocol.lifecycle import FIELD_WEIGHTS_BOUNDARY, FIELD_WEIGHTS_VERSION

from .test_protocol import PROMPT_IDS
from .test_trtllm_contract import AUTH, log_events, trtllm_engine

MAX_TOKENS = 150
#: Seconds per streamed step: 150 steps leave the control call seconds to land mid-leg.
STEP_S = "0.02"
#: The load lands after this many tokens reached the client.
LOAD_AFTER = 5
COLLECTIVE_INIT = {"rank_prefix": 1, "ip": "127.0.0.1", "port": 29500, "world_size": 2, "train_world_size": 1}
STATE_DICT_INFO = {"state_dict_info": {"w": [[2, 2], "bfloat16"]}}


def completion(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}


def context_then_generation(url: str) -> dict[str, Any]:
    """A context leg on ``url``; the generation leg's body (streamed) that continues it there."""
    context = httpx.post(
        url + "/v1/completions",
        json=completion(PROMPT_IDS, 1, disaggregated_params={"request_type": "context_only"}),
        timeout=60,
    )
    assert context.status_code == 200, context.text
    params = {**context.json()["choices"][0]["disaggregated_params"], "request_type": "generation_only"}
    return completion(PROMPT_IDS, MAX_TOKENS, stream=True, disaggregated_params=params)


def stream_across(url: str, body: dict[str, Any], route: str, payload: dict[str, Any]) -> list[Any]:
    """The leg's SSE events, and the answer to ``payload`` posted to ``route`` once ``LOAD_AFTER``
    tokens came (last in the list)."""
    events: list[Any] = []
    answer: httpx.Response | None = None
    with httpx.Client(timeout=60) as client, client.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers[HEADER_WEIGHTS_VERSION] == "0"  # the weights the leg started under
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[len("data: ") :]))
            if answer is None and len(tokens_of(events)) >= LOAD_AFTER:
                answer = client.post(url + route, json=payload, headers=AUTH)
    assert answer is not None, "the leg ended before the update was posted"
    return [*events, answer]


def tokens_of(events: list[Any]) -> list[int]:
    return [t for e in events if isinstance(e, dict) and e.get("choices") for t in e["choices"][0]["token_ids"]]


@pytest.mark.parametrize("how", ["load", "collective"])
def test_a_generation_leg_decoding_across_an_update_resumes_only_with_the_new_weights_tokens(
    tmp_path: Path, how: str
) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "model-00001.safetensors").write_bytes(b"weights-v2")
    with trtllm_engine(tmp_path, "e", env={"TRTLLM_DOUBLE_STEP_S": STEP_S}) as url:
        payload: dict[str, Any]
        if how == "load":
            route, payload = "/control/weights/load", {"path": str(checkpoint), "version": "v2"}
        else:
            for route, payload in (("init", COLLECTIVE_INIT), ("prepare", STATE_DICT_INFO)):
                answer = httpx.post(url + f"/control/collective/{route}", json=payload, headers=AUTH, timeout=60)
                assert answer.status_code == 200, answer.text
            route, payload = "/control/collective/update", {"version": "v2"}
        *events, answer = stream_across(url, context_then_generation(url), route, payload)
        assert answer.status_code == 200, answer.text
        tokens, last = tokens_of(events), events[-1]
        assert len(tokens) == MAX_TOKENS
        assert last[FIELD_WEIGHTS_VERSION] == "v2"
        boundary = last[FIELD_WEIGHTS_BOUNDARY]
        assert LOAD_AFTER <= boundary < MAX_TOKENS
        # what the new weights give over the prompt plus the tokens before the boundary
        resumed = httpx.post(
            url + "/v1/completions",
            json=completion([*PROMPT_IDS, *tokens[:boundary]], MAX_TOKENS - boundary),
            timeout=60,
        )
        assert resumed.status_code == 200, resumed.text
        assert resumed.headers[HEADER_WEIGHTS_VERSION] == "v2"
    assert tokens[boundary:] == resumed.json()["choices"][0]["token_ids"]
    generates = [e for e in log_events(tmp_path, "e") if e["event"] == "generate"]
    # context leg, generation leg, its resubmission as a plain request, and the check's request
    assert [g["request_type"] for g in generates] == ["context_only", "generation_only", None, None]


def test_a_refused_path_interrupts_no_leg(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with trtllm_engine(tmp_path, "e", env={"TRTLLM_DOUBLE_STEP_S": STEP_S}) as url:
        body = context_then_generation(url)
        bad = {"path": str(empty), "version": "v2"}
        *events, refused = stream_across(url, body, "/control/weights/load", bad)
        assert refused.status_code == 400 and "no .safetensors files" in refused.text
        assert refused.json()["error"]["param"] == "path"
        assert FIELD_WEIGHTS_BOUNDARY not in events[-1] and events[-1][FIELD_WEIGHTS_VERSION] == "0"
        uninterrupted = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=60)
    assert tokens_of(events) == uninterrupted.json()["choices"][0]["token_ids"]
    rpcs = [e["method"] for e in log_events(tmp_path, "e") if e["event"] == "rpc"]
    assert "load_weights_from_path" not in rpcs  # refused before any worker was asked
