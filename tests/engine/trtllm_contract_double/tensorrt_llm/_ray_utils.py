"""CONTRACT TEST DOUBLE: ``control_action_decorator`` (identity here)."""

from typing import Any


def control_action_decorator(func: Any) -> Any:
    return func
