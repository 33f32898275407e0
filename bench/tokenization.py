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
  two, plus reading the token prefix off the last assistant message (validating and converting
  its ids: the one step whose cost grows with the conversation) and splicing the template's tail
  after it; checked equal to :func:`drs_protocol.token_prefix.render_spliced_ids`;
* ``prefix_check``: that first step alone (cold), the exact check of the prefix's ids
  (:func:`drs_protocol.token_prefix.token_ids`: every id is read; the ids the conversation's
  cached turn returned, which head the prefix, are not bounded and counted again), part of
  ``spliced``; ``prefix_check_uncached``: the same without the conversation's cache (a
  frontend that did not serve the turn before); and, for scale, two things
  the frontend does before any of the above and this benchmark does not count:
  ``prefix_parse`` (JSON-parsing the same ids, as they arrive in the request) and
  ``request_parse`` (parsing the whole request, as Gym sends it, with every earlier turn's ids).

The conversation is spliced as it grows: each assistant message carries the spliced prompt ids
of its turn and the ids of its reply (the reply text tokenized, plus EOS), as NeMo-Gym echoes them.

Each figure is the median of ``--repeats`` rounds (after ``--warmup`` untimed ones). A round
visits every turn point, in an order that rotates from round to round, so a burst of noise from
other processes on the machine lands on all turn points alike instead of on whichever one was
being measured then. Beside the medians' turn-100/turn-1 ratios, ``fastest`` gives the same
ratios from each figure's fastest round (on a machine shared with other work, the medians move
between runs by more than the 2x being measured). The last line is one JSON object: ``{"bench": "tokenize", "turns": {k:
{"full_us", "full_without_gym_ids_us", "incremental_us", "incremental_warm_us", "spliced_us",
"spliced_warm_us", "prefix_check_us", "prefix_check_uncached_us", "prefix_parse_us", "request_parse_us", "speedup",
"new_tokens", "prompt_tokens", "prefix_ids", "request_bytes"}}, "incremental_turn100_over_turn1": …,
"incremental_warm_turn100_over_turn1": …, "spliced_turn100_over_turn1": …,
"spliced_warm_turn100_over_turn1": …}``.

    .venv/bin/python bench/tokenization.py [--repeats 31] [--warmup 2]

(Not ``bench/tokenize.py``: run as a script, any file in ``bench/`` puts that folder first on
``sys.path``, where a ``tokenize.py`` shadows the standard library module that ``logging`` imports.)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import time
from typing import Any

from drs_frontend import wire_json
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


FIGURE_RUNS = (("incremental", True), ("incremental_warm", False), ("spliced", True), ("spliced_warm", False))


def plain_turn(chat: ChatTokenizer, cid: str, request: list[dict[str, Any]]) -> Any:
    return chat.prompt_ids(cid, request)


def prefix_ids(request: list[dict[str, Any]]) -> list[int]:
    """The last assistant message's prompt + generation ids (empty when there is none)."""
    last = [m for m in request if m["role"] == "assistant"][-1:]
    return [*last[0]["prompt_token_ids"], *last[0]["generation_token_ids"]] if last else []


def spliced_turn(chat: ChatTokenizer, cid: str, request: list[dict[str, Any]]) -> Any:
    """What the frontend does per chat turn with token continuity on."""
    return chat.prompt_ids(cid, request, prefix=chat.find_prefix(None, request, cid))


