"""On-policy token continuity through real processes: turn n's prompt ids extend turn n−1's prompt +
generated ids, in every turn.

Everything here runs as separate processes, as in a fleet: two ``drs engine --backend sim``
servers (prefill, decode; the sim double draws ids from the whole vocabulary, special tokens
included, so detokenize → retokenize is not the identity) and four ``drs frontend`` processes in
front of them:

* ``incremental``: tokenizes, with the incremental tokenizer only (no shadow runs);
* ``shadowed``: tokenizes, and re-derives every turn the reference way, spliced, and compares;
* ``engine``: does not tokenize: the prefill engine renders the prompt and splices;
* ``retokenize``: tokenizes with ``token_continuity`` off (the behaviour before splicing), which
  shows that the conversations below do break continuity when nothing splices.

The client acts as NeMo-Gym does: it reads ``prompt_token_ids`` / ``generation_token_ids`` off the
answer's message and echoes them back on the assistant message of the next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from drs_protocol.token_prefix import DIVERGENT_LOG
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import metric_value
from .test_frontend_cli import DRS, free_port

VOCAB = 151669  # the Qwen3 tokenizer with its added tokens: the sim draws special tokens too
FRONTENDS = ("incremental", "shadowed", "engine", "retokenize")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]
TEXTS = ["plain words", "naïve café — 数学 😀", "  spaced \n\n out\t", "<think>a literal tag</think>", "x" * 40]


@dataclass
class Fleet:
    urls: dict[str, str]
    logs: dict[str, Any]

    def url(self, name: str) -> str:
        return self.urls[name]


def _wait_ready(url: str, proc: subprocess.Popen[bytes], path: str) -> None:
    deadline = time.monotonic() + 60
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"{proc.args!r} exited with {proc.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if client.get(url + path).status_code == 200:
                    return
            time.sleep(0.05)
    raise AssertionError(f"{url}{path} did not answer 200 within 60 s")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs_dir = tmp_path_factory.mktemp("continuity-logs")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    logs: dict[str, Any] = {}
    urls: dict[str, str] = {}

    def start(name: str, argv: list[str]) -> None:
        log = open(logs_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed at teardown
        logs[name] = log
        procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env))

    try:
        for role in ("prefill", "decode"):
            port = free_port()
            config: dict[str, Any] = {
                "backend": "sim",
                "role": role,
                "host": "127.0.0.1",
                "port": port,
                "model": {"path": "sim-qwen3"},
                "sim": {"speed": 0, "eosProbability": 0.1, "vocabSize": VOCAB},
            }
            start(role, [DRS, "engine", "--config-json", json.dumps(config), "--log-level", "warning"])
            urls[role] = f"http://127.0.0.1:{port}"
            _wait_ready(urls[role], procs[-1], "/health")
        variants: dict[str, dict[str, Any]] = {
            "incremental": {"tokenize": True},
            "shadowed": {"tokenize": True, "tokenize_shadow_rate": 1.0},
            "engine": {"tokenize": False},
            "retokenize": {"tokenize": True, "token_continuity": False},
        }
        for node, (name, extra) in enumerate(variants.items()):
            port = free_port()
            config = {
                "prefill": [urls["prefill"]],
                "decode": [urls["decode"]],
                "host": "127.0.0.1",
                "port": port,
                "node_id": node,
                "health_interval": 0.2,
                **extra,
            }
            start(name, [DRS, "frontend", "--config-json", json.dumps(config)])
            urls[name] = f"http://127.0.0.1:{port}"
            _wait_ready(urls[name], procs[-1], "/ready")
        yield Fleet(urls, logs)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in logs.values():
            log.close()


# -- a NeMo-Gym-shaped client --------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """One conversation: how the client words each turn (drawn by hypothesis)."""

    system: bool
    tools: bool
    thinking: bool | None  #: chat_template_kwargs.enable_thinking (None: left out)
    turns: list[tuple[str, int, int]]  #: (how the reply is sent back, max_tokens, text index)


STYLES = ("plain", "reasoning", "inline_think", "tool_call")


def reply_message(style: str, answer: dict[str, Any], text: str) -> list[dict[str, Any]]:
    """The assistant message (with the ids Gym echoes back) and what comes after it."""
    ids = {k: answer[k] for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")}
    content = answer.get("content") or ""
    if style == "reasoning":  # a reasoning parser moved the text into reasoning_content
        return [{"role": "assistant", "content": text, "reasoning_content": content, **ids}, user(text)]
    if style == "inline_think":  # the template strips an earlier turn's <think> block
        return [{"role": "assistant", "content": f"<think>\n{content}\n</think>\n\n{text}", **ids}, user(text)]
    if style == "tool_call":
        call = {"type": "function", "function": {"name": "search", "arguments": json.dumps({"q": content[:30]})}}
        return [
            {"role": "assistant", "content": content, "tool_calls": [call], **ids},
            {"role": "tool", "content": text},
        ]
    return [{"role": "assistant", "content": content, **ids}, user(text)]


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": f"next: {text}"}


def chat_request(messages: list[dict[str, Any]], session: str, max_tokens: int, plan: Plan) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "sim-qwen3",
        "messages": messages,
        "max_tokens": max_tokens,
        "logprobs": True,
        "top_logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "conversation_params": {"conversation_id": session},
    }
    if plan.tools:
        body["tools"] = TOOLS
    if plan.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": plan.thinking}
    return body


def first_messages(plan: Plan) -> list[dict[str, Any]]:
    system = [{"role": "system", "content": "You are a rollout policy. ✓"}] if plan.system else []
    return [*system, {"role": "user", "content": "Begin."}]


def continuity(previous: list[int] | None, prompt: list[int]) -> bool:
    return previous is None or prompt[: len(previous)] == previous


def run_conversation(client: httpx.Client, url: str, session: str, plan: Plan) -> list[bool]:
    """Every turn of ``plan`` through ``url``; per later turn, did its prompt extend the last?"""
    messages = first_messages(plan)
    previous: list[int] | None = None
    kept: list[bool] = []
    for style, max_tokens, text in plan.turns:
        response = client.post(url + "/v1/chat/completions", json=chat_request(messages, session, max_tokens, plan))
        assert response.status_code == 200, response.text
        answer = response.json()["choices"][0]["message"]
        prompt = answer["prompt_token_ids"]
        if previous is not None:
            kept.append(continuity(previous, prompt))
        previous = prompt + answer["generation_token_ids"]
        messages = messages + reply_message(style, answer, TEXTS[text])
    return kept


turn = st.tuples(st.sampled_from(STYLES), st.integers(1, 24), st.integers(0, len(TEXTS) - 1))
turn_plans = st.integers(1, 100).flatmap(lambda n: st.lists(turn, min_size=n, max_size=n))
plans = st.builds(Plan, st.booleans(), st.booleans(), st.sampled_from([None, True, False]), turn_plans)


@pytest.mark.parametrize("frontend", ["incremental", "shadowed", "engine"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=plans, seed=st.integers(0, 2**32 - 1))
def test_every_turn_extends_the_previous_prompt_and_generated_ids(
    fleet: Fleet, frontend: str, plan: Plan, seed: int
) -> None:
    with httpx.Client(timeout=60) as client:
        kept = run_conversation(client, fleet.url(frontend), f"{frontend}-{seed}-{len(plan.turns)}", plan)
    assert all(kept), f"{kept.count(False)} of {len(kept)} later turns broke continuity"


def test_a_hundred_turn_conversation_keeps_continuity_and_the_shadow_check_agrees(fleet: Fleet) -> None:
    rng = random.Random(7)
    turns = [(rng.choice(STYLES), rng.randint(1, 24), rng.randrange(len(TEXTS))) for _ in range(100)]
    plan = Plan(system=True, tools=True, thinking=None, turns=turns)
    with httpx.Client(timeout=60) as client:
        before = client.get(fleet.url("shadowed") + "/metrics").text
        kept = run_conversation(client, fleet.url("shadowed"), "hundred-turns", plan)
        after = client.get(fleet.url("shadowed") + "/metrics").text
    assert len(kept) == 99 and all(kept)

    def grew(name: str, labels: str) -> float:
        return metric_value(after, name, labels) - metric_value(before, name, labels)

    assert grew("drs_frontend_token_prefix_total", '{outcome="spliced"}') == 99
    # turn 2 reads its prefix's whole text; every later turn only the text after the turn before's
    # (the client writes ids the same way every turn: drs_frontend.tokenization.read_ids)
    assert grew("drs_frontend_token_prefix_read_total", '{how="whole_text"}') == 1
    assert grew("drs_frontend_token_prefix_read_total", '{how="after_last_turn"}') == 98
    assert grew("drs_frontend_tokenize_shadow_total", '{result="match"}') == 100
    assert grew("drs_frontend_tokenize_shadow_total", '{result="mismatch"}') == 0
    assert grew("drs_frontend_tokenize_new_tokens_total", '{path="incremental"}') > 0


def test_without_splicing_the_same_conversations_break_continuity(fleet: Fleet) -> None:
    """The control: re-tokenizing the history (token_continuity off) loses the policy's ids."""
    rng = random.Random(11)
    broken = total = 0
    with httpx.Client(timeout=60) as client:
        for n in range(4):
            turns = [(rng.choice(STYLES), rng.randint(4, 24), rng.randrange(len(TEXTS))) for _ in range(6)]
            kept = run_conversation(client, fleet.url("retokenize"), f"control-{n}", Plan(True, False, None, turns))
            broken += kept.count(False)
            total += len(kept)
    assert broken > 0, f"re-tokenizing kept continuity in all {total} turns: these conversations test nothing"


