"""One link over several paths (transport/paths.py, scheduler.py) in the simulator (transport/netsim.py).

Deterministic: one seeded ``random.Random`` draws the tags, ISNs and every
impairment; time is the simulator's.  The paths are the issue's: 10 Gb/s
with 100 µs of base RTT and 2.5 Gb/s with 300 µs, each a drop-tail queue
of one bandwidth-delay product each way.  Messages are jumbo (8972-byte
datagrams): the same bytes in a sixth of the events.  EFE's target queue
is set to 60 µs (its 3 µs default is for a 10 Gb/s fabric with 1500-byte
packets: a single jumbo packet takes 29 µs to cross 2.5 Gb/s), with which
one link alone fills either path (``test_each_path_alone_is_filled``).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from udpverbs.transport.link import Link, LinkConfig, LinkFailed, PathChanged, PathStats
from udpverbs.transport.netsim import Endpoint, Impairments, PathSpec, Simulator, multipath, set_path_up
from udpverbs.wire import link as wl

JUMBO = 8972 - wl.OVERHEAD
FAST = PathSpec(1.25e9, 100e-6)  # 10 Gb/s
SLOW = PathSpec(3.125e8, 300e-6)  # 2.5 Gb/s
SLOW_RTT = 300e-6
CC = {"target_queue_s": 60e-6}
#: the simulated paths' RTTs are 100-300 µs: a path silent for 3 ms is gone
#: (the timers scaled to them: a path's RTO, at least 1 ms, comes first)
SIM = LinkConfig(max_payload=JUMBO, cc_params=CC, min_rto_s=1e-3, path_dead_s=3e-3, path_probe_s=1e-3)


class Run:
    """A transfer of ``count`` numbered messages from a to b over ``specs``."""

    def __init__(self, specs: list[PathSpec], count: int, cfg: LinkConfig = SIM, seed: int = 1) -> None:
        rng = random.Random(seed)
        self.sim = Simulator(rng)
        self.la = Link(cfg, rng=random.Random(rng.getrandbits(64)), incarnation=1)
        self.lb = Link(cfg, rng=random.Random(rng.getrandbits(64)), incarnation=2)
        self.a, self.b, self.nets = multipath(self.sim, self.la, self.lb, specs)
        self.size = cfg.max_payload
        self.msgs = [i.to_bytes(4, "big") * (self.size // 4) for i in range(count)]
        self.a.source = self.msgs
        self.deliveries: list[tuple[float, int]] = []
        self.b.on_delivery = self._sink
        self.sim.schedule(0.0, lambda _: self.a.connect())

    def _sink(self, ep: Endpoint, got: list[Any], now: float) -> None:
        ep.received += got
        self.deliveries.append((now, len(got)))

    def at(self, t: float, fn: Any) -> None:
        self.sim.schedule(t, lambda _: fn())

    def run(self, limit_s: float = 5.0) -> None:
        n = len(self.msgs)
        self.sim.run(limit_s, max_events=60 * n + 200_000, stop=lambda: len(self.b.received) >= n)
        assert self.b.received == self.msgs, f"{len(self.b.received)} of {n} delivered, or not in order"

    def goodput(self, t0: float, t1: float) -> float:
        """Bytes per second delivered in order to b's owner in ``[t0, t1)``."""
        return sum(k for t, k in self.deliveries if t0 <= t < t1) * self.size / (t1 - t0)

    def delivered_by(self, t: float) -> int:
        return sum(k for when, k in self.deliveries if when < t)


def test_addresses_travel_in_the_handshake_and_paths_come_up() -> None:
    r = Run([PathSpec(1.25e8, 100e-6), PathSpec(1.25e8, 100e-6)], 1, LinkConfig())
    r.la.local_addresses = (("10.0.0.1", 18515), ("10.1.0.1", 18515))
    r.lb.local_addresses = (("10.0.0.2", 18515), ("fd00::2", 18515))
    assert not r.la.multipath
    assert [s.path for s in r.la.path_stats(0.0)] == [0]
    r.run(0.01)
    r.sim.run(0.01)
    assert r.la.peer_addresses == r.lb.local_addresses and r.lb.peer_addresses == r.la.local_addresses
    assert r.la.multipath and r.lb.multipath
    assert [e for e in r.a.events if type(e) is PathChanged] == [PathChanged(1, "probing", "added"),
                                                                 PathChanged(1, "up", "answered")]
    for link in (r.la, r.lb):
        stats = link.path_stats(r.sim.now)
        assert [(s.path, s.state) for s in stats] == [(0, "up"), (1, "up")]
        assert all(isinstance(s, PathStats) and s.datagrams_sent and s.datagrams_received and s.srtt_s
                   for s in stats)
    # while multi-path, nothing is framed alone; runs are consumed as with one path
    assert r.la.frame_alone(b"x", r.sim.now) is None
    assert r.la.run_receivable() == (r.la.tag, (r.la.peer_isn + r.la.rcv_nxt) & 0xFFFFFFFF, r.la.config.rwnd_packets)


