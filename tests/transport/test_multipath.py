"""One link over several paths (transport/paths.py) in the simulator (transport/netsim.py)."""

from __future__ import annotations

import random

import pytest

from udpverbs.transport.link import Link, LinkConfig, PathChanged, PathStats
from udpverbs.transport.netsim import Endpoint, PathSpec, Simulator, multipath, set_path_up
from udpverbs.wire import link as wl

JUMBO = 8972 - wl.OVERHEAD


def _links(cfg: LinkConfig, seed: int) -> tuple[Simulator, Link, Link]:
    rng = random.Random(seed)
    sim = Simulator(rng)
    la = Link(cfg, rng=random.Random(rng.getrandbits(64)), incarnation=1)
    lb = Link(cfg, rng=random.Random(rng.getrandbits(64)), incarnation=2)
    return sim, la, lb


def test_addresses_travel_in_the_handshake_and_paths_come_up() -> None:
    sim, la, lb = _links(LinkConfig(), 1)
    la.local_addresses = (("10.0.0.1", 18515), ("10.1.0.1", 18515))
    lb.local_addresses = (("10.0.0.2", 18515), ("fd00::2", 18515))
    a, b, _ = multipath(sim, la, lb, [PathSpec(1.25e8, 100e-6), PathSpec(1.25e8, 100e-6)])
    assert not la.multipath
    assert [s.path for s in la.path_stats(0.0)] == [0]
    sim.schedule(0.0, lambda _: a.connect())
    sim.run(0.01)
    assert la.peer_addresses == lb.local_addresses and lb.peer_addresses == la.local_addresses
    assert la.multipath and lb.multipath
    assert [e for e in a.events if type(e) is PathChanged] == [PathChanged(1, "probing", "added"),
                                                               PathChanged(1, "up", "answered")]
    stats = la.path_stats(sim.now)
    assert [(s.path, s.state) for s in stats] == [(0, "up"), (1, "up")]
    assert all(isinstance(s, PathStats) and s.datagrams_sent and s.datagrams_received for s in stats)
    # while multi-path, nothing is framed alone
    assert la.frame_alone(b"x", sim.now) is None and la.run_receivable() is None


def test_add_path_needs_an_established_link() -> None:
    _, la, _ = _links(LinkConfig(), 2)
    with pytest.raises(RuntimeError):
        la.add_path(0.0)


def _transfer(specs: list[PathSpec], count: int, cfg: LinkConfig, seed: int = 1,
              limit_s: float = 5.0) -> tuple[Simulator, Endpoint, Endpoint, list, list[bytes]]:
    sim, la, lb = _links(cfg, seed)
    a, b, nets = multipath(sim, la, lb, specs)
    size = cfg.max_payload
    msgs = [i.to_bytes(4, "big") * (size // 4) for i in range(count)]
    a.source = msgs
    sim.schedule(0.0, lambda _: a.connect())
    sim.run(limit_s, max_events=100 * count + 100_000, stop=lambda: len(b.received) >= count)
    return sim, a, b, nets, msgs


def test_two_paths_deliver_exactly_once_in_order_and_both_carry() -> None:
    cfg = LinkConfig(max_payload=JUMBO)
    sim, a, b, _, msgs = _transfer([PathSpec(1.25e9, 100e-6), PathSpec(3.125e8, 300e-6)], 3000, cfg)
    assert b.received == msgs
    sent = [s.bytes_sent for s in a.link.path_stats(sim.now)]
    assert all(x > 1_000_000 for x in sent), sent


def test_a_cut_path_goes_down_and_comes_back() -> None:
    cfg = LinkConfig(max_payload=JUMBO, path_dead_s=0.002, path_probe_s=0.002)
    sim, la, lb = _links(cfg, 3)
    a, b, nets = multipath(sim, la, lb, [PathSpec(1.25e9, 100e-6), PathSpec(3.125e8, 300e-6)])
    msgs = [i.to_bytes(4, "big") * (JUMBO // 4) for i in range(6000)]
    a.source = msgs
    sim.schedule(0.0, lambda _: a.connect())
    sim.schedule(0.01, lambda _: set_path_up(nets, 0, False))
    sim.schedule(0.03, lambda _: set_path_up(nets, 0, True))
    sim.run(5.0, max_events=1_000_000, stop=lambda: len(b.received) >= len(msgs))
    assert b.received == msgs
    changes = [(e.path, e.state) for e in a.events if type(e) is PathChanged]
    assert (0, "down") in changes and changes.index((0, "down")) < changes.index((0, "up"))
    assert la.path_stats(sim.now)[0].times_down == 1