# -- NeMo-Gym-shaped sessions, concurrently ------------------------------------------------------


async def gym_session(client: httpx.AsyncClient, urls: list[str], session: str, turns: int) -> list[bool]:
    """One trajectory as NeMo-Gym runs it: its frontend picked by sha256(session) % N."""
    url = urls[int.from_bytes(hashlib.sha256(session.encode()).digest()[:8], "big") % len(urls)]
    rng = random.Random(session)
    plan = Plan(system=True, tools=True, thinking=None, turns=[])
    messages = first_messages(plan)
    previous: list[int] | None = None
    kept: list[bool] = []
    for _ in range(turns):
        body = chat_request(messages, session, rng.randint(4, 24), plan)
        response = await client.post(url + "/v1/chat/completions", json=body, headers={"x-session-id": session})
        assert response.status_code == 200, response.text
        answer = response.json()["choices"][0]["message"]
        if previous is not None:
            kept.append(continuity(previous, answer["prompt_token_ids"]))
        previous = answer["prompt_token_ids"] + answer["generation_token_ids"]
        messages = messages + reply_message(rng.choice(STYLES), answer, rng.choice(TEXTS))
    return kept


@pytest.mark.parametrize(
    ("frontends", "want_all"),
    [(["incremental", "shadowed"], True), (["engine"], True), (["retokenize"], False)],
    ids=["frontends tokenize", "engine tokenizes", "no splicing (control)"],
)
def test_gym_shaped_sessions_keep_continuity_in_every_later_turn(
    fleet: Fleet, frontends: list[str], want_all: bool
) -> None:
    """24 sessions × 6 turns at once, ids requested and echoed back as Gym does (issue 14)."""

    async def run() -> list[bool]:
        async with httpx.AsyncClient(timeout=60) as client:
            urls = [fleet.url(f) for f in frontends]
            results = await asyncio.gather(*(gym_session(client, urls, f"gym-{s}", 6) for s in range(24)))
        return [k for session in results for k in session]

    kept = asyncio.run(run())
    print(f"{frontends}: {kept.count(True)} of {len(kept)} later turns extend the previous prompt + generated ids")
    assert len(kept) == 24 * 5
    if want_all:
        assert all(kept), f"{kept.count(False)} of {len(kept)} later turns broke continuity"
    else:
        assert not all(kept)


