"""Benchmark: render + tokenize cost of one chat turn at 1, 10, 30 and 100 turns, incremental vs full.

Not a test. A conversation grows the way a NeMo-Gym rollout sends it (system prompt, user turns of
~60 words, assistant turns of ~150 words carrying Gym's ``prompt_token_ids`` /
``generation_token_ids``). For turn k we time:

* ``full``: :func:`drs_protocol.chat.render_prompt_ids` on all k turns (what the engine, and NeMo
  RL's frontend, do every turn); transformers walks every value of every message first, so Gym's
  token-id lists make this quadratic in the turn count: ``full_without_gym_ids`` is the same
  conversation without them;
* ``incremental``: :class:`drs_frontend.tokenization.ChatTokenizer` with its cache holding turns
  k-2 and k-1 (what the frontend does in a live conversation), checked equal to ``full``.

Each figure is the median of ``--repeats`` runs. The last line is one JSON object:
``{"bench": "tokenize", "turns": {k: {"full_us", "incremental_us", "speedup", "new_tokens",
"prompt_tokens"}}, "incremental_turn100_over_turn1": …}``.

    .venv/bin/python bench/tokenization.py [--repeats 15]

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

from drs_frontend.tokenization import ChatTokenizer
from drs_protocol.chat import load_tokenizer, render_prompt_ids

TURN_POINTS = (1, 10, 30, 100)
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


def conversation(turns: int, rng: random.Random) -> list[list[dict[str, Any]]]:
    """The request of every turn of one conversation (request k has k user messages)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent in a rollout."}]
    requests = []
    for turn in range(turns):
        messages = [*messages, {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(60))}]
        requests.append(messages)
        reply = " ".join(rng.choice(WORDS) for _ in range(150))
        messages = [
            *messages,
            {
                "role": "assistant",
                "content": reply,
                "prompt_token_ids": list(range(300 * (turn + 1))),
                "generation_token_ids": list(range(200)),
            },
        ]
    return requests


def timed(fn: Any) -> tuple[float, Any]:
    gc.collect()
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    tokenizer = load_tokenizer(None)
    chat = ChatTokenizer(tokenizer)
    requests = conversation(max(TURN_POINTS), random.Random(0))
    results: dict[int, dict[str, Any]] = {}
    for k in TURN_POINTS:
        request, earlier = requests[k - 1], requests[max(0, k - 3) : k - 1]
        plain = [{k: v for k, v in m.items() if not k.endswith("_token_ids")} for m in request]
        full_times, plain_times, inc_times = [], [], []
        new_tokens = prompt_tokens = 0
        for rep in range(args.repeats):
            cid = f"bench-{k}-{rep}"
            seconds, full = timed(lambda r=request: render_prompt_ids(tokenizer, r))
            full_times.append(seconds)
            seconds, _ = timed(lambda r=plain: render_prompt_ids(tokenizer, r))
            plain_times.append(seconds)
            for previous in earlier:  # the cache holds turns k-2 and k-1, as in a live conversation
                chat.prompt_ids(cid, previous)
            seconds, turn = timed(lambda r=request, c=cid: chat.prompt_ids(c, r))
            inc_times.append(seconds)
            if turn.ids.tolist() != full:
                raise SystemExit(f"turn {k}: incremental ids differ from the full tokenization")
            new_tokens, prompt_tokens = turn.new_ids, len(full)
            chat.forget(cid)
        full_us = statistics.median(full_times) * 1e6
        inc_us = statistics.median(inc_times) * 1e6
        results[k] = {
            "full_us": round(full_us, 1),
            "full_without_gym_ids_us": round(statistics.median(plain_times) * 1e6, 1),
            "incremental_us": round(inc_us, 1),
            "speedup": round(full_us / inc_us, 2),
            "new_tokens": new_tokens,
            "prompt_tokens": prompt_tokens,
        }
        print(
            f"turn {k:>3}: full {full_us:9.1f} us  (no Gym ids {results[k]['full_without_gym_ids_us']:8.1f})  incremental {inc_us:8.1f} us  ({prompt_tokens} ids, {new_tokens} new)"
        )
    summary = {
        "bench": "tokenize",
        "cpu": platform.processor() or platform.machine(),
        "nproc": os.cpu_count(),
        "windowed_render": chat.windowed,
        "turns": results,
        "incremental_turn100_over_turn1": round(results[100]["incremental_us"] / results[1]["incremental_us"], 2),
        "full_turn100_over_turn1": round(results[100]["full_us"] / results[1]["full_us"], 2),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
