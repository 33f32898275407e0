"""No function in non-test code is over 80 lines and no module over 500 (``scripts/check_sizes``).

``KNOWN_OVER`` names what is over today, each with why it is not split yet; the test fails for
anything else over the bounds, and for an entry of the list that is no longer over (so the list
only shrinks).
"""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: Over the bounds when the check was added (issue 16), landed by other issues the same night.
KNOWN_OVER: dict[str, str] = {}


def _check_sizes() -> dict[str, Any]:
    """The script's functions and bounds (it is a script, not a module: run it without ``__main__``)."""
    return runpy.run_path(str(ROOT / "scripts" / "check_sizes"), run_name="check_sizes")


def _key(problem: str) -> str:
    """``function path:line name: N lines`` -> ``function path name`` (line numbers move)."""
    what, rest = problem.split(" ", 1)
    where = rest.split(":", 1)[0]
    if what == "function":
        name = rest.split(" ", 2)[1].rstrip(":")
        return f"function {where} {name}"
    return f"module {where}"


def test_no_function_over_80_lines_and_no_module_over_500_but_the_known_ones() -> None:
    found = {_key(p): p for p in _check_sizes()["problems"]()}
    new = [p for key, p in found.items() if key not in KNOWN_OVER]
    assert not new, "split these into named steps or modules:\n" + "\n".join(new)
    fixed = [key for key in KNOWN_OVER if key not in found]
    assert not fixed, f"no longer over the bounds: remove from KNOWN_OVER: {fixed}"


def test_the_check_counts_a_long_function() -> None:
    sizes = _check_sizes()
    assert (sizes["MAX_FUNCTION_LINES"], sizes["MAX_MODULE_LINES"]) == (80, 500)
    functions = dict((where, n) for n, where in sizes["function_sizes"]())
    assert any(where.endswith(" compute_status") and 10 < n <= 80 for where, n in functions.items())
    assert max(n for n, _ in sizes["module_sizes"]()) > 100
