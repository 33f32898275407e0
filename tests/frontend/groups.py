"""What the GRPO group placement tests share: the block size and load factor they route with, a
pool of engine URLs, and a group's opening (messages) with prompt ids no other group shares."""

from __future__ import annotations

from typing import Any

BLOCK = 32
FACTOR = 1.25


def pool(n: int) -> list[str]:
    return [f"http://e{i}" for i in range(n)]


def group(g: int, size: int) -> tuple[list[dict[str, Any]], list[int]]:
    messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": f"task {g}"}]
    return messages, [g * 100_000 + i for i in range(size)]  # no two groups share a block
