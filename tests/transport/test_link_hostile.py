"""Forged packets and a peer that stops acknowledging: counted, dropped, failed in bounded time.

The link's tag travels in the clear, so whoever saw one datagram can send
packets the tag check accepts.  What such a packet claims (sequence, ACK,
SACK blocks, timestamp, window) must not stall the link, and a link that
makes no progress, for whatever reason, must fail within its
retransmission budget rather than hang.  Same wiring as
``test_link_timers.py``: two links, one-way delay ``D``, exact times.
"""

from __future__ import annotations

import random

import pytest

from udpverbs.transport.link import Link, LinkFailed, LinkState
from udpverbs.wire import link as wl

from .test_link_timers import D, cfg, establish, events, feed, make_pair

_U32 = 0xFFFFFFFF


def _forged(to: Link, rng: random.Random) -> bytes:
    """A DATA or ACK packet with ``to``'s tag and every other field wild."""
    ptype = rng.choice([wl.PacketType.DATA, wl.PacketType.ACK])
    s = rng.randrange(1 << 32)
    sack = ((s, (s + rng.randrange(1, 1 << 20)) & _U32),) if rng.random() < 0.5 else ()
    body = bytes(rng.randrange(50)) if ptype == wl.PacketType.DATA else b""
    return wl.encode_fields(ptype, 0, 0, to.tag, rng.randrange(1 << 32), rng.randrange(1 << 32),
                            rng.randrange(1 << 32), rng.randrange(1 << 32), rng.choice([0, 1, 0xFFFF]), body, sack)


def _stream(a: Link, b: Link, t: float, rounds: int, between=None) -> float:
    """a sends a message a round; b's ACK goes back.  ``between(now)`` runs
    after a's data reached b and before b answers (where a forged packet
    does most harm: b's answer echoes the timestamp it heard last)."""
    for i in range(rounds):
        a.send(bytes([i % 256]) * 100, t)
        feed(b, a.datagrams_to_send(t), t + D)
        if between is not None:
            between(t + D)
        feed(a, b.datagrams_to_send(t + D), t + 2 * D)
        for link in (a, b):
            d = link.next_deadline()
            if d is not None and d <= t + 2 * D:
                link.timer_fired(t + 2 * D)
        t += 2 * D
    return t


def test_wild_packets_are_dropped_and_counted_and_the_stream_keeps_its_pace() -> None:
    # On main b took the forged timestamps and echoed them: a's RTT became
    # minutes, its pacer stalled for as long.
    a, b = make_pair(cfg(cc="efe", cc_params={}))
    t = establish(a, b)
    rng = random.Random(3)
    forged = 0

    def forge(now: float) -> None:
        nonlocal forged
        for _ in range(5):
            b.datagram_received(_forged(b, rng), now)
            forged += 1

    t = _stream(a, b, t, 200, forge)
    assert a.acked == 200 and len(b.drain_received()) == 200
    assert a.srtt_s == pytest.approx(2 * D, rel=0.01)
    s = b.stats
    assert s.bad_seq + s.bad_ack + s.bad_sack == forged
    assert (s.duplicate, s.out_of_window, a.stats.rto_count) == (0, 0, 0)
    assert a.state == b.state == LinkState.ESTABLISHED


def test_a_timestamp_claiming_a_round_trip_beyond_the_longest_rto_is_not_sampled() -> None:
    # An on-path forger with the right sequence and ACK fields but a wild
    # timestamp: b echoes it, a must not believe the round trip.
    a, b = make_pair(cfg(cc="efe", cc_params={}))
    t = establish(a, b)

    def forge(now: float) -> None:
        rx = b.receiver
        b.datagram_received(wl.encode_fields(wl.PacketType.ACK, 0, 0, b.tag, (rx.peer_isn + rx.rcv_nxt) & _U32,
                                             (b.isn + b.snd_nxt) & _U32, (int(now * 1e6) - 600_000_000) & _U32,
                                             0, 64), now)

    t = _stream(a, b, t, 20, forge)
    assert a.acked == 20 and a.srtt_s == pytest.approx(2 * D, rel=0.01)


def test_a_sack_block_holding_the_message_the_ack_waits_for_is_dropped() -> None:
    a, b = make_pair()
    t = establish(a, b)
    for i in range(4):
        a.send(bytes([i]), t)
    assert len(a.datagrams_to_send(t)) == 4  # all lost
    base = a.isn + a.acked
    forged = wl.encode_fields(wl.PacketType.ACK, 0, 0, a.tag, (a.peer_isn + a.rcv_nxt) & _U32, base & _U32, 0, 0,
                              64, b"", ((base & _U32, (base + 4) & _U32),))
    a.datagram_received(forged, t + D)
    assert a.bytes_in_flight == 4 * (1 + wl.OVERHEAD) and a.stats.bad_sack == 1
    # the timers still run: the tail loss probe's first, the RTO's behind it
    assert a.next_deadline() == pytest.approx(t + 2 * a.srtt_s + a.config.max_ack_delay_s)
    assert a._rto_deadline == pytest.approx(t + 0.01)


