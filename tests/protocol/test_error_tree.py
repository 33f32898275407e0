"""One exception tree for the three servers: every error class the engine, the sidecar and the
frontend raise to a caller derives from ``drs_protocol.errors.ApiError``, each status class's
``type`` is the one the wire table gives that status, and each answers in the one error body."""

from __future__ import annotations

import inspect
from types import ModuleType

import drs_engine.errors
import drs_frontend.errors
import drs_sidecar.errors
import pytest
from drs_frontend.errors import NoEngineAvailable, RequestError, UpstreamProtocolError
from drs_protocol import errors
from drs_protocol.errors import ApiError, error_body, error_type

STATUS_CLASSES = [
    cls for cls in vars(errors).values() if inspect.isclass(cls) and issubclass(cls, ApiError) and cls is not ApiError
]


def _exception_classes(module: ModuleType) -> list[type[BaseException]]:
    return [
        cls
        for cls in vars(module).values()
        if inspect.isclass(cls) and issubclass(cls, BaseException) and cls.__module__ == module.__name__
    ]


@pytest.mark.parametrize("module", [drs_engine.errors, drs_sidecar.errors, drs_frontend.errors])
def test_every_servers_errors_derive_from_the_one_tree(module: ModuleType) -> None:
    own = _exception_classes(module)
    assert own, f"{module.__name__} defines no errors"
    strays = [cls.__name__ for cls in own if not issubclass(cls, ApiError)]
    assert not strays, f"{module.__name__}: not under drs_protocol.errors.ApiError: {strays}"


def test_each_status_class_has_its_own_status_and_the_wire_tables_type() -> None:
    statuses = [cls.status for cls in STATUS_CLASSES]
    assert len(statuses) == len(set(statuses)) == 9
    for cls in STATUS_CLASSES:
        assert cls.type == error_type(cls.status), cls.__name__
        assert cls("m", param="p").to_body() == error_body(cls.status, "m", param="p")


def test_a_subclass_inherits_its_parents_status_and_may_name_its_own_type() -> None:
    class Leaf(errors.UnavailableError):
        type = "draining"

    class Plain(errors.NotFoundError):
        pass

    assert (Leaf.status, Leaf.type, Plain.status, Plain.type) == (503, "draining", 404, "not_found_error")


def test_the_frontends_errors_answer_the_bodies_it_always_answered() -> None:
    assert RequestError("stream: must be a boolean", param="stream").to_body() == {
        "error": {
            "message": "stream: must be a boolean",
            "type": "invalid_request_error",
            "param": "stream",
            "code": 400,
        }
    }
    none = NoEngineAvailable("decode", ["http://a"])
    assert (none.status, none.to_body()) == (
        503,
        error_body(503, "no decode engine available (tried http://a)", role="decode"),
    )
    broken = UpstreamProtocolError("context response has no choices")
    assert (broken.status, broken.to_body()) == (
        502,
        error_body(502, "engine response: context response has no choices"),
    )
