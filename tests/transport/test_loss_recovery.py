"""Loss recovery under random loss: RACK, the tail loss probe, and a
congestion response that tells the path's loss from congestion.

Deterministic (the simulator's fake clock, seeded draws).  The path of
``udpverbs.bench.netsim --lossy``: 1 Gb/s, 100 µs, a one-BDP drop-tail
buffer, the daemon's link settings (20 ms minimum RTO, 1 ms pacing bursts).
"""

from __future__ import annotations

import random

from udpverbs.daemon.config import DAEMON_MIN_RTO_S, DAEMON_PACING_BURST_PACKETS, DAEMON_PACING_BURST_S
from udpverbs.transport.link import Link, LinkConfig
from udpverbs.transport.netsim import Impairments, dumbbell, lossy_path
from udpverbs.wire import link as wl

DAEMON = LinkConfig(min_rto_s=DAEMON_MIN_RTO_S, pacing_burst_packets=DAEMON_PACING_BURST_PACKETS,
                    pacing_burst_s=DAEMON_PACING_BURST_S)
COUNT = 3000


def test_random_loss_costs_efe_host_little_goodput_and_no_rtos() -> None:
    clean = lossy_path("efe-host", COUNT, config=DAEMON)
    for imp in (Impairments(loss=0.05),
                Impairments(loss=0.05, reorder=0.05, duplicate=0.02, reorder_delay_s=200e-6)):
        r = lossy_path("efe-host", COUNT, impairments=imp, config=DAEMON)
        assert r.exact  # every message once, in order, byte for byte
        assert r.lost > COUNT * 0.04  # the losses did happen
        # Random loss is not congestion: the window stays open, losses are
        # repaired within round trips, not by 20 ms timeouts.
        assert r.goodput_Bps >= 0.5 * clean.goodput_Bps
        assert r.rto_count <= r.lost / 100  # (before RACK-TLP: about one RTO per five losses)


def _pair(cfg: LinkConfig) -> tuple[Link, Link, float]:
    """Two established links with an RTT sample (100 µs), at the time returned."""
    a = Link(cfg, rng=random.Random(1), incarnation=1)
    b = Link(cfg, rng=random.Random(2), incarnation=2)
    now = 0.0
    a.connect(now)
    for _ in range(4):
        now += 50e-6
        for d in a.datagrams_to_send(now):
            b.datagram_received(d, now)
        now += 50e-6
        for d in b.datagrams_to_send(now):
            a.datagram_received(d, now)
    assert a.state.name == b.state.name == "ESTABLISHED" and a.srtt_s is not None
    return a, b, now


def _exchange(a: Link, b: Link, now: float, drop: set[int]) -> float:
    """a sends what it may (DATA numbered by its n dropped if in ``drop``),
    b answers; returns the time after the round trip."""
    for d in a.datagrams_to_send(now):
        h, _ = wl.decode_untrusted(d)
        if h.ptype == wl.PacketType.DATA and (h.seq - a.isn) % 2**32 in drop:
            continue
        b.datagram_received(d, now + 50e-6)
    now += 100e-6
    for d in b.datagrams_to_send(now):
        a.datagram_received(d, now)
    return now


def test_a_tail_loss_is_probed_not_left_to_the_rto() -> None:
    a, b, now = _pair(LinkConfig(min_rto_s=0.02))
    for i in range(4):
        a.send(bytes([i]) * 100, now)
    now = _exchange(a, b, now, drop={2, 3})  # the last two: nothing sent behind them reveals them
    assert a.acked == 2
    pto = a.next_deadline()
    assert pto is not None and pto - now < 0.002  # two SRTTs and the ACK delay, not the 20 ms RTO
    a.timer_fired(pto)
    assert a.stats.tlp_probes == 1
    now = _exchange(a, b, pto, drop=set())  # the probe (message 3 again) draws a SACK...
    d = a.next_deadline()
    a.timer_fired(d)  # ...and RACK finds 2 lost after the reordering window
    now = _exchange(a, b, max(now, d), drop=set())
    assert a.acked == 4 and a.stats.rto_count == 0
    assert [bytes(m) for m in b.drain_received()] == [bytes([i]) * 100 for i in range(4)]


def test_a_lost_retransmission_is_found_by_rack_not_the_rto() -> None:
    a, b, now = _pair(LinkConfig(min_rto_s=0.02))
    for i in range(10):
        a.send(bytes([i]) * 100, now)
    now = _exchange(a, b, now, drop={1})
    assert list(a.recovery.lost) == [1]  # three later packets delivered
    for i in range(10, 14):
        a.send(bytes([i]) * 100, now)
    now = _exchange(a, b, now, drop={1})  # its retransmission is lost too
    # New data sent after the retransmission was delivered: the
    # retransmission is declared lost (at once or after the reordering
    # window), and its second retransmission gets through.
    for _ in range(3):
        d = a.next_deadline()
        if a.recovery.lost or d is None or d - now > 0.002:
            break
        a.timer_fired(d)
        now = max(now, d)
    now = _exchange(a, b, now, drop=set())
    assert a.acked == 14 and a.stats.rto_count == 0 and a.stats.retransmits == 2


def test_efe_host_still_backs_off_a_drop_tail_queue_and_stays_fair() -> None:
    # The host preset's 200 µs target queue is deeper than these buffers
    # (100 and 25 µs): the delay cannot grow enough to say "congestion", so
    # this is the loss response's job.  Two flows must neither overrun the
    # queue (loss bounded) nor starve each other.
    for bdp in (1.0, 0.25):
        r = dumbbell("efe-host", 2, duration_s=0.05, warmup_s=0.02, seed=3, buffer_bdp=bdp)
        assert r.utilization >= 0.9
        assert r.loss_rate <= 0.05
        assert r.jain >= 0.9
