"""Benchmark: render + tokenize cost of one chat turn at 1, 10, 30 and 100 turns, incremental vs full.

Not a test. A conversation grows the way a NeMo-Gym rollout sends it (system prompt, user turns of
~60 words, assistant turns of ~150 words carrying Gym's ``prompt_token_ids`` /
``generation_token_ids``). For turn k we time:

* ``full``: :func:`drs_protocol.chat.render_prompt_ids` on all k turns (what the engine, and NeMo
  RL's frontend, do every turn); transformers walks every value of every message first, so Gym's
  token-id lists make this quadratic in the turn count: ``full_without_gym_ids`` is the same
  conversation without them;
* ``incremental``: :class:`drs_frontend.tokenization.ChatTokenizer` with its cache holding turns
  k-2 and k-1 (what the frontend does in a live conversation), checked equal to ``full``. The
  cache is filled, then ``gc.collect()`` runs and the turn is timed: a cold start (the collection
  walks every object of this process, Gym's id lists included, and evicts the CPU caches), as a
  turn that arrives after other work would find it;
* ``incremental_warm``: the same turn timed right after its cache was filled (and, for every k,
  after one turn-1 request of another conversation), with no collection in between: warm CPU
  caches. The cold start adds about the same few hundred us to every turn, so the warm figures
  show the ratio between turns more plainly;
* ``spliced`` / ``spliced_warm``: what the frontend does with ``token_continuity`` on: the same
  two, plus reading the token prefix off the last assistant message and splicing the template's
  tail after it; checked equal to :func:`drs_protocol.token_prefix.render_spliced_ids`. The
  messages are what the frontend parses (:func:`drs_frontend.gym_ids.loads_chat`: Gym's id
  arrays left as JSON text), and the prefix is read from that text
  (:mod:`drs_frontend.tokenization.read_ids`: the text after the conversation's last one);
* ``prefix_check``: reading the prefix alone (cold), part of ``spliced``;
  ``prefix_check_uncached``: the same without the conversation's cache (a frontend that did not
  serve the turn before: every id is parsed and checked); ``prefix_parse``: JSON-parsing the
  prefix's ids into Python ints, for scale;
* ``request_parse``: parsing the request as the frontend does (``loads_chat``), from its bytes
  as a Python client writes them (``json.dumps``: what aiohttp's ``json=`` sends), with every
  earlier turn's ids; ``request_parse_full``: parsing all of it (``wire_json.loads``, what the
  frontend did before, and what an engine that renders does);
* ``turn_from_bytes``: ``request_parse`` + ``spliced``, cold: the frontend's whole work from the
  request's bytes to its prompt ids. The request's size grows with the square of the turn
  count (6.6 MB at turn 100 as ``json.dumps`` writes it), and finding Gym's arrays in it reads
  every byte, so this one is not flat; it is reported beside the tokenization figures, not
  instead of them.

The conversation is spliced as it grows: each assistant message carries the spliced prompt ids
of its turn and the ids of its reply (the reply text tokenized, plus EOS), as NeMo-Gym echoes them.

Each figure is the median of ``--repeats`` rounds (after ``--warmup`` untimed ones). A round
visits every turn point, in an order that rotates from round to round, so a burst of noise from
other processes on the machine lands on all turn points alike instead of on whichever one was
being measured then. Beside the medians' turn-100/turn-1 ratios, ``fastest`` gives the same
ratios from each figure's fastest round (on a machine shared with other work, the medians move
between runs by more than the 2x being measured). The last line is one JSON object: ``{"bench": "tokenize", "turns": {k:
{"full_us", "full_without_gym_ids_us", "incremental_us", "incremental_warm_us", "spliced_us",
"spliced_warm_us", "prefix_check_us", "prefix_check_uncached_us", "prefix_parse_us", "request_parse_us",
"request_parse_full_us", "turn_from_bytes_us", "speedup", "new_tokens", "prompt_tokens", "prefix_ids",
"request_bytes"}}, "incremental_turn100_over_turn1": …, "incremental_warm_turn100_over_turn1": …,
"spliced_turn100_over_turn1": …, "spliced_warm_turn100_over_turn1": …,
"turn_from_bytes_turn100_over_turn1": …}``.

    .venv/bin/python bench/tokenization.py [--repeats 31] [--warmup 2]

(Not ``bench/tokenize.py``: run as a script, any file in ``bench/`` puts that folder first on
``sys.path``, where a ``tokenize.py`` shadows the standard library module that ``logging`` imports.)
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import random
import statistics
import time
from typing import Any

from drs_frontend import wire_json
from drs_frontend.gym_ids import loads_chat
from drs_frontend.tokenization import ChatTokenizer
from drs_protocol.chat import load_tokenizer, render_prompt_ids
from drs_protocol.token_prefix import render_spliced_ids

TURN_POINTS = (1, 10, 30, 100)
FIGURES = (
    "full",
    "full_without_gym_ids",
    "incremental",
    "incremental_warm",
    "spliced",
    "spliced_warm",
    "prefix_check",
    "prefix_check_uncached",
    "prefix_parse",
    "request_parse",
    "request_parse_full",
    "turn_from_bytes",
)
WORDS = [
    "the",
    "model",
    "reads",
    "the",
    "observation",
    "and",
    "decides",
    "which",
    "tool",
    "to",
    "call",
    "next",
    "while",
    "keeping",
    "the",
    "plan",
    "short",
    "and",
    "the",
    "answer",
    "precise",
    "although",
    "some",
    "steps",
    "need",
    "more",
    "careful",
    "reasoning",
    "about",
    "state",
]


def conversation(turns: int, rng: random.Random, chat: ChatTokenizer) -> list[list[dict[str, Any]]]:
    """The request of every turn of one conversation (request k has k user messages), spliced as
    the frontend splices it: every assistant message carries its turn's prompt and reply ids."""
    tokenizer = chat.tokenizer
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent in a rollout."}]
    requests = []
    for _ in range(turns):
        messages = [*messages, {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(60))}]
        requests.append(messages)
        prompt = chat.prompt_ids("build", messages, prefix=chat.find_prefix(None, messages, "build")).ids.tolist()
        reply = " ".join(rng.choice(WORDS) for _ in range(150))
        generated = [*tokenizer.encode(reply, add_special_tokens=False), tokenizer.eos_token_id]
        messages = [
            *messages,
            {"role": "assistant", "content": reply, "prompt_token_ids": prompt, "generation_token_ids": generated},
        ]
    chat.forget("build")
    return requests


