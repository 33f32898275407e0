"""Benchmark: a GRPO group's first turns through the frontend's tokenizer, with and without the
shared openings (``ChatTokenizer``'s ``max_openings``).

Not a test. A group is ``--group`` siblings, each a new conversation whose first turn is the same
prompt (a system message and a user message of about ``--tokens`` tokens, the real Qwen3 tokenizer
and chat template). Per round, for each mode in turn: a fresh ``ChatTokenizer``, then ``--groups``
groups of distinct prompts, each sibling's ``prompt_ids`` timed; the figure is the mean time of a
sibling's turn over the round. ``--warmup`` rounds first (not reported), then ``--rounds``; median
and spread (min, max) per mode, and the ratio shared / unshared per round (its median and spread).
One JSON line on stdout.

    .venv/bin/python bench/sibling_openings.py [--group 16] [--groups 8] [--tokens 1000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from drs_frontend.tokenization import ChatTokenizer, Path
from drs_protocol.chat import load_tokenizer


def spread(values: list[float]) -> dict[str, Any]:
    return {"median": round(statistics.median(values), 4), "spread": [round(min(values), 4), round(max(values), 4)]}


def prompt(group: int, tokens: int) -> list[dict[str, str]]:
    """A first turn of about ``tokens`` tokens (~10 tokens a sentence), distinct per group."""
    body = " ".join(f"Fact {i} of problem {group}: the value doubles every step." for i in range(tokens // 12))
    return [{"role": "system", "content": "You are a careful solver."}, {"role": "user", "content": body}]


def one_round(tokenizer: Any, args: argparse.Namespace, openings: int, round_no: int) -> tuple[float, int]:
    """Mean seconds of a sibling's first turn, and how many were shared."""
    chat = ChatTokenizer(tokenizer, windowed=True, history_eos_cached=True, max_openings=openings)
    took, shared = 0.0, 0
    for g in range(args.groups):
        messages = prompt(round_no * 1000 + g, args.tokens)
        for s in range(args.group):
            started = time.perf_counter()
            turn = chat.prompt_ids(f"r{round_no}-g{g}-s{s}", messages)
            took += time.perf_counter() - started
            shared += turn.path is Path.SHARED
    return took / (args.groups * args.group), shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    tokenizer = load_tokenizer()
    ids = len(ChatTokenizer(tokenizer, windowed=True, max_openings=0).prompt_ids(None, prompt(0, args.tokens)).ids)
    figures: dict[str, list[float]] = {"shared": [], "unshared": []}
    ratios: list[float] = []
    shared_turns = 0
    for r in range(args.warmup + args.rounds):
        with_openings, shared = one_round(tokenizer, args, 64, r)
        without, _ = one_round(tokenizer, args, 0, r)
        if r < args.warmup:
            continue
        figures["shared"].append(with_openings * 1e3)
        figures["unshared"].append(without * 1e3)
        ratios.append(with_openings / without)
        shared_turns = shared
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    line = {
        "bench": "sibling_openings",
        "commit": commit,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        "group": args.group,
        "groups": args.groups,
        "prompt_ids": ids,
        "rounds": args.rounds,
        "sibling_turn_ms": {mode: spread(values) for mode, values in figures.items()},
        "shared_over_unshared": spread(ratios),
        "shared_turns_a_round": shared_turns,
    }
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
