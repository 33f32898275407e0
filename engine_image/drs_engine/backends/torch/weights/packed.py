"""A ``torch`` model's weights as one packed buffer, laid out as every refit packs them.

:func:`pack` puts the parameters into one flat ``uint8`` tensor in the refit layout
(:mod:`drs_protocol.weights_pack`: the names' order, no padding) and hands back views of it, which
the model uses as its parameters. A refit batch whose tensors are the same names, shapes and
dtypes in the same order is then one contiguous range of that buffer: it is received or copied in
one piece (:meth:`PackedWeights.copy_batch`), or an NCCL broadcast lands in it directly
(:meth:`PackedWeights.target`), instead of once per tensor. Any other batch (another order, dtype
or a subset) falls back to a copy per tensor. The example trainer packs its weights the same way,
so the buffers it shares or broadcasts are its parameters themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from drs_protocol.nemo_rl_refit import Slot, TensorSpec, dtype_name
from drs_protocol.weights_pack import flat_slots

from drs_engine.backends.torch.model import DTYPES


@dataclass
class PackedWeights:
    """Parameters as views of one buffer (``flat`` None: kept as separate tensors, unaligned)."""

    params: dict[str, Any]
    flat: Any = None
    #: name -> its place in ``flat``
    slots: dict[str, Slot] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(int(t.numel()) * int(t.element_size()) for t in self.params.values())

    def _offset_of(self, batch: list[Slot]) -> int | None:
        """Where ``batch`` (offsets relative to its start) lies in ``flat``, when it is one range of it."""
        if self.flat is None or not batch:
            return None
        first = self.slots.get(batch[0].spec.name)
        if first is None:
            return None
        delta = first.offset - batch[0].offset
        for slot in batch:
            mine = self.slots.get(slot.spec.name)
            if mine is None or mine.spec != slot.spec or mine.offset - slot.offset != delta:
                return None
        return delta

    def target(self, batch: list[Slot], nbytes: int) -> Any | None:
        """The range of ``flat`` that ``batch`` fills, to receive it in place (None: it is not one)."""
        start = self._offset_of(batch)
        return None if start is None else self.flat[start : start + nbytes]

    def copy_batch(self, batch: list[Slot], buffer: Any) -> bool:
        """Copy ``batch``'s tensors out of ``buffer`` (a packed ``uint8`` tensor, maybe another
        GPU's or process's) into the weights; True when it took one copy."""
        nbytes = int(buffer.numel())
        place = self.target(batch, nbytes)
        if place is not None:
            place.copy_(buffer, non_blocking=True)
            return True
        for slot in batch:
            spec = slot.spec
            raw = buffer[slot.offset : slot.offset + spec.nbytes]
            if slot.offset % _itemsize(spec.dtype):
                raw = raw.clone()  # a view as a wider dtype needs an aligned start
            self.params[spec.name].copy_(raw.view(_torch_dtype(spec.dtype)).view(spec.shape), non_blocking=True)
        return False


def specs_of(params: dict[str, Any]) -> list[TensorSpec]:
    return [TensorSpec(n, tuple(t.shape), dtype_name(t.dtype)) for n, t in params.items()]


def pack(params: dict[str, Any], device: Any) -> PackedWeights:
    """``params`` (on any device) copied into one buffer on ``device``, in their order."""
    specs = specs_of(params)
    slots = flat_slots(specs)
    if any(s.offset % _itemsize(s.spec.dtype) for s in slots):
        return PackedWeights({n: t.to(device) for n, t in params.items()})
    total = sum(s.nbytes for s in specs)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    views: dict[str, Any] = {}
    for slot in slots:
        spec = slot.spec
        view = flat[slot.offset : slot.offset + spec.nbytes].view(_torch_dtype(spec.dtype)).view(spec.shape)
        view.copy_(params[spec.name])
        views[spec.name] = view
    return PackedWeights(views, flat, {s.spec.name: s for s in slots})


def _torch_dtype(name: str) -> Any:
    return DTYPES.get(name) or getattr(torch, name)


def _itemsize(name: str) -> int:
    return int(torch.empty((), dtype=_torch_dtype(name)).element_size())