FIGURE_RUNS = (
    ("incremental", True),
    ("incremental_warm", False),
    ("spliced", True),
    ("spliced_warm", False),
    ("turn_from_bytes", True),
)


def written(request: list[dict[str, Any]]) -> bytes:
    """The request's body as a Python client writes it (``json.dumps``, as aiohttp's ``json=``)."""
    return json.dumps({"messages": request}).encode()


def parsed(raw: bytes) -> list[dict[str, Any]]:
    """The request's messages as the frontend parses them (Gym's id arrays left as text)."""
    messages: list[dict[str, Any]] = loads_chat(raw)["messages"]
    return messages


def plain_turn(chat: ChatTokenizer, cid: str, request: list[dict[str, Any]]) -> Any:
    return chat.prompt_ids(cid, request)


def prefix_ids(request: list[dict[str, Any]]) -> list[int]:
    """The last assistant message's prompt + generation ids (empty when there is none)."""
    last = [m for m in request if m["role"] == "assistant"][-1:]
    return [*last[0]["prompt_token_ids"], *last[0]["generation_token_ids"]] if last else []


def spliced_turn(chat: ChatTokenizer, cid: str, request: list[dict[str, Any]]) -> Any:
    """What the frontend does per chat turn with token continuity on, once the request is parsed."""
    return chat.prompt_ids(cid, request, prefix=chat.find_prefix(None, request, cid))


def turn_from_bytes(chat: ChatTokenizer, cid: str, raw: bytes) -> Any:
    """The same from the request's bytes: parsing them too."""
    return spliced_turn(chat, cid, parsed(raw))


def timed(fn: Any, *, collect: bool = True) -> tuple[float, Any]:
    if collect:
        gc.collect()
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def time_scale(
    chat: ChatTokenizer, request: list[dict[str, Any]], raw: bytes
) -> tuple[dict[str, float], tuple[int, int]]:
    """The uncached prefix check, JSON-parsing the prefix ids, and parsing the request (as the
    frontend does, and in full); and (prefix ids, request bytes)."""
    ids = prefix_ids(request)
    prefix_json, messages = wire_json.dumps(ids), parsed(raw)
    seconds: dict[str, float] = {}
    seconds["prefix_check_uncached"], _ = timed(lambda: chat.find_prefix(None, messages))
    seconds["prefix_parse"], _ = timed(lambda: wire_json.loads(prefix_json))
    seconds["request_parse"], _ = timed(lambda: loads_chat(raw))
    seconds["request_parse_full"], _ = timed(lambda: wire_json.loads(raw))
    return seconds, (len(ids), len(raw))


def report(k: int, us: dict[str, float], counts: tuple[int, int], sizes: tuple[int, int]) -> dict[str, Any]:
    """One turn point's figures (medians, in us), printed and as the JSON line has them."""
    (new_tokens, prompt_tokens), (prefix_count, request_bytes) = counts, sizes
    print(
        f"turn {k:>3}: full {us['full']:9.1f} us  (no Gym ids {us['full_without_gym_ids']:8.1f})  "
        f"incremental {us['incremental']:8.1f} us (warm {us['incremental_warm']:7.1f})  "
        f"spliced {us['spliced']:8.1f} us (warm {us['spliced_warm']:7.1f})  "
        f"({prompt_tokens} ids, {new_tokens} new)\n"
        f"          prefix check {us['prefix_check']:7.1f} us (uncached {us['prefix_check_uncached']:7.1f}; "
        f"{prefix_count} ids; parsing them "
        f"{us['prefix_parse']:8.1f} us)\n"
        f"          request of {request_bytes} bytes: parsed {us['request_parse']:8.1f} us "
        f"(in full {us['request_parse_full']:9.1f}); bytes to ids {us['turn_from_bytes']:8.1f} us"
    )
    return {
        **{f"{f}_us": round(us[f], 1) for f in FIGURES},
        "speedup": round(us["full"] / us["incremental"], 2),
        "new_tokens": new_tokens,
        "prompt_tokens": prompt_tokens,
        "prefix_ids": prefix_count,
        "request_bytes": request_bytes,
    }