def timed(fn: Any, *, collect: bool = True) -> tuple[float, Any]:
    if collect:
        gc.collect()
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def time_scale(chat: ChatTokenizer, request: list[dict[str, Any]]) -> tuple[dict[str, float], tuple[int, int]]:
    """The prefix check alone and, for scale, JSON-parsing the prefix ids and the whole request;
    and (prefix ids, request bytes)."""
    ids = prefix_ids(request)
    prefix_json, request_json = wire_json.dumps(ids), wire_json.dumps({"messages": request})
    seconds: dict[str, float] = {}
    seconds["prefix_check_uncached"], _ = timed(lambda: chat.find_prefix(None, request))
    seconds["prefix_parse"], _ = timed(lambda: wire_json.loads(prefix_json))
    seconds["request_parse"], _ = timed(lambda: wire_json.loads(request_json))
    return seconds, (len(ids), len(request_json))


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
        f"{us['prefix_parse']:8.1f} us; parsing the request, {request_bytes} bytes, {us['request_parse']:9.1f} us)"
    )
    return {
        **{f"{f}_us": round(us[f], 1) for f in FIGURES},
        "speedup": round(us["full"] / us["incremental"], 2),
        "new_tokens": new_tokens,
        "prompt_tokens": prompt_tokens,
        "prefix_ids": prefix_count,
        "request_bytes": request_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    args = parser.parse_args()
    tokenizer = load_tokenizer(None)
    chat = ChatTokenizer(tokenizer)
    requests = conversation(max(TURN_POINTS), random.Random(0), chat)
    times: dict[tuple[int, str], list[float]] = {(k, f): [] for k in TURN_POINTS for f in FIGURES}
    counts: dict[int, tuple[int, int]] = {}
    sizes: dict[int, tuple[int, int]] = {}
    for rnd in range(args.warmup + args.repeats):
        shift = rnd % len(TURN_POINTS)
        for k in TURN_POINTS[shift:] + TURN_POINTS[:shift]:
            request, earlier = requests[k - 1], requests[max(0, k - 3) : k - 1]
            plain = [{k: v for k, v in m.items() if not k.endswith("_token_ids")} for m in request]
            seconds: dict[str, float] = {}
            seconds["full"], full = timed(lambda r=request: render_prompt_ids(tokenizer, r))
            seconds["full_without_gym_ids"], _ = timed(lambda r=plain: render_prompt_ids(tokenizer, r))
            spliced_full = full
            if k > 1:
                prefix = chat.find_prefix(None, request)
                assert prefix is not None
                spliced_full = render_spliced_ids(tokenizer, request, prefix).ids.tolist()
            scale, sizes[k] = time_scale(chat, request)
            seconds.update(scale)
            for figure, collect in FIGURE_RUNS:
                cid = f"bench-{figure}-{k}-{rnd}"
                splices = figure.startswith("spliced")
                gc.collect()
                chat.prompt_ids(None, requests[0])  # the same warm-up before every turn point
                for previous in earlier:  # the cache holds turns k-2 and k-1, as in a live conversation
                    chat.prompt_ids(cid, previous, prefix=chat.find_prefix(None, previous, cid) if splices else None)
                if figure == "spliced":  # the first step of the spliced turn, alone
                    seconds["prefix_check"], _ = timed(lambda r=request, c=cid: chat.find_prefix(None, r, c))
                turn_fn = spliced_turn if splices else plain_turn
                seconds[figure], turn = timed(lambda r=request, c=cid, f=turn_fn: f(chat, c, r), collect=collect)
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
    summary = {
        "bench": "tokenize",
        "cpu": platform.processor() or platform.machine(),
        "nproc": os.cpu_count(),
        "windowed_render": chat.windowed,
        "repeats": args.repeats,
        "turns": results,
        "incremental_turn100_over_turn1": round(results[100]["incremental_us"] / results[1]["incremental_us"], 2),
        "incremental_warm_turn100_over_turn1": round(
            results[100]["incremental_warm_us"] / results[1]["incremental_warm_us"], 2
        ),
        "spliced_turn100_over_turn1": round(results[100]["spliced_us"] / results[1]["spliced_us"], 2),
        "spliced_warm_turn100_over_turn1": round(results[100]["spliced_warm_us"] / results[1]["spliced_warm_us"], 2),
        "full_turn100_over_turn1": round(results[100]["full_us"] / results[1]["full_us"], 2),
        # the same ratios from each figure's fastest round: what a turn costs when nothing else
        # on the machine interfered, beside (not instead of) the medians above
        "fastest": {
            f"{f}_turn100_over_turn1": round(min(times[100, f]) / min(times[1, f]), 2)
            for f in ("incremental", "incremental_warm", "spliced", "spliced_warm")
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