def test_data_sacked_but_never_acknowledged_is_resent_after_the_timeout() -> None:
    # A SACK for data the receiver never got (forged, or a receiver that
    # dropped it) above the oldest message: on main, once that one was
    # acknowledged nothing was in flight, the timer stopped, and the rest
    # was never resent.
    a, b = make_pair()
    t = establish(a, b)
    for i in range(4):
        a.send(bytes([i]), t)
    a.datagrams_to_send(t)  # all lost
    base = a.isn
    forged = wl.encode_fields(wl.PacketType.ACK, 0, 0, a.tag, (a.peer_isn + a.rcv_nxt) & _U32, base & _U32, 0, 0,
                              64, b"", (((base + 1) & _U32, (base + 4) & _U32),))
    a.datagram_received(forged, t + D)
    assert a.recovery.sacked == {1, 2, 3}
    now = t + D
    got: list[bytes] = []
    for _ in range(10):
        feed(b, a.datagrams_to_send(now), now + D)
        got += b.drain_received()
        feed(a, b.datagrams_to_send(now + D), now + 2 * D)
        now += 2 * D
        if a.acked == 4:
            break
        now = a.next_deadline()
        a.timer_fired(now)
    assert got == [bytes([i]) for i in range(4)] and a.acked == 4
    assert a.state == LinkState.ESTABLISHED and a.next_deadline() == pytest.approx(now + 1.0)


def _shut_window_times(a: Link, b: Link, t: float) -> list[float]:
    """b never drains: its window shuts and stays shut.  Fire a's timer until
    the link fails; return the times it fired."""
    for i in range(8):
        a.send(bytes([i]), t)
    feed(b, a.datagrams_to_send(t), t + D)
    feed(a, b.datagrams_to_send(t + D), t + 2 * D)
    assert a.acked == 4 and a.peer_rwnd == 0 and a.bytes_in_flight == 0
    assert a.datagrams_to_send(t + 2 * D) == []
    times = []
    while a.state == LinkState.ESTABLISHED:
        now = a.next_deadline()
        assert now is not None and now - t < 60
        a.timer_fired(now)
        times.append(now)
        out = a.datagrams_to_send(now)
        if a.state == LinkState.ESTABLISHED:
            (probe,) = out
            assert wl.decode_untrusted(probe)[0].ptype == wl.PacketType.KEEPALIVE
        feed(b, out, now + D)
        feed(a, b.datagrams_to_send(now + D), now + 2 * D)  # b answers, window 0
    return times


def test_a_peer_that_answers_but_keeps_its_window_shut_fails_the_link_within_the_budget() -> None:
    # On main nothing was in flight, so no timer ran: b's answers kept the
    # link alive and a's queued messages waited for ever.
    a, b = make_pair(cfg(rwnd_packets=4, max_retransmits=3, max_rto_s=0.05, keepalive_idle_s=10.0,
                         dead_peer_s=30.0))
    t = establish(a, b)
    times = _shut_window_times(a, b, t)
    t0 = t + 2 * D
    # the persist timer: RTO 10 ms, doubled up to max_rto_s 50 ms, 3 probes, then the budget is spent
    assert [x - t0 for x in times] == pytest.approx([0.01, 0.03, 0.07, 0.12])
    assert events(a) == [LinkFailed("retransmit_budget")]


def test_a_slow_peer_that_opens_its_window_now_and_then_is_not_failed() -> None:
    # b's owner drains every 100 ms: several RTOs (10, 20, 40 ms) pass each
    # time, fewer than the budget (10 + ... + 160 ms)
    a, b = make_pair(cfg(rwnd_packets=2, max_retransmits=4, keepalive_idle_s=10.0, dead_peer_s=30.0))
    t = establish(a, b)
    n = 40
    for i in range(n):
        a.send(bytes([i]), t)
    got: list[bytes] = []
    now = t
    wake = t + 0.1
    while len(got) < n:
        assert now - t < 30 and a.state == LinkState.ESTABLISHED
        d = a.next_deadline()
        if d is not None and d < wake:
            now = d
            a.timer_fired(now)
        else:
            now = wake  # b's owner drains, a long while (many RTOs) after the window shut
            wake += 0.1
            got += b.drain_received()
        feed(b, a.datagrams_to_send(now), now + D)
        feed(a, b.datagrams_to_send(now + D), now + 2 * D)
    assert got == [bytes([i]) for i in range(n)]
    assert a.stats.rto_count > a.config.max_retransmits  # timers fired, but each window brought progress
