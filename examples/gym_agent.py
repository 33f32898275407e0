"""The demo's rollout pod: the real NeMo-Gym 0.7.0 drives the fleet (`make demo`, tests/realnodes).

Run by the ``drs-gym`` image's interpreter (``/opt/gym``: NeMo-Gym 0.7.0 at the pins of
tests/realgym), after the pod's init container ran ``drs gym-config NAME -o CONFIG``: Gym's
``vllm_model`` training config with ``base_url`` = the fleet's ``status.urls`` + ``/v1``.

1. It starts Gym's own ``responses_api_models/vllm_model`` server, unchanged, as ``gym env start``
   (``nemo_gym.cli.env.RunHelper``) starts it: Gym's config parser (``GlobalConfigDictParser``)
   over ``+config_paths=[CONFIG]`` and the host/port overrides, then the server's ``app.py`` in
   its folder with the resolved config in ``NEMO_GYM_CONFIG_DICT`` (this file, run with ``serve``,
   is that launcher: the pod gets one script). Gym's transport log is on, so the answers of our
   frontends are seen as they reached Gym.
2. It runs ``--conversations`` rollouts of ``--turns`` turns each at once, as Gym's
   ``simple_agent`` runs one: ``POST /v1/responses`` with the session's cookie, the output
   appended to the input, then a ``search`` tool call and its output (the sim engine's replies
   are random tokens, never a real tool call: the loop takes each reply as the call it stands
   for), so every later turn carries a tool-calling history.
3. It checks, and prints one JSON line: every turn 200; the token ids and log-probs Gym extracted
   equal what the frontend answered (``token_id:N`` log-prob tokens); each turn's prompt ids begin
   with the turn before's prompt + generated ids (continuity); each conversation's turns all
   reached the frontend Gym picks by ``sha256(session) % len(base_url)`` (the frontends' request
   counters); each later turn hit the prefix cache for every full block of the turn before's
   prompt (the conversation stayed on its prefill engine). Exit status 1 when any check fails.

    python gym_agent.py --config /gym/policy.yaml --block-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import importlib
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

#: Where Gym's config puts the model server (``drs gym-config`` writes it there).
SERVER_KEY = "policy_model"
SERVER = f"{SERVER_KEY}.responses_api_models.vllm_model"
#: Gym's session id lives in Starlette's signed session cookie.
SESSION_KEY = "session_id"
#: The frontends' counter of answered chat completions (tests/realgym reads the same).
SERVED = 'drs_frontend_requests_total{endpoint="/v1/chat/completions",status="200"} '
TOKEN_ID_PREFIX = "token_id:"
GYM_START_TIMEOUT_S = 120.0
TURN_TIMEOUT_S = 120.0
METRICS_TIMEOUT_S = 10.0
TOOLS = [
    {
        "type": "function",
        "name": "search",
        "description": "Search the notes",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        "strict": False,
    }
]


def say(msg: str) -> None:
    print(f"[gym-agent] {msg}", flush=True)


# -- 1. Gym's server, launched as Gym launches it -----------------------------------------------


def serve() -> None:
    """``python gym_agent.py serve OVERRIDE...``: become Gym's ``vllm_model`` server (the argv left
    is Gym's own command line, as Hydra reads it)."""
    from nemo_gym.global_config import (
        NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME,
        NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME,
        GlobalConfigDictParser,
        GlobalConfigDictParserConfig,
    )
    from omegaconf import OmegaConf

    sys.argv.pop(1)
    config = GlobalConfigDictParser().parse(GlobalConfigDictParserConfig(skip_load_from_dotenv=True))
    (server_type,) = config[SERVER_KEY]
    (server_name,) = config[SERVER_KEY][server_type]
    server = config[SERVER_KEY][server_type][server_name]
    package = importlib.import_module(f"{server_type}.{server_name}")
    env = {
        **os.environ,
        NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME: OmegaConf.to_yaml(config),
        NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME: SERVER_KEY,
    }
    print(f"[gym] {SERVER_KEY}: {server_type}/{server_name} on {server.host}:{server.port}", flush=True)
    os.chdir(Path(str(package.__file__)).parent)
    os.execve(sys.executable, [sys.executable, str(server.entrypoint)], env)


@dataclass
class Gym:
    url: str
    base_urls: list[str]
    transport_log: Path
    log: Path


