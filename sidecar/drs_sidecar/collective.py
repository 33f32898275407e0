"""NCCL (collective) refit: the trainer broadcasts weights straight into every engine's GPUs.

This is NeMo RL's non-colocated refit. Every GPU of every engine joins one NCCL group with the
trainer's ranks, and the trainer broadcasts the tensors. The engines' control API exposes the three
steps (``/control/collective/{init,prepare,update}``, trtllm backend); the sidecar computes each
engine's place in the group and calls all engines at once.

Ranks follow NeMo RL's workers: a worker's rank is ``train_world_size + rank_prefix +
local_rank``, so the trainer holds ranks ``0 … train_world_size-1`` and the engines follow in
status order (replica-major, prefill before decode). An engine's ``rank_prefix`` is the GPUs of
the engines before it, and ``world_size = train_world_size + every engine's width``.
:func:`group_layout` is that arithmetic, kept pure.

A group forms only when every member joins. So a collective step needs every engine ready (else
it is refused before any call, naming the engines that are not), and it calls all engines at
once, never through the refit's concurrency limit: with a limit, engines waiting inside the
group's init would hold the slots that the others need to join. The trainer joins with its own
ranks while its call to the sidecar is in flight. Each step is bounded and a failed one aborted on
every member, naming the culprit: :mod:`drs_sidecar.group_abort`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from drs_sidecar.errors import NotAllReady, Refused
from drs_sidecar.fleet import Engine


@dataclass(frozen=True, slots=True)
class GroupMember:
    engine: Engine
    rank_prefix: int  #: the engine's first rank is train_world_size + rank_prefix


@dataclass(frozen=True, slots=True)
class GroupLayout:
    train_world_size: int
    world_size: int
    members: list[GroupMember]

    def as_dict(self) -> dict[str, object]:
        return {
            "train_world_size": self.train_world_size,
            "world_size": self.world_size,
            "engines": [
                {
                    "engine": m.engine.name,
                    "width": m.engine.width,
                    "rank_prefix": m.rank_prefix,
                    "ranks": [
                        self.train_world_size + m.rank_prefix,
                        self.train_world_size + m.rank_prefix + m.engine.width - 1,
                    ],
                }
                for m in self.members
            ],
        }


def membership_changes(layout: GroupLayout, engines: Sequence[Engine]) -> list[str]:
    """How the fleet now differs from ``layout``'s members (empty: every member is still there,
    ready, at the same URL and width, and no engine was added)."""
    now = {e.name: e for e in engines}
    changes: list[str] = []
    for member in layout.members:
        engine = now.get(member.engine.name)
        if engine is None:
            changes.append(f"{member.engine.name} is gone")
        elif not (engine.ready and engine.url):
            changes.append(f"{engine.name} is not ready")
        elif engine.url != member.engine.url or engine.width != member.engine.width:
            changes.append(f"{engine.name} moved ({member.engine.url} -> {engine.url})")
    members = {m.engine.name for m in layout.members}
    changes += [f"{e.name} joined the fleet" for e in engines if e.name not in members]
    return changes


def group_layout(engines: Sequence[Engine], train_world_size: int) -> GroupLayout:
    """Each engine's ``rank_prefix`` and the group's ``world_size`` (``NotAllReady`` if any is
    not ready; :class:`Refused` for no engines or a trainer without ranks)."""
    if train_world_size < 1:
        raise Refused("train_world_size: must be at least 1 (the trainer's ranks broadcast)")
    if not engines:
        raise Refused("no engines: the DisaggReplicaSet has none placed")
    missing = [e for e in engines if not (e.ready and e.url)]
    if missing:
        raise NotAllReady([e.name for e in missing])
    members: list[GroupMember] = []
    offset = 0
    for engine in engines:
        members.append(GroupMember(engine, offset))
        offset += engine.width
    return GroupLayout(train_world_size, train_world_size + offset, members)
