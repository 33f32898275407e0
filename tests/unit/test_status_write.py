"""The operator's status write: the merge patch it sends takes the stored status to the new one."""

from __future__ import annotations

from typing import Any

from drs_operator.status_write import status_patch
from hypothesis import given
from hypothesis import strategies as st

#: JSON values as :func:`status_dict` leaves them: no nulls (``exclude_none``).
SCALARS = st.one_of(st.booleans(), st.integers(), st.text(max_size=4))
KEYS = st.sampled_from(["a", "b", "c", "d"])
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(KEYS, inner, max_size=4)),
    max_leaves=12,
)
STATUSES = st.dictionaries(KEYS, VALUES, max_size=4)


def merge(target: Any, patch: Any) -> Any:
    """RFC 7386 ``MergePatch``, as the API server applies a ``merge-patch+json`` body."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge(out.get(key), value)
    return out


@given(old=STATUSES, new=STATUSES)
def test_the_patch_takes_the_stored_status_to_the_new_one_at_every_depth(
    old: dict[str, Any], new: dict[str, Any]
) -> None:
    patch = status_patch(new, old)
    if patch is None:
        assert new == old
    else:
        assert merge(old, patch) == new


def test_a_refit_from_a_peer_after_one_by_path_leaves_no_path_in_status() -> None:
    by_path = {"weights": {"version": "3", "desired": {"version": "3", "path": "/ckpt/3", "digest": "d3"}}}
    from_peer = {"weights": {"version": "4", "desired": {"version": "4", "digest": "d4"}}}
    patch = status_patch(from_peer, by_path)
    assert patch == {"weights": {"version": "4", "desired": {"version": "4", "digest": "d4", "path": None}}}
    assert merge(by_path, patch) == from_peer