@contextlib.asynccontextmanager
async def gym_server(config: Path, port: int, workdir: Path) -> AsyncIterator[Gym]:
    import yaml

    base_urls = [str(u) for u in yaml.safe_load(config.read_text())["policy_base_url"]]
    log, transport = workdir / "gym.log", workdir / "gym.transport.jsonl"
    overrides = [f"+config_paths=[{config}]", f"++{SERVER}.host=127.0.0.1", f"++{SERVER}.port={port}"]
    env = {**os.environ, "NEMO_GYM_VLLM_TRANSPORT_LOG": str(transport)}
    with open(log, "wb") as handle:
        argv = [sys.executable, str(Path(__file__).resolve()), "serve", *overrides]
        proc = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=workdir)
        try:
            url = f"http://127.0.0.1:{port}"
            await wait_health(url + "/health", proc, log)
            yield Gym(url, base_urls, transport, log)
        finally:
            proc.terminate()
            try:
                await asyncio.to_thread(proc.wait, 15)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)


async def wait_health(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + GYM_START_TIMEOUT_S
    async with httpx.AsyncClient(timeout=5) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"Gym's server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.TransportError):
                if (await client.get(url)).status_code == 200:
                    return
            await asyncio.sleep(0.2)
    raise SystemExit(f"Gym's server did not answer {url} within {GYM_START_TIMEOUT_S:.0f} s")


# -- 2. the agent loop --------------------------------------------------------------------------


@dataclass
class Turn:
    status: int
    item: dict[str, Any]  #: Gym's output item that carries the token ids
    cached_tokens: int


@dataclass
class Conversation:
    name: str
    gym_session: str = ""
    turns: list[Turn] = field(default_factory=list)
    error: str = ""


def first_message(name: str) -> str:
    return f"{name}: look up the weather in three cities, one call at a time."


def gym_session_id(cookies: httpx.Cookies) -> str:
    """Gym's session id, from Starlette's session cookie (base64 JSON, a timestamp, a signature)."""
    for value in cookies.jar:
        payload = (value.value or "").split(".")[0]
        try:
            data = json.loads(base64.b64decode(payload + "=" * (-len(payload) % 4)))
        except ValueError:
            continue
        if isinstance(data, dict) and SESSION_KEY in data:
            return str(data[SESSION_KEY])
    return ""


async def rollout(gym: Gym, name: str, turns: int) -> Conversation:
    """One rollout as ``simple_agent`` runs it (the module docstring, step 2)."""
    rng = random.Random(name)
    conv = Conversation(name)
    first = [{"role": "user", "content": first_message(name)}]
    outputs: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=gym.url, timeout=TURN_TIMEOUT_S) as client:
        for step in range(turns):
            body = {
                "input": first + outputs,
                "instructions": "You are a rollout policy with a search tool.",
                "tools": TOOLS,
                "max_output_tokens": rng.randint(8, 24),
            }
            response = await client.post("/v1/responses", json=body)
            if response.status_code != 200:
                conv.error = f"turn {step}: {response.status_code} {response.text[:500]}"
                break
            answer = response.json()
            output = answer["output"]
            carrying = [o for o in output if "generation_token_ids" in o]
            if len(carrying) != 1:
                conv.error = f"turn {step}: {len(carrying)} output items carry token ids"
                break
            details = (answer.get("usage") or {}).get("input_tokens_details") or {}
            conv.turns.append(Turn(200, carrying[0], int(details.get("cached_tokens") or 0)))
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
        conv.gym_session = gym_session_id(client.cookies)
    return conv


async def served(client: httpx.AsyncClient, base_urls: list[str]) -> list[float]:
    """Each frontend's count of answered chat completions (its /metrics)."""
    counts = []
    for base in base_urls:
        text = (await client.get(base.removesuffix("/v1") + "/metrics", timeout=METRICS_TIMEOUT_S)).text
        counts.append(sum(float(line[len(SERVED) :]) for line in text.splitlines() if line.startswith(SERVED)))
    return counts


# -- 3. the checks ------------------------------------------------------------------------------