def test_add_path_needs_an_established_link() -> None:
    link = Link(LinkConfig(), rng=random.Random(1), incarnation=1)
    with pytest.raises(RuntimeError):
        link.add_path(0.0)


@pytest.mark.parametrize("spec", [FAST, SLOW], ids=["fast", "slow"])
def test_each_path_alone_is_filled(spec: PathSpec) -> None:
    # The reference: one single-path link over each path alone.
    r = Run([spec], 1500)
    r.run()
    assert not r.la.multipath
    end = r.sim.now
    assert r.goodput(0.2 * end, 0.9 * end) >= 0.9 * spec.rate_Bps


def test_aggregate_goodput_is_the_sum_of_the_paths() -> None:
    r = Run([FAST, SLOW], 10_000)
    r.run()
    end = r.sim.now
    # after the start (both windows open) and before the tail
    assert r.goodput(0.1 * end, 0.9 * end) >= 0.9 * (FAST.rate_Bps + SLOW.rate_Bps)
    fast, slow = r.la.path_stats(end)
    # each carried about its share (cwnd / RTT), not a turn each
    share = slow.bytes_sent / (fast.bytes_sent + slow.bytes_sent)
    assert 0.12 < share < 0.3, share
    assert fast.srtt_s < slow.srtt_s


def test_cutting_the_fast_path_mid_transfer_and_bringing_it_back() -> None:
    r = Run([FAST, SLOW], 10_000)
    cut, back = 0.03, 0.06
    r.at(cut, lambda: set_path_up(r.nets, 0, False))
    r.at(back, lambda: set_path_up(r.nets, 0, True))
    seen: dict[str, list[PathStats]] = {}
    r.at(back, lambda: seen.setdefault("back", r.la.path_stats(r.sim.now)))
    r.run()  # every message once, in order, byte for byte
    assert 2000 < r.delivered_by(cut) < 8000  # the cut came mid-transfer
    assert r.goodput(cut + 10 * SLOW_RTT, cut + 20 * SLOW_RTT) >= 0.9 * SLOW.rate_Bps
    changes = [(e.path, e.state, e.reason) for e in r.a.events if type(e) is PathChanged]
    assert changes[-2:] == [(0, "down", "silent"), (0, "up", "answered")]
    # used again once back: its counters moved, and it carried most of the rest
    before, after = seen["back"][0], r.la.path_stats(r.sim.now)[0]
    assert after.times_down == 1 and after.state == "up"
    assert after.bytes_sent - before.bytes_sent > 0.5 * (len(r.msgs) - r.delivered_by(back)) * r.size
    assert r.goodput(back + 10 * SLOW_RTT, r.sim.now) > 1.5 * SLOW.rate_Bps


def test_a_lossy_path_beside_a_clean_one_adds_not_subtracts() -> None:
    lossy = PathSpec(SLOW.rate_Bps, 100e-6, impairments=Impairments(loss=0.05))
    clean = PathSpec(SLOW.rate_Bps, 100e-6)
    alone = Run([clean], 3000)
    alone.run()
    both = Run([clean, lossy], 3000)
    both.run()
    assert both.sim.now <= alone.sim.now  # the same messages, in no more time
    assert both.la.path_stats(both.sim.now)[1].retransmissions > 0  # the loss was real


