"""A dev or test cluster's ports stay out of the kernel's ephemeral port range.

The kernel hands out source ports for outgoing connections from ``net.ipv4.ip_local_port_range``
(32768-60999 by default). A cluster whose fixed listening ports lie in that range sometimes fails
to start with "address already in use": some other connection on the machine (another cluster's
client, a kubelet, pip) happens to hold that port as its source port at that moment. With five
test sessions in parallel this happened. So a port base whose ports reach into that range is
refused before anything starts, naming the setting and the rule; ports the administrator
reserved (``net.ipv4.ip_local_reserved_ports``) are never handed out and so are allowed.

The harness does not write ``ip_local_reserved_ports`` itself: it is one machine-wide list, so
parallel sessions would race on reading and rewriting it, and a killed run would leave its
reservation behind. Bases below 32768 need no reservation at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

#: Where Linux publishes its ephemeral range and the ports excluded from it.
LOCAL_PORT_RANGE: Final = Path("/proc/sys/net/ipv4/ip_local_port_range")
RESERVED_PORTS: Final = Path("/proc/sys/net/ipv4/ip_local_reserved_ports")
#: Linux's default ephemeral range, used where the file cannot be read.
LINUX_DEFAULT_RANGE: Final = (32768, 60999)
#: Below this, binding needs root on most systems and well-known services live.
MIN_PORT: Final = 1024


class PortBaseError(ValueError):
    """A port base whose ports cannot be used; the message names the setting and the rule."""


def parse_range(text: str) -> tuple[int, int]:
    """``"32768\\t60999"`` -> ``(32768, 60999)``."""
    low, high = (int(part) for part in text.split())
    return low, high


def parse_reserved(text: str) -> frozenset[int]:
    """``"8000-8002,9000"`` (the sysctl's format) -> the ports it names."""
    out: set[int] = set()
    for item in text.strip().split(","):
        if not item:
            continue
        first, _, last = item.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return frozenset(out)


def check(
    setting: str,
    base: int,
    span: int,
    ephemeral: tuple[int, int] = LINUX_DEFAULT_RANGE,
    reserved: frozenset[int] = frozenset(),
) -> None:
    """Refuse ``base .. base + span - 1`` if it leaves 1024-65535 or meets the ephemeral range
    outside the reserved ports. ``setting`` names where the base came from."""
    last = base + span - 1
    if base < MIN_PORT or last > 65535:
        raise PortBaseError(f"{setting}={base}: its ports {base}-{last} must lie within {MIN_PORT}-65535")
    low, high = ephemeral
    clash = [p for p in range(max(base, low), min(last, high) + 1) if p not in reserved]
    if clash:
        raise PortBaseError(
            f"{setting}={base}: its ports {base}-{last} meet the kernel's ephemeral port range {low}-{high} "
            f"(net.ipv4.ip_local_port_range) at {clash[0]}-{clash[-1]}, where outgoing connections take "
            f"their source ports, so the cluster would sometimes fail to start with a port in use; pick a "
            f"base from {MIN_PORT} to {low - span} (or reserve those ports in net.ipv4.ip_local_reserved_ports)"
        )


def machine_ranges() -> tuple[tuple[int, int], frozenset[int]]:
    """This machine's ephemeral range and reserved ports (Linux's defaults where unreadable)."""
    try:
        ephemeral = parse_range(LOCAL_PORT_RANGE.read_text())
    except (OSError, ValueError):
        ephemeral = LINUX_DEFAULT_RANGE
    try:
        reserved = parse_reserved(RESERVED_PORTS.read_text())
    except (OSError, ValueError):
        reserved = frozenset()
    return ephemeral, reserved


def check_here(setting: str, base: int, span: int) -> None:
    """:func:`check` against this machine's ranges."""
    ephemeral, reserved = machine_ranges()
    check(setting, base, span, ephemeral, reserved)
