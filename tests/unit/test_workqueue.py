"""The keyed work queue (workqueue.py): dedup, one reconcile per key, dirty keys paced by how long
their last reconcile took, and events of unknown resources ignored."""

from __future__ import annotations

import asyncio

from drs_operator.workqueue import WorkQueue


async def test_a_key_added_many_times_is_queued_once() -> None:
    q = WorkQueue()
    for _ in range(5):
        q.add("ns/a")
    q.add("ns/b")
    assert len(q) == 2
    assert {await q.get(), await q.get()} == {"ns/a", "ns/b"}


async def test_a_key_dirtied_during_its_reconcile_comes_back_after_as_long_as_it_took() -> None:
    q = WorkQueue()
    q.add("ns/a")
    key = await q.get()
    q.add(key)  # an event while it is being reconciled
    assert len(q) == 0, "a key being reconciled is not queued a second time"
    loop = asyncio.get_running_loop()
    done_at = loop.time()
    q.done(key, took=0.2)
    assert len(q) == 0
    assert await asyncio.wait_for(q.get(), timeout=2) == key
    assert loop.time() - done_at >= 0.19


async def test_a_clean_key_is_not_requeued_and_a_fast_one_comes_back_at_once() -> None:
    q = WorkQueue()
    q.add("ns/a")
    q.done(await q.get(), took=5.0)
    assert len(q) == 0
    q.add("ns/a")
    key = await q.get()
    q.add(key)
    q.done(key, took=0.0)
    assert len(q) == 1


async def test_touch_enqueues_only_keys_seen_before_and_forget_drops_them() -> None:
    q = WorkQueue()
    q.touch("ns/unknown")
    assert len(q) == 0
    q.add("ns/a")
    await q.get()
    q.done("ns/a")
    q.touch("ns/a")
    q.touch_all()
    assert len(q) == 1
    q.forget("ns/a")
    q.touch("ns/a")
    q.touch_all()
    assert await _next_or_none(q) is None


async def _next_or_none(q: WorkQueue) -> str | None:
    try:
        return await asyncio.wait_for(q.get(), timeout=0.1)
    except TimeoutError:
        return None