@pytest.mark.parametrize("seed", range(2))
def test_both_ways_through_hostile_paths_that_fail_and_return(seed: int) -> None:
    # Loss, duplication, reordering and corruption on every path both ways,
    # data both ways, one path cut and restored and another cut for good:
    # each side gets the other's messages once, in order, byte for byte.
    bad = Impairments(loss=0.10, duplicate=0.05, reorder=0.05, corrupt=0.01, reorder_delay_s=30e-6)
    cfg = LinkConfig(cc="efe-host", initial_rto_s=2e-3, min_rto_s=1e-3, path_dead_s=3e-3, path_probe_s=1e-3)
    specs = [PathSpec(1.25e8, 100e-6, impairments=bad), PathSpec(1.25e8, 200e-6, impairments=bad),
             PathSpec(6e7, 50e-6, impairments=bad)]
    r = Run(specs, 1500, cfg, seed=seed)
    back = [(i + 7).to_bytes(4, "big") * (1 + i % 50) for i in range(1500)]
    r.b.source = back
    r.at(0.006, lambda: set_path_up(r.nets, 1, False))
    r.at(0.010, lambda: set_path_up(r.nets, 1, True))
    r.at(0.012, lambda: set_path_up(r.nets, 0, False))
    r.run()
    r.sim.run(r.sim.now + 1.0, stop=lambda: len(r.a.received) >= len(back))
    assert r.a.received == back
    assert r.la.stats.bad_crc + r.lb.stats.bad_crc > 0 and r.lb.stats.duplicate > 0
    assert [s.state for s in r.la.path_stats(r.sim.now)] == ["down", "up", "up"]


def test_every_path_cut_fails_the_link_only_after_the_retry_budget() -> None:
    cfg = LinkConfig(max_payload=JUMBO, cc_params=CC, path_dead_s=1e-3, path_probe_s=1e-3, max_retransmits=6,
                     max_rto_s=0.1)
    cut = 0.01
    ends = []
    for specs in ([FAST, SLOW], [FAST]):
        r = Run(specs, 5000, cfg)
        for k in range(len(specs)):
            r.at(cut, lambda k=k: set_path_up(r.nets, k, False))
        r.sim.run(30.0, max_events=1_000_000, stop=lambda: any(type(e) is LinkFailed for e in r.a.events))
        failed = [e for e in r.a.events if type(e) is LinkFailed]
        assert failed == [LinkFailed("retransmit_budget")]
        ends.append(r.sim.now)
        if len(specs) > 1:
            downs = [e.path for e in r.a.events if type(e) is PathChanged and e.state == "down"]
            assert sorted(downs) == [0, 1]  # both went down within milliseconds...
            assert r.la.stats.rto_count == cfg.max_retransmits
    # ...and the link failed when one path alone would have: the whole
    # budget (the RTO from a few ms, doubling up to max_rto_s), not path_dead_s
    assert ends[0] - cut > 2 * cfg.max_rto_s > 100 * cfg.path_dead_s
    assert abs(ends[0] - ends[1]) < 0.1 * (ends[1] - cut)


@pytest.mark.parametrize("signal", ["silent", "emsgsize"])
def test_each_path_finds_its_own_mtu_and_the_link_sends_what_all_carry(signal: str) -> None:
    # Path 0 carries jumbo datagrams, path 1 only 1472 bytes: dropped
    # silently on the way, or refused by the sender's own stack.
    small = 1472
    base = small - wl.OVERHEAD
    cfg = LinkConfig(max_payload=JUMBO, base_payload=base, cc_params=CC, min_rto_s=1e-3, path_dead_s=3e-3,
                     path_probe_s=1e-3)
    r = Run([FAST, SLOW], 0, cfg)
    ch = r.nets[1][0]
    if signal == "silent":
        ch.mtu = r.nets[1][1].mtu = small
    else:
        ch.local_mtu = small
    r.a.stream = bytes(random.Random(7).randbytes(3_000_000))
    limits: list[tuple[float, int]] = []
    r.at(0.002, lambda: limits.append((r.sim.now, r.la.payload_limit)))
    r.at(0.003, lambda: set_path_up(r.nets, 1, False))
    r.at(0.008, lambda: limits.append((r.sim.now, r.la.payload_limit)))
    r.sim.run(2.0, max_events=2_000_000,
              stop=lambda: len(limits) > 1 and sum(len(m) for m in r.b.received) >= len(r.a.stream))
    assert b"".join(bytes(m) for m in r.b.received) == r.a.stream
    # both up: what the small path carries; it down: the big one's size again
    assert limits[0][1] <= base and limits[1][1] == JUMBO, limits
    stats = r.la.path_stats(r.sim.now)
    assert stats[0].plpmtu == JUMBO and stats[1].state == "down"
    assert r.la.stats.pmtu_probes_acked and (signal == "silent" or r.la.stats.pmtu_too_big)
