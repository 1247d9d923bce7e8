"""Several local addresses: the flags and TOML that give them, how paths are paired, the path map."""

from __future__ import annotations

import ipaddress
import subprocess
import sys

import pytest

from udpverbs.daemon import config, paths
from udpverbs.daemon.paths import LocalAddress, PathMap, pair_addresses, parse_addresses, subnet_of


def net(text: str) -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network(text, strict=False)


# -- flags and TOML -------------------------------------------------------------------
def test_addr_is_repeatable_and_the_first_is_the_gid() -> None:
    cfg = config.configure(["--addr", "10.1.0.1/24", "--addr", "10.2.0.1", "--port", "0"])
    assert cfg["addr"] == "10.1.0.1"
    assert cfg["addrs"] == [LocalAddress("10.1.0.1", net("10.1.0.0/24")), LocalAddress("10.2.0.1", None)]
    dc = config.DeviceConfig(addr=cfg["addr"], addrs=cfg["addrs"])
    assert dc.addr == "10.1.0.1" and len(dc.addrs) == 2


def test_one_addr_stays_one_address() -> None:
    cfg = config.configure(["--addr", "127.0.0.9"])
    assert cfg["addr"] == "127.0.0.9" and cfg["addrs"] == [LocalAddress("127.0.0.9", None)]
    assert config.configure([])["addrs"] == [LocalAddress("127.0.0.1", None)]
    assert config.DeviceConfig(addr="127.0.0.9").addrs == [LocalAddress("127.0.0.9", None)]


def test_toml_takes_a_list_or_a_string_and_flags_replace_it(tmp_path) -> None:
    f = tmp_path / "d.toml"
    f.write_text('addr = ["192.168.7.2/24", "192.168.8.2/24"]\n')
    cfg = config.configure(["--config", str(f)])
    assert [str(a) for a in cfg["addrs"]] == ["192.168.7.2/24", "192.168.8.2/24"]
    assert cfg["addrs"][1].network == net("192.168.8.0/24")
    cfg = config.configure(["--config", str(f), "--addr", "127.0.0.9"])
    assert [str(a) for a in cfg["addrs"]] == ["127.0.0.9"]
    f.write_text('addr = "192.168.7.2"\n')
    assert config.configure(["--config", str(f)])["addr"] == "192.168.7.2"


@pytest.mark.parametrize("value,why", [
    (["10.0.0.1", "10.0.0.1"], "given twice"),
    (["10.0.0.1", "10.0.0.1/24"], "given twice"),
    (["10.0.0.1", "nonsense"], "expected an IPv4 address"),
    (["10.0.0.1/33"], "expected an IPv4 address"),
    (["::1"], "expected an IPv4 address"),
    ([], "non-empty list"),
    ([f"10.0.0.{i}" for i in range(1, 10)], "at most 8"),
    (["0.0.0.0", "10.0.0.1"], "wildcard"),
    ([5], "as text"),
])
def test_bad_addresses_are_refused_with_a_reason(value, why) -> None:
    with pytest.raises(ValueError, match=why):
        parse_addresses(value)


def test_a_toml_addr_that_is_neither_a_string_nor_a_list_is_refused(tmp_path) -> None:
    f = tmp_path / "d.toml"
    f.write_text("addr = 5\n")
    with pytest.raises(ValueError, match="addr 5"):
        config.configure(["--config", str(f)])


def test_impair_addr_must_be_one_of_the_addresses() -> None:
    cfg = config.configure(["--addr", "127.0.0.9", "--addr", "127.0.0.10", "--impair", "loss=1",
                            "--impair-addr", "127.0.0.10"])
    assert cfg["impair_addr"] == "127.0.0.10"
    with pytest.raises(ValueError, match="not one of the addresses"):
        config.configure(["--addr", "127.0.0.9", "--impair", "loss=1", "--impair-addr", "127.0.0.10"])


