"""Collective refit: the group's rank layout (pure), and the fan-out over real sim engines (which
join a trainer's gloo group: ``test_sim_collective.py``)."""

from __future__ import annotations

import pytest
from drs_protocol.control import TrainerCollectiveUpdate
from drs_sidecar.collective import group_layout
from drs_sidecar.errors import GroupChanged, NoGroup, NotAllReady
from drs_sidecar.fleet import Engine
from hypothesis import given
from hypothesis import strategies as st

from .conftest import as_engine, refitter_over, sim_engine


def engine(name: str, width: int, ready: bool = True) -> Engine:
    return Engine(name=name, role="prefill", replica=0, url=f"http://{name}:8000", ready=ready, width=width)


def test_engines_take_the_ranks_after_the_trainers_in_status_order() -> None:
    layout = group_layout([engine("r0-p0", 4), engine("r0-d0", 2), engine("r1-p0", 4)], train_world_size=8)
    assert layout.world_size == 8 + 10
    assert [(m.engine.name, m.rank_prefix) for m in layout.members] == [("r0-p0", 0), ("r0-d0", 4), ("r1-p0", 6)]
    engines = layout.as_dict()["engines"]
    assert isinstance(engines, list) and engines[1]["ranks"] == [12, 13]  # train_world_size + rank_prefix + local rank


@given(widths=st.lists(st.integers(min_value=1, max_value=16), min_size=1, max_size=40), train=st.integers(1, 64))
def test_every_rank_of_the_group_belongs_to_exactly_one_worker(widths: list[int], train: int) -> None:
    layout = group_layout([engine(f"e{i}", w) for i, w in enumerate(widths)], train)
    engine_ranks = [train + m.rank_prefix + local for m in layout.members for local in range(m.engine.width)]
    assert sorted(engine_ranks) == list(range(train, layout.world_size))  # no gap, no overlap, after the trainer's


def test_a_group_needs_every_engine_ready_and_says_which_are_not() -> None:
    with pytest.raises(NotAllReady, match="r1-d0") as caught:
        group_layout([engine("r0-p0", 4), engine("r1-d0", 2, ready=False)], train_world_size=8)
    assert caught.value.engines == ["r1-d0"]
    with pytest.raises(ValueError, match="train_world_size"):
        group_layout([engine("r0-p0", 4)], train_world_size=0)
    with pytest.raises(ValueError, match="no engines"):
        group_layout([], train_world_size=8)


async def test_engines_that_cannot_reach_the_trainers_store_fail_the_init_and_form_no_group() -> None:
    """The sim engines join a real gloo group (``test_sim_collective.py``); a store nobody listens
    on fails each engine's join, named, within the step's timeout, and the sidecar keeps no group."""
    import socket

    from drs_sidecar.group_abort import CollectiveSteps

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        async with (
            sim_engine() as a,
            sim_engine("decode") as b,
            refitter_over([as_engine(a), as_engine(b, 1)]) as (refitter, fleet),
        ):
            refitter.steps = CollectiveSteps(refitter.control, 6.0)  # engines 4.8 s, the sidecar waits 5.4 s
            layout, report = await refitter.collective_init("127.0.0.1", port, train_world_size=8)
            assert layout.world_size == 10
            assert not report.complete
            assert all(f"127.0.0.1:{port}" in o.detail for o in report.outcomes), report.as_dict()
            assert refitter.group is None
            with pytest.raises(NoGroup):
                await refitter.collective_update(TrainerCollectiveUpdate(version="step-5"))
            with pytest.raises(NoGroup):
                await refitter.collective_prepare({"w": ([2, 2], "bfloat16")})  # NeMo RL's [shape, dtype]
            assert fleet.published == []


async def test_a_collective_step_checks_the_groups_members_first_and_names_what_changed() -> None:
    """Before every collective step the fleet is compared with the group: a member not ready, gone,
    or an engine added (scale-up) refuses the step before any engine is called (it would wait for
    the missing rank) and drops the group, so the next collective/init forms it from the fleet."""
    async with sim_engine() as a, sim_engine("decode") as b, sim_engine() as c:
        engines = [as_engine(a), as_engine(b, 1)]
        async with refitter_over(list(engines)) as (refitter, fleet):
            refitter.group = group_layout(engines, train_world_size=1)
            fleet.list[1] = as_engine(b, 1, ready=False)
            with pytest.raises(GroupChanged, match=f"{b.url} is not ready") as caught:
                await refitter.collective_update(TrainerCollectiveUpdate(version="step-5"))
            assert caught.value.status == 409 and refitter.group is None
            assert fleet.desires == [], "refused before anything was stored or called"
            refitter.group = group_layout(engines, train_world_size=1)
            fleet.list[1] = as_engine(b, 1)
            fleet.list.append(as_engine(c, 1))
            with pytest.raises(GroupChanged, match=f"{c.url} joined the fleet"):
                await refitter.collective_prepare({"w": [[2], "float32"]})
            assert refitter.group is None
