"""The weights digest (pure): the reference, the NumPy path and the streaming digester agree on
every input, and the digest moves with every byte, every order and the length."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from drs_protocol import weights_digest as wd
from hypothesis import given, settings
from hypothesis import strategies as st

# sizes around the lane and chunk boundaries, and a few chunks
SIZES = st.one_of(
    st.integers(0, 64),
    st.integers(wd.CHUNK_BYTES - 16, wd.CHUNK_BYTES + 16),
    st.integers(2 * wd.CHUNK_BYTES - 9, 2 * wd.CHUNK_BYTES + 9),
)


@settings(max_examples=25, deadline=None)
@given(SIZES, st.integers(0, 2**32 - 1), st.lists(st.integers(1, 3 * wd.CHUNK_BYTES), max_size=6))
def test_the_reference_numpy_and_streaming_digests_agree(size: int, seed: int, cuts: list[int]) -> None:
    data = (seed.to_bytes(4, "little") * (size // 4 + 1))[:size]
    data = bytes(b ^ (i % 251) for i, b in enumerate(data)) if size < 4096 else os.urandom(size)
    reference = wd.digest_bytes(data)
    assert wd.digest_numpy(data) == reference
    digester = wd.Digester()
    start = 0
    for cut in sorted(c % (size + 1) for c in cuts):
        digester.update(data[start:cut])
        start = max(start, cut)
    digester.update(data[start:])
    assert digester.total_bytes == size
    assert digester.hexdigest() == reference
    assert wd.check_digest(reference) == reference


def test_every_byte_every_order_and_the_length_change_the_digest() -> None:
    data = bytearray(os.urandom(wd.CHUNK_BYTES + 100))
    base = wd.digest_numpy(data)
    for where in (0, 7, 8, wd.CHUNK_BYTES - 1, wd.CHUNK_BYTES, len(data) - 1):
        flipped = bytearray(data)
        flipped[where] ^= 1
        assert wd.digest_numpy(flipped) != base, where
    swapped = bytearray(data)
    swapped[0:8], swapped[8:16] = data[8:16], data[0:8]  # two lanes of one chunk trade places
    assert wd.digest_numpy(swapped) != base
    chunks = bytearray(data[wd.CHUNK_BYTES :]) + data[: wd.CHUNK_BYTES]  # chunks in another order
    assert wd.digest_numpy(chunks) != base
    assert wd.digest_numpy(data + b"\0") != base, "trailing zero bytes count (the length is hashed)"
    assert wd.digest_bytes(b"") != wd.digest_bytes(b"\0")


def test_a_known_value_pins_the_function() -> None:
    """The function is a contract between processes (engines, trainer, sidecar): it never changes
    silently. Lane weights are SplitMix64 of i + 1, made odd."""
    assert wd.lane_weights()[:2] == (0x910A2DEC89025CC1 | 1, 0x975835DE1C9756CE | 1)
    assert wd.digest_bytes(b"") == "wd1:44e5ffaa421d9d2ecc535e43c07e3dcff2b5e304b175f7dffb8fe6a4ac0cd611"
    assert wd.digest_bytes(bytes(range(256)) * 4097) == wd.digest_numpy(bytes(range(256)) * 4097)


def test_files_digest_as_their_bytes_one_after_the_other(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.bin").write_bytes(b"second")
    (tmp_path / "a.bin").write_bytes(b"first")
    assert wd.digest_files(tmp_path) == wd.digest_bytes(b"firstsecond")
    assert wd.digest_files(tmp_path / "a.bin") == wd.digest_bytes(b"first")


@pytest.mark.parametrize("bad", ["", "wd1:", "wd1:" + "A" * 64, "sha256:" + "0" * 64, "wd1:" + "0" * 63])
def test_a_digest_of_another_format_is_refused(bad: str) -> None:
    with pytest.raises(wd.DigestFormatError):
        wd.check_digest(bad)


def test_a_backend_report_becomes_its_result_model_with_its_own_figures() -> None:
    from drs_protocol.control import MemoryReleased, WeightsChanged, result_of

    report = {"version": "v2", "previous_version": "v1", "bytes": 12, "seconds": 0.5, "source": "/ckpt"}
    changed = result_of(WeightsChanged, report)
    assert (changed.version, changed.previous_version) == ("v2", "v1")
    assert changed.figures == {"bytes": 12, "seconds": 0.5, "source": "/ckpt"}
    released = result_of(MemoryReleased, {"released": ["model"], "gpu_allocated_bytes": 7, "gpu_free_bytes_after": 9})
    assert released.gpu_allocated_bytes == 7 and released.figures == {"gpu_free_bytes_after": 9}
    with pytest.raises(ValueError, match="not JSON scalars: nested"):
        result_of(WeightsChanged, {**report, "nested": {"a": 1}})
    with pytest.raises(ValueError):
        result_of(WeightsChanged, {"previous_version": "v1"})  # the named field is missing
