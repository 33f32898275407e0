"""The weights digest computed by torch equals the pure reference (:mod:`drs_protocol.weights_digest`):
on the CPU here (property test), on a GPU in ``test_cuda_…``; and a torch engine reports the
digest of what it holds."""

from __future__ import annotations

import itertools

import httpx
import pytest
from drs_engine.server.runner import start_engine
from drs_engine.weights.digest import fused_digest
from drs_protocol import weights_digest as wd
from hypothesis import given, settings
from hypothesis import strategies as st

from .conftest import CONTROL_TOKEN, auth, torch_config

SIZES = st.one_of(
    st.integers(0, 80),
    st.integers(wd.CHUNK_BYTES - 12, wd.CHUNK_BYTES + 12),
    st.integers(17 * wd.CHUNK_BYTES - 5, 17 * wd.CHUNK_BYTES + 5),  # past TORCH_ROWS_PER_STEP rows
)


@settings(max_examples=20, deadline=None)
@given(SIZES, st.integers(0, 7), st.integers(0, 2**31 - 1), st.lists(st.integers(0, 40 * wd.CHUNK_BYTES), max_size=4))
def test_torch_on_the_cpu_computes_the_reference_digest(size: int, offset: int, seed: int, cuts: list[int]) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed)
    backing = torch.randint(0, 256, (size + offset,), dtype=torch.uint8, generator=generator)
    flat = backing[offset:]  # an unaligned start, as a slice of a packed buffer may have
    reference = wd.digest_numpy(flat.numpy().tobytes())
    assert wd.digest_torch(flat) == reference
    assert fused_digest(flat) == reference  # the engine's one-pass form, uncompiled on the CPU
    if size < 4 * wd.CHUNK_BYTES:
        assert wd.digest_bytes(flat.numpy().tobytes()) == reference
    bounds = sorted({0, size, *(c % (size + 1) for c in cuts)})
    pieces = [flat[a:b] for a, b in itertools.pairwise(bounds)]  # tensors in layout order
    assert wd.digest_torch_tensors(pieces) == reference
    streamed = wd.TorchDigester()  # as the trtllm worker extension digests its batches
    for piece in pieces:
        streamed.update(piece)
    assert streamed.total_bytes == size and streamed.hexdigest() == reference


def test_tensors_of_other_dtypes_digest_as_their_bytes() -> None:
    import torch

    a = torch.arange(1000, dtype=torch.float32)
    b = torch.arange(333, dtype=torch.bfloat16)
    raw = a.view(torch.uint8).numpy().tobytes() + b.view(torch.uint8).numpy().tobytes()
    assert wd.digest_torch_tensors([a, b]) == wd.digest_bytes(raw)


@pytest.mark.gpu
def test_cuda_computes_the_reference_digest() -> None:
    import torch

    size = 64 * wd.CHUNK_BYTES + 12345
    flat = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    reference = wd.digest_numpy(flat.cpu().numpy().tobytes())
    assert wd.digest_torch(flat) == reference
    assert wd.digest_torch(flat[3:]) == wd.digest_numpy(flat[3:].cpu().numpy().tobytes())
    assert wd.digest_torch_tensors([flat[:1000], flat[1000:]]) == reference
    assert fused_digest(flat) == reference  # compiled by inductor: one read of each chunk
    assert fused_digest(flat[3:]) == wd.digest_numpy(flat[3:].cpu().numpy().tobytes())
    assert fused_digest(flat[: 5 * wd.CHUNK_BYTES]) == wd.digest_numpy(
        flat[: 5 * wd.CHUNK_BYTES].cpu().numpy().tobytes()
    )
    assert fused_digest(flat, compiled=False) == reference


async def test_a_torch_engine_reports_the_digest_of_its_packed_weights() -> None:
    from drs_engine.weights.digest import torch_weights_digest

    async with (
        start_engine(torch_config("prefill"), control_token=CONTROL_TOKEN) as engine,
        httpx.AsyncClient(timeout=60) as client,
    ):
        held = (await client.get(engine.url + "/control/weights", headers=auth())).json()
        weights = engine.server.state.require_backend()._weights.packed  # type: ignore[attr-defined]
        assert held["weights_digest"] == torch_weights_digest(weights.flat, weights.params)
        assert held["weights_digest"] == wd.digest_numpy(weights.flat.cpu().numpy().tobytes())
