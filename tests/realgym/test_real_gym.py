"""The real NeMo-Gym drives the fleet: Gym 0.7.0's own ``responses_api_models/vllm_model`` server,
unchanged, started as Gym starts it (its config parser, its shipped ``vllm_model_for_training.yaml``;
``gym_launch.py``) in ``.venv-gym`` (``make gym-install``), with ``base_url`` = the frontends' URLs
(+ ``/v1``), in front of real frontends and sim engines (servers on sockets in the test's event
loop, as tests/frontend's fixtures run them; Gym's server is its own process).

Each case is a fleet of two replicas, each two prefill engines and one decode engine, with F
frontends per replica (tokenizing or not); the URL list the Gym server gets is replica-major, as
``status.urls`` is. Each of the eight cases (F = 1 and 2 × tokenizing or not ×
``forward_session_id_as_conversation_id`` or not) starts its own Gym server and runs
six sessions of four turns at once, through an agent loop as Gym's ``simple_agent`` runs one
(``POST /v1/responses`` with the session's cookie, the output appended to the input, a tool's
output after each function call). The sim double's replies are random tokens, never a tool call, so
the loop acts on each reply as the call ``search(q=...)`` it stands for: it appends that
``function_call`` item and the tool's ``function_call_output``, as ``simple_agent`` appends them,
and the next request carries the tool-calling history (the assistant message with its ids and
``tool_calls``, then the ``tool`` message).

Checked per Gym server: every turn 200; the ids and log-probs Gym extracts (on its output items)
equal what our frontend answered (Gym's transport log, ``NEMO_GYM_VLLM_TRANSPORT_LOG``, holds our
answer as it arrived) and the log-prob tokens are ``token_id:N`` of those ids; each turn's prompt
ids begin with the previous turn's prompt + generated ids (token continuity); each session's turns
all reached the frontend ``sha256(session) % len(urls)`` picks (Gym's session id read from its
session cookie; the frontends' request counters); and each
later turn was a prefix-cache hit on the prefill engine of the turn before
(``usage.input_tokens_details.cached_tokens`` covers every full block of the previous prompt, which
only the engine that prefilled it holds), with the conversation id forwarded or not.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import random
import socket
import subprocess
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from drs_engine.config import EngineConfig, build_config
from drs_engine.server.runner import start_engine
from drs_frontend.app import FrontendApp
from drs_frontend.config import FrontendConfig
from drs_frontend.server import start_frontend
from drs_protocol import fields
from drs_protocol.engine_config import SIM_DEFAULT_TOKENS_PER_BLOCK

ROOT = Path(__file__).resolve().parents[2]
GYM_PYTHON = ROOT / ".venv-gym" / "bin" / "python"
LAUNCH = Path(__file__).with_name("gym_launch.py")
MODEL = "sim-qwen3"
REPLICAS = 2
SESSIONS = 6
TURNS = 4
TOOLS = [
    {
        "type": "function",
        "name": "search",
        "description": "Search the notes",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        "strict": False,
    }
]
#: Gym's session id lives in Starlette's signed session cookie.
SESSION_KEY = "session_id"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def training_yaml() -> Path:
    """Gym's shipped training config, where ``.venv-gym`` installed it."""
    if not GYM_PYTHON.exists():
        raise AssertionError(f"{GYM_PYTHON} is missing: `make gym-install` builds NeMo-Gym's venv (`make test` does)")
    code = "import os, responses_api_models.vllm_model as m; print(os.path.dirname(m.__file__))"
    folder = subprocess.run([str(GYM_PYTHON), "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    path = Path(folder) / "configs" / "vllm_model_for_training.yaml"
    assert path.is_file(), path
    return path


def engine_config(role: str) -> EngineConfig:
    return build_config(
        {
            "backend": "sim",
            "role": role,
            "host": "127.0.0.1",
            "port": 0,
            "model": {"path": MODEL},
            "sim": {"speed": 0, "eosProbability": 0.05},
        }
    )


@contextlib.asynccontextmanager
async def fleet(frontends: int, tokenize: bool) -> AsyncIterator[list[str]]:
    """Two replicas of two prefill and one decode engine, ``frontends`` per replica: their URLs,
    replica-major (``status.urls``' order). Real servers in this event loop, as tests/frontend's."""
    async with contextlib.AsyncExitStack() as stack:
        urls: list[str] = []
        for r in range(REPLICAS):
            prefill = [await stack.enter_async_context(start_engine(engine_config("prefill"))) for _ in range(2)]
            decode = [await stack.enter_async_context(start_engine(engine_config("decode")))]
            for f in range(frontends):
                config = FrontendConfig.model_validate(
                    {
                        "prefill": [e.url for e in prefill],
                        "decode": [e.url for e in decode],
                        "host": "127.0.0.1",
                        "port": 0,
                        "node_id": r * frontends + f,
                        "health_interval": 0.5,
                        "tokenize": tokenize,
                    }
                )
                running = await stack.enter_async_context(start_frontend(config, app=FrontendApp(config)))
                urls.append(running.url)
        async with httpx.AsyncClient(timeout=5) as client:
            for url in urls:
                await wait_ready(client, url + "/ready", None, None)
        yield urls


async def wait_ready(
    client: httpx.AsyncClient, url: str, proc: subprocess.Popen[bytes] | None, log: Path | None, deadline_s: float = 300
) -> None:
    """GET ``url`` until 200 (without blocking this loop, whose servers must go on serving)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    while loop.time() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log is not None else ""
            raise AssertionError(f"{proc.args!r} exited with {proc.returncode}:\n{tail}")
        try:
            if (await client.get(url)).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"{url} did not answer 200 within {deadline_s:.0f} s")


@dataclass
class Gym:
    url: str
    base_urls: list[str]
    transport_log: Path
    log: Path


@contextlib.asynccontextmanager
async def gym_server(training_yaml: Path, urls: list[str], forward: bool, logs: Path) -> AsyncIterator[Gym]:
    """NeMo-Gym's vllm_model server with the training config, ``base_url`` = ``urls`` + ``/v1``."""
    port = free_port()
    base_urls = [u + "/v1" for u in urls]
    server = "policy_model.responses_api_models.vllm_model"
    overrides = [
        f"+config_paths=[{training_yaml}]",
        f"++policy_base_url=[{','.join(base_urls)}]",
        "++policy_api_key=unused",
        f"++policy_model_name={MODEL}",
        f"++{server}.host=127.0.0.1",
        f"++{server}.port={port}",
        f"++{server}.forward_session_id_as_conversation_id={'true' if forward else 'false'}",
    ]
    log = logs / "gym.log"
    transport = logs / "gym.transport.jsonl"
    env = {**os.environ, "NEMO_GYM_VLLM_TRANSPORT_LOG": str(transport), "HF_HUB_OFFLINE": "1"}
    with open(log, "wb") as handle:
        argv = [str(GYM_PYTHON), str(LAUNCH), "policy_model", *overrides]
        proc = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=logs)
        try:
            url = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(timeout=5) as client:
                await wait_ready(client, url + "/health", proc, log)
            yield Gym(url, base_urls, transport, log)
        finally:
            proc.terminate()
            try:
                await asyncio.to_thread(proc.wait, 15)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)