def transport_answers(path: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """Our frontends' answers as Gym's server received them, by (first user message, turn)."""
    requests: dict[int, dict[str, Any]] = {}
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        event = json.loads(line)
        if event["event"] == "transport_request":
            requests[event["call_index"]] = event["request_payload"]
        elif event["event"] == "transport_response":
            messages = requests[event["call_index"]]["messages"]
            users = [m for m in messages if m["role"] == "user"]
            turn = sum(1 for m in messages if m["role"] == "assistant")
            out[(users[0]["content"], turn)] = event["raw_response"]
    return out


def ids_match(item: dict[str, Any], raw: dict[str, Any] | None) -> bool:
    """Gym's extracted ids and log-probs are the frontend's answer, log-prob tokens ``token_id:N``."""
    if raw is None:
        return False
    choice = raw["choices"][0]
    entries = choice["logprobs"]["content"]
    return bool(
        item["prompt_token_ids"] == raw["prompt_token_ids"]
        and item["generation_token_ids"] == choice["token_ids"]
        and item["generation_log_probs"] == [e["logprob"] for e in entries]
        and [e["token"] for e in entries] == [f"{TOKEN_ID_PREFIX}{i}" for i in choice["token_ids"]]
    )


def pick(session: str, n: int) -> int:
    """The frontend Gym's server picks for a session (its ``sha256(session) % len(base_url)``)."""
    return int.from_bytes(hashlib.sha256(session.encode()).digest()[:8], "big") % n


def check(convs: list[Conversation], gym: Gym, got: list[float], turns: int, block: int) -> dict[str, Any]:
    answers = transport_answers(gym.transport_log)
    all_turns = [t for c in convs for t in c.turns]
    pairs = [(c, prev, now) for c in convs for prev, now in zip(c.turns, c.turns[1:], strict=False)]
    ids = [ids_match(t.item, answers.get((first_message(c.name), n))) for c in convs for n, t in enumerate(c.turns)]
    kept = [
        now.item["prompt_token_ids"][: len(p := prev.item["prompt_token_ids"] + prev.item["generation_token_ids"])] == p
        for _, prev, now in pairs
    ]
    hits = [now.cached_tokens >= len(prev.item["prompt_token_ids"]) // block * block for _, prev, now in pairs]
    want: Counter[int] = Counter()
    for c in convs:
        want[pick(c.gym_session, len(gym.base_urls))] += len(c.turns)
    routed = [float(want[i]) for i in range(len(gym.base_urls))]
    log = gym.log.read_text()
    result = {
        "gym": "nemo-gym 0.7.0 responses_api_models/vllm_model",
        "base_urls": gym.base_urls,
        "conversations": len(convs),
        "turns": f"{len(all_turns)}/{len(convs) * turns}",
        "errors": [f"{c.name} {c.error}" for c in convs if c.error],
        "ids_equal": f"{ids.count(True)}/{len(ids)}",
        "continuity": f"{kept.count(True)}/{len(kept)}",
        "url_affinity": {"per_frontend": got, "expected": routed, "ok": got == routed},
        "prefill_affinity": f"{hits.count(True)}/{len(hits)}",
        "sessions_distinct": len({c.gym_session for c in convs}) == len(convs) and all(c.gym_session for c in convs),
        "gym_log_traceback": "Traceback" in log,
    }
    result["ok"] = bool(
        len(all_turns) == len(convs) * turns
        and all(ids)
        and all(kept)
        and all(hits)
        and got == routed
        and result["sessions_distinct"]
        and not result["gym_log_traceback"]
    )
    return result


async def run(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    async with gym_server(Path(args.config), args.port, workdir) as gym, httpx.AsyncClient() as metrics:
        say(f"Gym's vllm_model server up in {time.monotonic() - started:.1f}s; base_url = {gym.base_urls}")
        before = await served(metrics, gym.base_urls)
        names = [f"gym-conversation-{i}" for i in range(args.conversations)]
        convs = list(await asyncio.gather(*(rollout(gym, n, args.turns) for n in names)))
        after = await served(metrics, gym.base_urls)
    for c in convs:
        url = gym.base_urls[pick(c.gym_session, len(gym.base_urls))] if c.gym_session else "?"
        for n, t in enumerate(c.turns):
            say(
                f"{c.name} turn {n} via {url}: {t.status}, prompt {len(t.item['prompt_token_ids'])} ids, "
                f"generated {len(t.item['generation_token_ids'])}, prefix-cache hit {t.cached_tokens} tokens"
            )
        if c.error:
            say(f"{c.name} failed: {c.error}")
    result = check(convs, gym, [a - b for a, b in zip(after, before, strict=True)], args.turns, args.block_tokens)
    result["seconds"] = round(time.monotonic() - started, 1)
    if not result["ok"]:
        say("Gym's log (last lines):\n" + gym.log.read_text()[-3000:])
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve()
        return 0  # not reached: serve() becomes Gym's server
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the file `drs gym-config` wrote")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--block-tokens", type=int, required=True, help="the engines' prefix-cache block size")
    parser.add_argument("--port", type=int, default=8000, help="Gym's server, on 127.0.0.1")
    parser.add_argument("--workdir", default="/tmp/gym-agent", help="Gym's log and transport log")
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