@pytest.mark.parametrize("argv,said", [
    (["--addr", "127.0.0.9", "--addr", "127.0.0.9"], b"given twice"),
    (["--addr", "127.0.0.9", "--addr", "10.0.0.300/24"], b"expected an IPv4 address"),
])
def test_the_daemon_exits_2_on_a_bad_address_list(argv, said) -> None:
    r = subprocess.run([sys.executable, "-m", "udpverbs.daemon", *argv], capture_output=True, timeout=20)
    assert r.returncode == 2 and said in r.stderr and b"Traceback" not in r.stderr


# -- subnets and pairing ---------------------------------------------------------------
def test_a_subnet_is_the_one_given_else_the_kernels_longest_else_the_address() -> None:
    kernel = [net("10.0.0.0/8"), net("10.1.0.0/16"), net("192.168.1.0/24")]
    assert subnet_of(LocalAddress("10.1.2.3", net("10.1.2.0/24")), kernel) == net("10.1.2.0/24")
    assert subnet_of(LocalAddress("10.1.2.3", None), kernel) == net("10.1.0.0/16")
    assert subnet_of(LocalAddress("10.9.2.3", None), kernel) == net("10.0.0.0/8")
    assert subnet_of(LocalAddress("172.16.0.1", None), kernel) == net("172.16.0.1/32")


def test_the_kernel_table_holds_loopback() -> None:
    nets = paths.kernel_networks()
    assert any(ipaddress.IPv4Address("127.0.0.1") in n for n in nets), nets


def test_pairing_matches_subnets_first_then_the_rest_in_order() -> None:
    subnets = [net("10.1.0.0/24"), net("10.2.0.0/24"), net("10.3.0.0/24")]
    peer = [("10.1.0.2", 7), ("10.9.0.2", 7), ("10.2.0.2", 7)]
    # path 0 is local 0 with the peer's first address; local 1 finds its
    # subnet in the peer's third address, local 2 takes what is left
    assert pair_addresses(subnets, peer, [(0, ("10.1.0.2", 7))]) == [(1, ("10.2.0.2", 7)), (2, ("10.9.0.2", 7))]


def test_pairing_never_pairs_an_address_twice_and_stops_when_one_side_runs_out() -> None:
    subnets = [net("10.1.0.0/24"), net("10.1.0.0/24"), net("10.1.0.0/24")]
    peer = [("10.1.0.2", 7), ("10.1.0.3", 7)]
    pairs = pair_addresses(subnets, peer, [(0, ("10.1.0.2", 7))])
    assert pairs == [(1, ("10.1.0.3", 7))]
    # nothing new once every pair is made (a second LinkUp, say)
    assert pair_addresses(subnets, peer, [(0, ("10.1.0.2", 7)), *pairs]) == []
    # a peer of one address: path 0 only
    assert pair_addresses(subnets, [("10.1.0.2", 7)], [(0, ("10.1.0.2", 7))]) == []


def test_pairing_leaves_a_peers_ipv6_address_to_the_leftovers() -> None:
    subnets = [net("10.1.0.0/24"), net("10.2.0.0/24")]
    peer = [("10.1.0.2", 7), ("fd00::2", 7)]
    assert pair_addresses(subnets, peer, [(0, ("10.1.0.2", 7))]) == [(1, ("fd00::2", 7))]


def test_the_path_map_finds_by_socket_and_peer_address_and_forgets_a_link() -> None:
    m = PathMap()
    a, b = object(), object()
    m.add(1, ("10.2.0.2", 7), a, 1)
    m.add(0, ("10.2.0.2", 7), b, 2)
    m.add(2, ("10.3.0.2", 7), a, 2)
    assert m.get(1, ("10.2.0.2", 7)) == (a, 1)
    assert m.get(0, ("10.2.0.2", 7)) == (b, 2)
    assert m.get(1, ("10.3.0.2", 7)) is None
    m.forget(a)
    assert len(m) == 1 and m.get(1, ("10.2.0.2", 7)) is None and m.get(0, ("10.2.0.2", 7)) == (b, 2)
