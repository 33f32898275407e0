"""Port bases: a cluster's ports stay out of the kernel's ephemeral range (pure, plus a refusal
before ``drs dev up`` starts anything)."""

from __future__ import annotations

from pathlib import Path

import pytest
from drs_devcluster import nodeconfig, portrange, testing
from drs_devcluster.cluster import DevCluster
from drs_devcluster.layout import DEFAULT_PORT_BASE

EPHEMERAL = (32768, 60999)


def test_a_base_below_the_ephemeral_range_passes() -> None:
    portrange.check("DRS_TEST_PORT_BASE", 32768 - 108, 108, EPHEMERAL)


@pytest.mark.parametrize("base", [33100, 32768 - 107, 60999], ids=["inside", "last port reaches in", "last port"])
def test_a_base_whose_ports_meet_the_ephemeral_range_is_refused_naming_the_setting_and_rule(base: int) -> None:
    with pytest.raises(portrange.PortBaseError) as err:
        portrange.check("DRS_TEST_PORT_BASE", base, 108, EPHEMERAL)
    msg = str(err.value)
    assert msg.startswith(f"DRS_TEST_PORT_BASE={base}: ")
    assert "ephemeral port range 32768-60999" in msg and "ip_local_port_range" in msg
    assert "pick a base from 1024 to 32660" in msg


def test_reserved_ports_may_be_used_inside_the_ephemeral_range() -> None:
    reserved = portrange.parse_reserved("33000-33200,40000\n")
    portrange.check("DRS_TEST_PORT_BASE", 33000, 108, EPHEMERAL, reserved)
    with pytest.raises(portrange.PortBaseError, match="at 33201-33207"):
        portrange.check("DRS_TEST_PORT_BASE", 33100, 108, EPHEMERAL, reserved)


@pytest.mark.parametrize("base", [80, 65500])
def test_a_base_outside_1024_65535_is_refused(base: int) -> None:
    with pytest.raises(portrange.PortBaseError, match=r"must lie within 1024-65535"):
        portrange.check("--port-base", base, 108, EPHEMERAL)


def test_parsers_read_the_sysctl_formats() -> None:
    assert portrange.parse_range("32768\t60999\n") == (32768, 60999)
    assert portrange.parse_reserved("") == frozenset()
    assert portrange.parse_reserved("8000-8002,9000") == {8000, 8001, 8002, 9000}


def test_the_default_bases_and_the_test_session_fit_this_machine() -> None:
    portrange.check_here("DRS_DEV_PORT_BASE", DEFAULT_PORT_BASE, nodeconfig.CLUSTER_PORT_SPAN)
    testing.check_test_ports(27300)
    assert testing.TEST_PORT_SPAN == 80 + 2 * nodeconfig.CLUSTER_PORT_SPAN == 136
    assert testing.CLI_PORT_BASE + nodeconfig.CLUSTER_PORT_SPAN == testing.TEST_PORT_BASE + testing.TEST_PORT_SPAN


def test_the_harness_refuses_a_test_base_in_the_ephemeral_range() -> None:
    with pytest.raises(portrange.PortBaseError, match=r"^DRS_TEST_PORT_BASE=33100: "):
        testing.check_test_ports(33100)


def test_dev_up_refuses_such_a_base_before_starting_anything(tmp_path: Path) -> None:
    low, _ = portrange.machine_ranges()[0]
    cluster = DevCluster.at(tmp_path / "dev", low)
    with pytest.raises(portrange.PortBaseError, match=rf"^--port-base={low}: "):
        cluster.up("hgx", 1, build_if_missing=False)
    assert not (tmp_path / "dev").exists()
