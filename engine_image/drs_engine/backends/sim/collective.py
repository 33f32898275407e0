"""The ``sim`` backend's collective refit (part of the test double): a real gloo broadcast on the CPU.

A sim fleet receives path-less weights the way a ``torch`` engine on the CPU does: it joins the
trainer's ``torch.distributed`` group over gloo (:func:`drs_engine.backends.torch.weights.refit.join_group`:
the trainer's TCPStore, rank ``train_world_size + rank_prefix``), takes any ``state_dict_info``
(a sim engine has no model to check it against) and receives every batch by broadcast from rank
0 into host memory, each within the step's deadline. The bytes, in the one refit layout
(:mod:`drs_protocol.weights_pack`), become the engine's weights only once all of them arrived:
one part per tensor (its name, its bytes), so their digest is the trainer's digest of what it sent,
their content hash is the one a peer stream of the same parts gives (the engine generates a
peer's tokens), and the engine sends them on to a peer catching up (:mod:`.stream`).

What it does not model: NCCL (gloo only: ``join_group`` refuses a trainer's NCCL group on the CPU), GPU memory, an
in-place update (nothing is swapped before the last batch, so a failed broadcast leaves the
weights held before: never half-loaded), and the time a real engine takes to apply the bytes
beyond the latency model's ``weights_load``. torch is imported on the first ``init_collective``:
a sim engine without it refuses the collective (501), as before.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Final

from drs_protocol.control import CollectiveInit, CollectiveUpdate, PrepareRefitInfo
from drs_protocol.nemo_rl_refit import RefitSpecError, TensorSpec, parse_state_dict_info
from drs_protocol.weights_digest import Digester
from drs_protocol.weights_pack import batch_ranges

from drs_engine.backends.sim.weights import MAX_HASHED_BYTES_PER_FILE, SimWeights, content_hasher, hash_file_start
from drs_engine.errors import BadRequestError, CollectiveError, NotSupportedError

#: Seconds past a step's ``timeout_s`` the event loop waits for the receiving thread before it
#: gives up on it (gloo fails the operation by the timeout it was given).
BACKSTOP_S: Final = 5.0


@dataclass
class _Member:
    group: Any  #: drs_engine.backends.torch.weights.refit.RefitGroup
    specs: list[TensorSpec] | None = None


class SimCollective:
    """A sim engine's membership in a trainer's gloo refit group."""

    def __init__(self) -> None:
        self._member: _Member | None = None

    async def init(self, params: CollectiveInit) -> dict[str, Any]:
        refit = _refit_module()
        rank = refit.engine_rank(params)
        self.abort()
        import torch

        group = await refit.join_within(params, torch.device("cpu"))
        self._member = _Member(group)
        return {"rank": rank, "world_size": params.world_size, "backend": group.backend}

    def prepare(self, params: PrepareRefitInfo) -> dict[str, Any]:
        member = self._require()
        try:
            member.specs = parse_state_dict_info(params.state_dict_info)
        except RefitSpecError as exc:
            raise BadRequestError(str(exc), param="state_dict_info") from exc
        return {"tensors": len(member.specs), "bytes": sum(s.nbytes for s in member.specs)}

    async def update(self, params: CollectiveUpdate) -> SimWeights:
        """The weights the trainer broadcast, once every batch arrived within ``params.timeout_s``;
        on a failure the group is left (the next update needs a new ``init``) and nothing changed."""
        member = self._require()
        if member.specs is None:
            raise BadRequestError("update_weights_from_collective before prepare_refit_info")
        deadline = time.monotonic() + params.timeout_s
        receiving = asyncio.ensure_future(asyncio.to_thread(_receive, member, deadline))
        try:
            flat = await asyncio.wait_for(asyncio.shield(receiving), params.timeout_s + BACKSTOP_S)
        except TimeoutError:
            self.abort()
            raise CollectiveError(f"the update's broadcast did not end within {params.timeout_s:g}s") from None
        except CollectiveError:
            if self._member is member:
                self.abort()
            raise
        return _weights(params.version, member.specs, flat)

    def abort(self) -> bool:
        """Abort and forget the group (an update in flight fails by its deadline); whether there was one."""
        member, self._member = self._member, None
        if member is None:
            return False
        refit = _refit_module()
        refit.abort_group(member.group)
        refit.leave_group(member.group)
        return True

    def _require(self) -> _Member:
        if self._member is None:
            raise BadRequestError("no collective group: call init_collective first")
        return self._member


def _refit_module() -> Any:
    try:
        from drs_engine.backends.torch.weights import refit
    except ImportError as exc:  # torch is the gpu extra's
        raise NotSupportedError(
            f"the sim backend's collective refit needs torch (gloo on the CPU), which is not installed: {exc}"
        ) from exc
    return refit


def _receive(member: _Member, deadline: float) -> bytes:
    """Every batch, in order, into one host buffer (blocks: run in a thread)."""
    import torch

    refit = _refit_module()
    assert member.specs is not None
    ranges = batch_ranges(member.specs, member.group.target_bytes)
    flat = bytearray()
    for i, (start, end, _) in enumerate(ranges):
        buffer = torch.empty(end - start, dtype=torch.uint8)
        try:
            refit.broadcast_within(member.group.group, buffer, deadline)
        except (RuntimeError, TimeoutError) as exc:
            raise CollectiveError(
                f"rank {member.group.rank}: batch {i + 1}/{len(ranges)} of the trainer's broadcast did not arrive "
                f"by the step's deadline: {exc}"
            ) from exc
        flat += buffer.numpy().tobytes()
    return bytes(flat)


def _weights(version: str, specs: list[TensorSpec], flat: bytes) -> SimWeights:
    """``flat`` (the refit layout) as sim weights: one part per tensor, hashed as a peer stream is."""
    digester, hasher = Digester(), content_hasher()
    digester.update(flat)
    parts: list[tuple[str, bytes]] = []
    at = 0
    for spec in specs:
        part = flat[at : at + spec.nbytes]
        at += spec.nbytes
        hash_file_start(hasher, spec.name, len(part))
        hasher.update(part[:MAX_HASHED_BYTES_PER_FILE])
        parts.append((spec.name, part))
    return SimWeights(
        version=version,
        content_hash=hasher.digest(),
        source="collective broadcast",
        digest=digester.hexdigest(),
        parts=tuple(parts),
        loaded=True,
    )