def summarize(
    chat: ChatTokenizer,
    repeats: int,
    results: dict[int, dict[str, Any]],
    times: dict[tuple[int, str], list[float]],
) -> dict[str, Any]:
    """The JSON line: every turn point's figures and the turn-100/turn-1 ratios."""
    return {
        "bench": "tokenize",
        "cpu": platform.processor() or platform.machine(),
        "nproc": os.cpu_count(),
        "windowed_render": chat.windowed,
        "repeats": repeats,
        "turns": results,
        "incremental_turn100_over_turn1": round(results[100]["incremental_us"] / results[1]["incremental_us"], 2),
        "incremental_warm_turn100_over_turn1": round(
            results[100]["incremental_warm_us"] / results[1]["incremental_warm_us"], 2
        ),
        "spliced_turn100_over_turn1": round(results[100]["spliced_us"] / results[1]["spliced_us"], 2),
        "spliced_warm_turn100_over_turn1": round(results[100]["spliced_warm_us"] / results[1]["spliced_warm_us"], 2),
        "turn_from_bytes_turn100_over_turn1": round(
            results[100]["turn_from_bytes_us"] / results[1]["turn_from_bytes_us"], 2
        ),
        "full_turn100_over_turn1": round(results[100]["full_us"] / results[1]["full_us"], 2),
        # the same ratios from each figure's fastest round: what a turn costs when nothing else
        # on the machine interfered, beside (not instead of) the medians above
        "fastest": {
            f"{f}_turn100_over_turn1": round(min(times[100, f]) / min(times[1, f]), 2)
            for f in ("incremental", "incremental_warm", "spliced", "spliced_warm", "turn_from_bytes")
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    args = parser.parse_args()
    tokenizer = load_tokenizer(None)
    chat = ChatTokenizer(tokenizer)
    requests = conversation(max(TURN_POINTS), random.Random(0), chat)
    raws = [written(request) for request in requests]
    times: dict[tuple[int, str], list[float]] = {(k, f): [] for k in TURN_POINTS for f in FIGURES}
    counts: dict[int, tuple[int, int]] = {}
    sizes: dict[int, tuple[int, int]] = {}
    for rnd in range(args.warmup + args.repeats):
        shift = rnd % len(TURN_POINTS)
        for k in TURN_POINTS[shift:] + TURN_POINTS[:shift]:
            request, raw, earlier = requests[k - 1], raws[k - 1], raws[max(0, k - 3) : k - 1]
            plain = [{k: v for k, v in m.items() if not k.endswith("_token_ids")} for m in request]
            seconds: dict[str, float] = {}
            seconds["full"], full = timed(lambda r=request: render_prompt_ids(tokenizer, r))
            seconds["full_without_gym_ids"], _ = timed(lambda r=plain: render_prompt_ids(tokenizer, r))
            spliced_full = full
            if k > 1:
                prefix = chat.find_prefix(None, request)
                assert prefix is not None
                spliced_full = render_spliced_ids(tokenizer, request, prefix).ids.tolist()
            scale, sizes[k] = time_scale(chat, request, raw)
            seconds.update(scale)
            for figure, collect in FIGURE_RUNS:
                cid = f"bench-{figure}-{k}-{rnd}"
                splices = not figure.startswith("incremental")
                gc.collect()
                chat.prompt_ids(None, requests[0])  # the same warm-up before every turn point
                for previous in map(parsed, earlier):  # the cache holds turns k-2 and k-1, as live
                    chat.prompt_ids(cid, previous, prefix=chat.find_prefix(None, previous, cid) if splices else None)
                messages = parsed(raw)
                if figure == "spliced":  # the first step of the spliced turn, alone
                    seconds["prefix_check"], _ = timed(lambda m=messages, c=cid: chat.find_prefix(None, m, c))
                if figure == "turn_from_bytes":
                    run = functools.partial(turn_from_bytes, chat, cid, raw)
                elif splices:
                    run = functools.partial(spliced_turn, chat, cid, messages)
                else:
                    run = functools.partial(plain_turn, chat, cid, messages)
                seconds[figure], turn = timed(run, collect=collect)
                if turn.ids.tolist() != (spliced_full if splices else full):
                    raise SystemExit(f"turn {k}: {figure} ids differ from the full path's")
                if not splices:
                    counts[k] = (turn.new_ids, len(full))
                chat.forget(cid)
            if rnd >= args.warmup:
                for figure, value in seconds.items():
                    times[k, figure].append(value)
    results = {
        k: report(k, {f: statistics.median(times[k, f]) * 1e6 for f in FIGURES}, counts[k], sizes[k])
        for k in TURN_POINTS
    }
    print(json.dumps(summarize(chat, args.repeats, results, times)))


if __name__ == "__main__":
    main()