# -- prefixes that are malformed or do not cover the history -------------------------------------


@pytest.mark.parametrize("frontend", ["incremental", "engine"])
@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"required_prefix_token_ids": "1,2"}, "required_prefix_token_ids"),
        ({"required_prefix_token_ids": [1, "x"]}, "required_prefix_token_ids"),
        ({"required_prefix_token_ids": [1, VOCAB]}, "required_prefix_token_ids"),
        ({"generation_token_ids": [-1]}, "messages[1].generation_token_ids"),
        ({"prompt_token_ids": None}, "messages[1].prompt_token_ids"),
    ],
    ids=["not a list", "not ids", "outside the vocabulary", "a negative id", "prompt ids missing"],
)
def test_a_malformed_prefix_is_a_400_naming_the_field(
    fleet: Fleet, frontend: str, patch: dict[str, Any], param: str
) -> None:
    assistant: dict[str, Any] = {
        "role": "assistant",
        "content": "hi",
        "prompt_token_ids": [1],
        "generation_token_ids": [2],
    }
    body: dict[str, Any] = {"model": "m", "max_tokens": 2, "messages": [user("a"), assistant, user("b")]}
    for key, value in patch.items():
        if key == "required_prefix_token_ids":
            body[key] = value
        elif value is None:
            del assistant[key]
        else:
            assistant[key] = value
    with httpx.Client(timeout=30) as client:
        response = client.post(fleet.url(frontend) + "/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert param in error["message"]
    if frontend == "incremental":
        assert error["param"] == param


@pytest.mark.parametrize("frontend", ["incremental", "engine"])
def test_a_prefix_that_does_not_cover_the_history_is_spliced_logged_and_counted(fleet: Fleet, frontend: str) -> None:
    """As NeMo RL does: the prefix is kept verbatim all the same; never silently."""
    messages = [user("a"), {"role": "assistant", "content": "b"}, user("c")]
    prefix = [9, 8, 7]  # no end-of-turn token, where the history has two before the reply's
    metrics_url = fleet.url("prefill" if frontend == "engine" else frontend) + "/metrics"
    name = "drs_engine_token_prefix_total" if frontend == "engine" else "drs_frontend_token_prefix_total"
    with httpx.Client(timeout=30) as client:
        before = metric_value(client.get(metrics_url).text, name, '{outcome="divergent"}')
        body = {"model": "m", "max_tokens": 2, "messages": messages, "required_prefix_token_ids": prefix}
        response = client.post(fleet.url(frontend) + "/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["prompt_token_ids"][:3] == prefix
        after = metric_value(client.get(metrics_url).text, name, '{outcome="divergent"}')
    assert after == before + 1
    log = fleet.logs["prefill" if frontend == "engine" else frontend]
    log.flush()
    assert DIVERGENT_LOG in Path(log.name).read_text(encoding="utf-8", errors="replace")