# -- the agent loop ------------------------------------------------------------------------------


@dataclass
class Turn:
    status: int
    item: dict[str, Any]  #: Gym's output item that carries the token ids
    cached_tokens: int


@dataclass
class Session:
    name: str
    gym_session: str | None = None
    turns: list[Turn] = field(default_factory=list)


def gym_session_id(cookies: httpx.Cookies) -> str:
    """Gym's session id, from Starlette's session cookie (base64 JSON, then a timestamp and a signature)."""
    for value in cookies.jar:
        payload = (value.value or "").split(".")[0]
        try:
            data = json.loads(base64.b64decode(payload + "=" * (-len(payload) % 4)))
        except ValueError:
            continue
        if isinstance(data, dict) and SESSION_KEY in data:
            return str(data[SESSION_KEY])
    raise AssertionError(f"no Gym session cookie among {[c.name for c in cookies.jar]}")


def token_item(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The output item Gym put the training ids on (the last one)."""
    carrying = [o for o in output if "generation_token_ids" in o]
    assert len(carrying) == 1 and carrying[0] is output[-1], output
    return carrying[0]


def first_message(session: str) -> str:
    return f"{session}: look up the weather in three cities, one call at a time."


async def run_session(gym: Gym, name: str) -> Session:
    """One rollout as ``simple_agent._create_episode`` runs it (see the module docstring)."""
    rng = random.Random(name)
    session = Session(name)
    first = [{"role": "user", "content": first_message(name)}]
    outputs: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=gym.url, timeout=120) as client:
        for step in range(TURNS):
            body = {
                "input": first + outputs,
                "instructions": "You are a rollout policy with a search tool.",
                "tools": TOOLS,
                "max_output_tokens": rng.randint(8, 40),
            }
            response = await client.post("/v1/responses", json=body)
            assert response.status_code == 200, f"{name} turn {step}: {response.status_code} {response.text[:2000]}"
            answer = response.json()
            output = answer["output"]
            usage = answer.get("usage") or {}
            cached = (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0
            session.turns.append(Turn(response.status_code, token_item(output), cached))
            outputs.extend(output)
            text = "".join(
                part.get("text", "") for o in output if o.get("type") == "message" for part in o.get("content") or []
            )
            call_id = f"call_{name}_{step}"
            outputs.append(
                {
                    "type": "function_call",
                    "call_id": call_id,
                    "name": "search",
                    "arguments": json.dumps({"q": text[:24]}),
                }
            )
            outputs.append(
                {
                    "type": "function_call_output",
                    "call_id": call_id,
                    "output": json.dumps({"results": [step, text[-8:]]}),
                }
            )
        session.gym_session = gym_session_id(client.cookies)
    return session


async def requests_served(client: httpx.AsyncClient, url: str) -> float:
    text = (await client.get(url + "/metrics")).text
    prefix = 'drs_frontend_requests_total{endpoint="/v1/chat/completions",status="200"} '
    return sum(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))


def transport_answers(path: Path) -> dict[tuple[str, int], tuple[dict[str, Any], dict[str, Any]]]:
    """Our frontends' answers as Gym's server received them, with the request it sent, by
    (session's first user message, turn)."""
    requests: dict[int, dict[str, Any]] = {}
    out: dict[tuple[str, int], tuple[dict[str, Any], dict[str, Any]]] = {}
    for line in path.read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "transport_request":
            requests[event["call_index"]] = event["request_payload"]
        elif event["event"] == "transport_response":
            request = requests[event["call_index"]]
            users = [m for m in request["messages"] if m["role"] == "user"]
            turn = sum(1 for m in request["messages"] if m["role"] == "assistant")
            out[(users[0]["content"], turn)] = (request, event["raw_response"])
        else:
            raise AssertionError(f"Gym's transport log has {event['event']}: {event}")
    return out


CASES = [(f, tokenize, forward) for f in (1, 2) for tokenize in (True, False) for forward in (True, False)]


@pytest.mark.parametrize(
    ("frontends", "tokenize", "forward"),
    CASES,
    ids=[
        f"F={f}-{'tokenizing' if t else 'engine tokenizes'}-{'conversation id' if c else 'no id'}" for f, t, c in CASES
    ],
)
async def test_real_gym_sessions_keep_ids_continuity_and_affinity(
    training_yaml: Path, tmp_path: Path, frontends: int, tokenize: bool, forward: bool
) -> None:
    names = [f"F{frontends}-{'t' if tokenize else 'e'}-{'c' if forward else 'n'}-s{i}" for i in range(SESSIONS)]
    async with (
        fleet(frontends, tokenize) as urls,
        gym_server(training_yaml, urls, forward, tmp_path) as gym,
        httpx.AsyncClient(timeout=10) as client,
    ):
        before = {u: await requests_served(client, u) for u in urls}
        sessions = list(await asyncio.gather(*(run_session(gym, n) for n in names)))
        got = {u: await requests_served(client, u) - before[u] for u in urls}
    turns = [t for s in sessions for t in s.turns]
    assert len(turns) == SESSIONS * TURNS and all(t.status == 200 for t in turns)

    # Gym's extracted ids and log-probs are ours, and it asked for them as its training config says
    answers = transport_answers(gym.transport_log)
    assert len(answers) == SESSIONS * TURNS
    for s in sessions:
        for n, t in enumerate(s.turns):
            request, raw = answers[(first_message(s.name), n)]
            assert request["logprobs"] is True and request["top_logprobs"] == 0
            assert request[fields.RETURN_TOKENS_AS_TOKEN_IDS] is True
            assert ("conversation_params" in request) is forward
            if forward:
                assert request["conversation_params"] == {"conversation_id": s.gym_session}
            choice = raw["choices"][0]
            entries = choice["logprobs"]["content"]
            assert t.item["prompt_token_ids"] == raw["prompt_token_ids"] == choice["message"]["prompt_token_ids"]
            assert t.item["generation_token_ids"] == choice["token_ids"]
            assert t.item["generation_log_probs"] == [e["logprob"] for e in entries]
            assert [e["token"] for e in entries] == [f"{fields.TOKEN_ID_PREFIX}{i}" for i in choice["token_ids"]]
            assert all(e["top_logprobs"] == [] for e in entries)

    # token continuity: every later turn's prompt begins with the turn before's prompt + generation
    kept = [
        now.item["prompt_token_ids"][: len(p := prev.item["prompt_token_ids"] + prev.item["generation_token_ids"])] == p
        for s in sessions
        for prev, now in zip(s.turns, s.turns[1:], strict=False)
    ]
    assert len(kept) == SESSIONS * (TURNS - 1) and all(kept), f"{kept.count(False)} of {len(kept)} broke continuity"

    # URL affinity: each session's turns reached the frontend Gym picks by sha256(session) % N
    want: Counter[str] = Counter()
    for s in sessions:
        assert s.gym_session is not None
        index = int.from_bytes(hashlib.sha256(s.gym_session.encode()).digest()[:8], "big") % len(urls)
        want[urls[index]] += TURNS
    assert got == {u: float(want[u]) for u in urls}

    # prefill affinity: a later turn hits every full block of the previous prompt on its prefill engine
    block = SIM_DEFAULT_TOKENS_PER_BLOCK
    hits = [
        now.cached_tokens >= len(prev.item["prompt_token_ids"]) // block * block
        for s in sessions
        for prev, now in zip(s.turns, s.turns[1:], strict=False)
    ]
    ratio = hits.count(True) / len(hits)
    print(f"F={frontends} tokenize={tokenize} forward={forward}: prefill affinity {ratio:.3f} over {len(hits)} turns")
    # With the id the pin keeps every turn on its prefill engine. Without it (Gym's default) the
    # prefix match does (tools included in the text; a prefix that covers the opening is followed
    # whatever its share of the prompt), else the opening's engine: the same engine either way.
    assert ratio == 1.0

    log = gym.log.read_text()
    assert "Traceback" not in log, log[-3000:]
