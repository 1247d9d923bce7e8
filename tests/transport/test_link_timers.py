"""Exact-timer tests of transport.Link, aioquic style.

Two links are wired by hand: every test starts at ``now = 0.0``, moves
datagrams between them at chosen times (or drops chosen ones) and asserts
exact deadlines, retransmission times and back-off.  One-way delay is
``D = 0.5 ms``, so the handshake measures an RTT of exactly 1 ms.
"""

from __future__ import annotations

import random

import pytest

from udpverbs.transport.link import (
    Link, LinkClosed, LinkConfig, LinkFailed, LinkState, LinkUp,
)
from udpverbs.wire import link as wl

D = 0.0005


def cfg(**kw) -> LinkConfig:
    base = dict(initial_rto_s=0.05, min_rto_s=0.01, max_rto_s=1.0, max_retransmits=3,
                max_init_retransmits=2, keepalive_idle_s=1.0, dead_peer_s=3.0, cc="fixed",
                cc_params={"window_packets": 16})
    base.update(kw)
    return LinkConfig(**base)


def make_pair(config: LinkConfig | None = None, seed: int = 7) -> tuple[Link, Link]:
    c = config or cfg()
    a = Link(c, rng=random.Random(seed), incarnation=1)
    b = Link(c, rng=random.Random(seed + 1000), incarnation=2)
    return a, b


def feed(dst: Link, datagrams: list[bytes], now: float) -> None:
    for d in datagrams:
        dst.datagram_received(d, now)


def events(link: Link) -> list:
    out = []
    while (e := link.next_event()) is not None:
        out.append(e)
    return out


def establish(a: Link, b: Link) -> float:
    """a opens at 0; INIT arrives at D, INIT_ACK at 2D, a's ACK at 3D.  Returns 3D."""
    a.connect(0.0)
    feed(b, a.datagrams_to_send(0.0), D)
    feed(a, b.datagrams_to_send(D), 2 * D)
    feed(b, a.datagrams_to_send(2 * D), 3 * D)
    assert b.datagrams_to_send(3 * D) == []  # a pure ACK is not answered
    assert a.state == b.state == LinkState.ESTABLISHED
    assert events(a) == [LinkUp(2)] and events(b) == [LinkUp(1)]
    return 3 * D


def test_handshake_measures_rtt_and_tags() -> None:
    a, b = make_pair()
    establish(a, b)
    assert a.peer_tag == b.tag and b.peer_tag == a.tag
    assert a.srtt_s == pytest.approx(0.001) and b.srtt_s == pytest.approx(0.001)
    # RFC 6298: RTO = srtt + 4 rttvar = 1 ms + 2 ms, clamped up to min_rto.
    assert a.rtt.rto_s == 0.01


def test_rto_exact_times_and_backoff() -> None:
    a, b = make_pair(cfg(tlp=False))  # the RTO alone (a tail loss probe would come first)
    t = establish(a, b)
    assert a.send(b"hello", t) == 0
    first = a.datagrams_to_send(t)
    assert len(first) == 1  # dropped
    assert a.next_deadline() == pytest.approx(t + 0.01)
    times = []
    now = t
    for _ in range(3):
        now = a.next_deadline()
        a.timer_fired(now)
        (retx,) = a.datagrams_to_send(now)
        h, body = wl.decode_untrusted(retx)
        assert bytes(body) == b"hello" and h.flags & wl.LinkFlags.RETRANSMISSION
        times.append(now)
    # RFC 6298 §5.5: the timer doubles after each expiry: 10, 20, 40 ms.
    assert times == pytest.approx([t + 0.01, t + 0.03, t + 0.07])
    assert a.stats.rto_count == 3 and a.stats.retransmits == 3
    assert a.next_deadline() == pytest.approx(t + 0.07 + 0.08)
    # The third retransmission gets through: acked, back-off reset.
    feed(b, [retx], now + D)
    assert b.drain_received() == [b"hello"]
    feed(a, b.datagrams_to_send(now + D), now + 2 * D)  # ACK_NOW: answered at once
    assert a.acked == 1
    assert a.next_deadline() == pytest.approx(now + 2 * D + 1.0)  # only the keep-alive left
    assert events(a) == []


def test_retransmit_budget_fails_link() -> None:
    a, b = make_pair(cfg(tlp=False))
    t = establish(a, b)
    a.send(b"x", t)
    a.datagrams_to_send(t)
    now = t
    for _ in range(3):
        now = a.next_deadline()
        a.timer_fired(now)
        assert len(a.datagrams_to_send(now)) == 1
    now = a.next_deadline()
    assert now == pytest.approx(t + 0.15)
    a.timer_fired(now)
    assert a.state == LinkState.FAILED
    assert events(a) == [LinkFailed("retransmit_budget")]
    assert a.next_deadline() is None


def test_handshake_loss_retries_with_backoff_then_fails() -> None:
    a, _ = make_pair()
    a.connect(0.0)
    sent_at = []
    now = 0.0
    assert len(a.datagrams_to_send(now)) == 1
    sent_at.append(now)
    for _ in range(2):
        now = a.next_deadline()
        a.timer_fired(now)
        (init,) = a.datagrams_to_send(now)
        assert wl.decode_untrusted(init)[0].ptype == wl.PacketType.INIT
        sent_at.append(now)
    assert sent_at == pytest.approx([0.0, 0.05, 0.15])
    now = a.next_deadline()
    assert now == pytest.approx(0.35)
    a.timer_fired(now)
    assert events(a) == [LinkFailed("handshake_timeout")]


def test_lost_init_ack_is_recovered_by_init_retransmission() -> None:
    a, b = make_pair()
    a.connect(0.0)
    feed(b, a.datagrams_to_send(0.0), D)
    b.datagrams_to_send(D)  # INIT_ACK lost
    assert b.state == LinkState.INIT_RECEIVED
    now = a.next_deadline()
    assert now == pytest.approx(0.05)
    a.timer_fired(now)
    feed(b, a.datagrams_to_send(now), now + D)
    feed(a, b.datagrams_to_send(now + D), now + 2 * D)
    assert a.state == LinkState.ESTABLISHED
    feed(b, a.datagrams_to_send(now + 2 * D), now + 3 * D)
    assert b.state == LinkState.ESTABLISHED


def test_passive_side_retransmits_init_ack_when_the_ack_is_lost() -> None:
    a, b = make_pair()
    a.connect(0.0)
    feed(b, a.datagrams_to_send(0.0), D)
    feed(a, b.datagrams_to_send(D), 2 * D)
    a.datagrams_to_send(2 * D)  # a's ACK lost: b still waits for proof
    assert b.next_deadline() == pytest.approx(D + 0.05)
    b.timer_fired(D + 0.05)
    (again,) = b.datagrams_to_send(D + 0.05)
    assert wl.decode_untrusted(again)[0].ptype == wl.PacketType.INIT_ACK
    feed(a, [again], D + 0.05 + D)
    feed(b, a.datagrams_to_send(D + 0.05 + D), D + 0.05 + 2 * D)  # a answers with an ACK
    assert b.state == LinkState.ESTABLISHED


def test_simultaneous_open_converges() -> None:
    a, b = make_pair()
    tags = (a.tag, b.tag)
    a.connect(0.0)
    b.connect(0.0)
    ia, ib = a.datagrams_to_send(0.0), b.datagrams_to_send(0.0)
    feed(b, ia, D)
    feed(a, ib, D)
    assert a.state == b.state == LinkState.INIT_RECEIVED
    feed(a, b.datagrams_to_send(D), 2 * D)
    feed(b, a.datagrams_to_send(D), 2 * D)
    assert a.state == b.state == LinkState.ESTABLISHED
    assert (a.tag, b.tag) == tags and a.peer_tag == b.tag and b.peer_tag == a.tag
    # Data flows both ways afterwards.
    a.send(b"ping", 2 * D)
    b.send(b"pong", 2 * D)
    feed(b, a.datagrams_to_send(2 * D), 3 * D)
    feed(a, b.datagrams_to_send(2 * D), 3 * D)
    assert a.drain_received() == [b"pong"] and b.drain_received() == [b"ping"]


def _unanswered_claim(a: Link, t: float) -> float:
    """Run ``a``'s timers with nobody answering its restart probes; the time it failed."""
    (probe,) = a.datagrams_to_send(t)  # the old association is asked first
    assert wl.decode_untrusted(probe)[0][:4] == (wl.PacketType.KEEPALIVE, wl.LinkFlags.ACK_NOW, 0, a.peer_tag)
    assert events(a) == [] and a.state == LinkState.ESTABLISHED
    for _ in range(10):
        t = a.next_deadline()
        a.timer_fired(t)
        a.datagrams_to_send(t)
        if a.state != LinkState.ESTABLISHED:
            break
    assert t <= 1.0  # within a few RTOs, well before dead_peer_s
    return t


@pytest.mark.parametrize("incarnation", [3, 1], ids=["restart", "reset"])
def test_init_claiming_a_restart_is_dismissed_when_the_old_peer_answers(incarnation: int) -> None:
    # A blind INIT from the peer's address (new tag, any incarnation)
    # must not tear the link down
    c = cfg()
    a, b = make_pair(c)
    t = establish(a, b)
    forger = Link(c, rng=random.Random(99), incarnation=incarnation)
    forger.connect(t)
    feed(a, forger.datagrams_to_send(t), t + D)
    feed(b, a.datagrams_to_send(t + D), t + 2 * D)  # the probe reaches the live peer
    feed(a, b.datagrams_to_send(t + 2 * D), t + 3 * D)  # which answers
    for _ in range(20):
        now = a.next_deadline()
        if now > t + 3.0:
            break
        a.timer_fired(now)
        feed(b, a.datagrams_to_send(now), now + D)
        b.timer_fired(now + D)
        feed(a, b.datagrams_to_send(now + D), now + 2 * D)
    assert a.state == LinkState.ESTABLISHED and events(a) == []
    a.send(b"still here", t + 3.0)
    feed(b, a.datagrams_to_send(t + 3.0), t + 3.0 + D)
    assert b.drain_received() == [b"still here"]


def test_peer_restart_is_detected_and_a_fresh_link_accepts_the_new_peer() -> None:
    c = cfg()
    a, b = make_pair(c)
    t = establish(a, b)
    b2 = Link(c, rng=random.Random(99), incarnation=3)  # the peer daemon restarted
    b2.connect(t)
    init = b2.datagrams_to_send(t)
    feed(a, init, t + D)
    t = _unanswered_claim(a, t + D)
    assert events(a) == [LinkFailed("peer_restarted")]
    assert a.state == LinkState.FAILED
    a2 = Link(c, rng=random.Random(5), incarnation=1)  # what the daemon does next
    feed(a2, init, t + D)
    feed(b2, a2.datagrams_to_send(t + D), t + 2 * D)
    assert b2.state == LinkState.ESTABLISHED and events(b2) == [LinkUp(1)]


def test_keepalive_and_dead_peer_budget() -> None:
    a, b = make_pair()
    establish(a, b)
    last_heard = 2 * D  # a last heard b at the INIT_ACK
    assert a.next_deadline() == pytest.approx(last_heard + 1.0)
    for k in (1, 2):
        now = a.next_deadline()
        assert now == pytest.approx(last_heard + k)
        a.timer_fired(now)
        (ka,) = a.datagrams_to_send(now)
        assert wl.decode_untrusted(ka)[0].ptype == wl.PacketType.KEEPALIVE
    now = a.next_deadline()
    assert now == pytest.approx(last_heard + 3.0)  # dead_peer_s
    a.timer_fired(now)
    assert events(a) == [LinkFailed("dead_peer")]
    assert a.stats.keepalives_sent == 2


def test_keepalive_answer_keeps_the_link_alive() -> None:
    a, b = make_pair()
    establish(a, b)
    now = a.next_deadline()
    a.timer_fired(now)
    feed(b, a.datagrams_to_send(now), now + D)
    feed(a, b.datagrams_to_send(now + D), now + 2 * D)  # b answers at once
    assert a.next_deadline() == pytest.approx(now + 2 * D + 1.0)
    assert a.state == LinkState.ESTABLISHED


def test_abort_and_close() -> None:
    a, b = make_pair()
    t = establish(a, b)
    a.close(t)
    a.close(t)  # safe twice
    assert events(a) == [LinkClosed()]
    feed(b, a.datagrams_to_send(t), t + D)
    assert events(b) == [LinkFailed("abort_received")]
    with pytest.raises(RuntimeError):
        a.send(b"x", t)


def test_delayed_ack_timer_and_ack_every() -> None:
    a, b = make_pair(cfg(max_ack_delay_s=0.0002))
    t = establish(a, b)
    a.send(b"1", t)
    a.send(b"2", t)
    a.send(b"3", t)
    d1, d2, d3 = a.datagrams_to_send(t)
    feed(b, [d1], t + D)
    assert b.datagrams_to_send(t + D) == []  # held: first of ack_every=2
    assert b.next_deadline() == pytest.approx(t + D + 0.0002)
    feed(b, [d2], t + D)
    (ack,) = b.datagrams_to_send(t + D)  # second packet: ACK now
    h, _ = wl.decode_untrusted(ack)
    assert h.ptype == wl.PacketType.ACK and h.ack == (a.isn + 2) % 2**32
    # The last packet of a burst carries ACK_NOW: no delayed-ACK wait.
    assert wl.decode_untrusted(d3)[0].flags & wl.LinkFlags.ACK_NOW
    feed(b, [d3], t + 2 * D)
    assert len(b.datagrams_to_send(t + 2 * D)) == 1


def test_a_message_sent_without_ack_now_waits_for_the_delayed_ack() -> None:
    a, b = make_pair(cfg(max_ack_delay_s=0.0002))
    t = establish(a, b)
    a.send(b"quiet", t, ack_now=False)
    (d1,) = a.datagrams_to_send(t)
    assert not wl.decode_untrusted(d1)[0].flags & wl.LinkFlags.ACK_NOW
    feed(b, [d1], t + D)
    assert b.datagrams_to_send(t + D) == []  # held for the delayed-ACK timer (or b's next DATA)
    assert b.next_deadline() == pytest.approx(t + D + 0.0002)
    # A burst whose last message is quiet still asks, if another in it did not.
    a.send(b"loud", t + D, ack_now=True)
    a.send(b"quiet", t + D, ack_now=False)
    d2, d3 = a.datagrams_to_send(t + D)
    assert [bool(wl.decode_untrusted(d)[0].flags & wl.LinkFlags.ACK_NOW) for d in (d2, d3)] == [False, True]
    # ... and not again once that ACK_NOW has left.
    a.send(b"quiet", t + D, ack_now=False)
    (d4,) = a.datagrams_to_send(t + D)
    assert not wl.decode_untrusted(d4)[0].flags & wl.LinkFlags.ACK_NOW
    # The ACK of a quiet message rides on the receiver's next DATA.
    b.send(b"answer", t + D)
    (answer,) = b.datagrams_to_send(t + D)
    h, _ = wl.decode_untrusted(answer)
    assert h.ptype == wl.PacketType.DATA and h.ack == (a.isn + 1) % 2**32
    assert b.datagrams_to_send(t + D) == [] and b.stats.acks_sent == 0


def _kind(datagram: bytes) -> str:
    return wl.PacketType(wl.decode_untrusted(datagram)[0].ptype).name


def _learn_the_rally(a: Link, b: Link, t: float, answer_s: float) -> float:
    """One ping-pong exchange from ``t``, each side answering ``answer_s``
    after the other's message arrives.  Neither side knows yet that it
    answers, so each ACKs the other's ACK_NOW message at once; each answer
    then comes in time to teach it to hold the next.  Returns when a has
    the pong."""
    a.send(b"ping", t)
    (ping,) = a.datagrams_to_send(t)
    feed(b, [ping], t + D)
    assert [_kind(d) for d in b.datagrams_to_send(t + D)] == ["ACK"]
    b.send(b"pong", t + D + answer_s)
    (pong,) = b.datagrams_to_send(t + D + answer_s)
    feed(a, [pong], t + 2 * D + answer_s)
    assert [_kind(d) for d in a.datagrams_to_send(t + 2 * D + answer_s)] == ["ACK"]
    return t + 2 * D + answer_s


def test_an_ack_now_ack_is_held_for_a_ping_pong_answer() -> None:
    a, b = make_pair(cfg(max_ack_delay_s=0.0002))
    t = _learn_the_rally(a, b, establish(a, b), 50e-6)
    acks = a.stats.acks_sent, b.stats.acks_sent
    for _ in range(5):
        t += 50e-6
        a.send(b"ping", t)
        (ping,) = a.datagrams_to_send(t)
        assert wl.decode_untrusted(ping)[0].flags & wl.LinkFlags.ACK_NOW
        feed(b, [ping], t + D)
        assert b.datagrams_to_send(t + D) == []  # held for the answer...
        assert b.next_deadline() == pytest.approx(t + D + 0.0002)  # ...at most max_ack_delay_s
        b.send(b"pong", t + D + 50e-6)
        (pong,) = b.datagrams_to_send(t + D + 50e-6)  # the answer carries the ACK
        assert wl.decode_untrusted(pong)[0].ack == (a.isn + a.recovery.una + 1) % 2**32
        feed(a, [pong], t + 2 * D + 50e-6)
        assert not a.recovery.has_inflight()  # the ping is acknowledged
        assert a.datagrams_to_send(t + 2 * D + 50e-6) == []
        t += 2 * D + 50e-6
    assert (a.stats.acks_sent, b.stats.acks_sent) == acks  # not one ACK alone
    assert a.stats.ack_holds_expired == b.stats.ack_holds_expired == 0


def _a_held_ping() -> tuple[Link, Link, float]:
    """Two links that have learned the rally, and a's next ping at b, which
    holds its ACK; returns them and the ping's arrival time."""
    a, b = make_pair(cfg(max_ack_delay_s=0.0002))
    t = _learn_the_rally(a, b, establish(a, b), 50e-6)
    a.send(b"ping", t)
    (ping,) = a.datagrams_to_send(t)
    feed(b, [ping], t + D)
    assert b.datagrams_to_send(t + D) == []  # held: b has answered in time so far
    return a, b, t + D


def test_a_held_ack_leaves_when_the_answer_is_late_and_holding_stops() -> None:
    a, b, t = _a_held_ping()
    b.timer_fired(t + 0.0002)  # no answer in time
    assert [_kind(d) for d in b.datagrams_to_send(t + 0.0002)] == ["ACK"]
    assert b.stats.ack_holds_expired == 1
    # The late answer (300 us after the ping) could not have carried it:
    # the next ACK_NOW message is ACKed at once again.
    b.send(b"late", t + 0.0003)
    (late,) = b.datagrams_to_send(t + 0.0003)
    t2 = t + D + 0.0003
    feed(a, [late], t2)
    a.datagrams_to_send(t2)
    a.send(b"ping", t2)
    (ping,) = a.datagrams_to_send(t2)
    feed(b, [ping], t2 + D)
    assert [_kind(d) for d in b.datagrams_to_send(t2 + D)] == ["ACK"]
    assert b.stats.ack_holds_expired == 1


def test_an_ack_now_ack_is_not_held_with_our_data_in_flight_or_for_a_retransmission() -> None:
    a, b = make_pair(cfg(max_ack_delay_s=0.0002))
    t = _learn_the_rally(a, b, establish(a, b), 50e-6)
    # b's own message is in flight (lost): b is not waiting to answer.
    b.send(b"lost", t)
    assert len(b.datagrams_to_send(t)) == 1
    a.send(b"ping", t)
    (ping,) = a.datagrams_to_send(t)
    feed(b, [ping], t + D)
    assert [_kind(d) for d in b.datagrams_to_send(t + D)] == ["ACK"]
    # A retransmission: its sender has waited a whole RTO already.
    a2, b2 = make_pair(cfg(max_ack_delay_s=0.0002))
    t = _learn_the_rally(a2, b2, establish(a2, b2), 50e-6)
    a2.send(b"ping", t)
    a2.datagrams_to_send(t)  # lost
    rto = a2.next_deadline()
    assert rto is not None
    a2.timer_fired(rto)
    (again,) = a2.datagrams_to_send(rto)
    assert wl.decode_untrusted(again)[0].flags & wl.LinkFlags.RETRANSMISSION
    feed(b2, [again], rto + D)
    assert [_kind(d) for d in b2.datagrams_to_send(rto + D)] == ["ACK"]


def test_an_ack_that_leaves_at_once_anyway_does_not_stop_the_holding() -> None:
    a, b = make_pair(cfg(max_ack_delay_s=0.0002))
    t = _learn_the_rally(a, b, establish(a, b), 50e-6)
    a.send(b"ping", t)
    (ping,) = a.datagrams_to_send(t)
    feed(b, [ping], t + D)
    assert b.datagrams_to_send(t + D) == []  # held
    b.send(b"pong", t + D + 50e-6)
    (pong,) = b.datagrams_to_send(t + D + 50e-6)
    t += 2 * D + 50e-6
    feed(a, [pong], t)
    a.send(b"ping", t)
    (ping2,) = a.datagrams_to_send(t)
    # A duplicate of the first ping comes just before the second: its ACK
    # leaves at once (RFC 5681 §4.2) and covers the second too.  No hold
    # was begun, so none ran out...
    feed(b, [ping, ping2], t + D)
    (ack,) = b.datagrams_to_send(t + D)
    assert _kind(ack) == "ACK" and b.stats.ack_holds_expired == 0
    # ... and the next ping's ACK still waits for the answer.
    feed(a, [ack], t + 2 * D)
    a.send(b"ping", t + 2 * D)
    (ping3,) = a.datagrams_to_send(t + 2 * D)
    feed(b, [ping3], t + 3 * D)
    assert b.datagrams_to_send(t + 3 * D) == []


def test_an_answer_the_peer_must_process_first_ends_the_holding() -> None:
    # A Read Request answering a Write, say: the peer's daemon takes the
    # ACK it carries before it can reply, so holding ours for it only moves
    # that work onto the peer's reply.
    a, b, t = _a_held_ping()
    b.send(b"request", t + 50e-6, ack_carrier=False)
    (request,) = b.datagrams_to_send(t + 50e-6)
    assert wl.decode_untrusted(request)[0].ack == (a.isn + a.recovery.una + 1) % 2**32  # carried this once
    t2 = t + D + 50e-6
    feed(a, [request], t2)
    a.send(b"ping", t2)
    (ping,) = a.datagrams_to_send(t2)
    feed(b, [ping], t2 + D)
    assert [_kind(d) for d in b.datagrams_to_send(t2 + D)] == ["ACK"]  # not held again
    assert b.stats.ack_holds_expired == 0


def test_echo_excludes_ack_delay() -> None:
    a, b = make_pair(cfg(max_ack_delay_s=0.0002, ack_every=2))
    t = establish(a, b)
    a.send(b"1", t)
    a.send(b"2", t)
    d1, d2 = a.datagrams_to_send(t)
    # Strip ACK_NOW by delivering only the first: b holds its ACK 200 µs.
    feed(b, [d1], t + D)
    b.datagrams_to_send(t + D)
    b.timer_fired(t + D + 0.0002)
    (ack,) = b.datagrams_to_send(t + D + 0.0002)
    before = a.rtt.latest_s
    feed(a, [ack], t + 2 * D + 0.0002)
    # Network RTT is 1 ms: the 200 µs hold is not counted.
    assert a.rtt.latest_s == pytest.approx(0.001) and before == pytest.approx(0.001)


def test_fast_retransmit_on_sack_hole_without_rto() -> None:
    a, b = make_pair()
    t = establish(a, b)
    for i in range(8):
        a.send(bytes([i]), t)
    pkts = a.datagrams_to_send(t)
    assert len(pkts) == 8
    feed(b, pkts[:2] + pkts[3:], t + D)  # message 2 lost
    acks = b.datagrams_to_send(t + D)
    h, _ = wl.decode_untrusted(acks[-1])
    assert h.sack and h.sack[0] == ((a.isn + 3) % 2**32, (a.isn + 8) % 2**32)
    feed(a, acks, t + 2 * D)
    (retx,) = a.datagrams_to_send(t + 2 * D)
    assert bytes(wl.decode_untrusted(retx)[1]) == bytes([2])
    assert a.stats.fast_retransmits == 1 and a.stats.rto_count == 0
    feed(b, [retx], t + 3 * D)
    assert b.drain_received() == [bytes([i]) for i in range(8)]
    feed(a, b.datagrams_to_send(t + 3 * D), t + 4 * D)
    assert a.acked == 8 and a.bytes_in_flight == 0


def test_duplicates_are_delivered_once() -> None:
    a, b = make_pair()
    t = establish(a, b)
    a.send(b"once", t)
    (d,) = a.datagrams_to_send(t)
    feed(b, [d, d, d], t + D)
    assert b.drain_received() == [b"once"]
    assert b.stats.duplicate == 2


@pytest.mark.parametrize("isn", [2**32 - 3, 2**32 - 1])
def test_sequence_wraparound(isn: int) -> None:
    a, b = make_pair()
    a.isn = isn  # start just below the wrap
    t = establish(a, b)
    msgs = [i.to_bytes(2, "big") for i in range(12)]
    for m in msgs:
        a.send(m, t)
    pkts = a.datagrams_to_send(t)
    seqs = [wl.decode_untrusted(p)[0].seq for p in pkts]
    assert seqs[:4] == [(isn + i) % 2**32 for i in range(4)] and min(seqs) < 10
    feed(b, pkts[:2] + pkts[4:], t + D)  # a hole right at the wrap
    feed(a, b.datagrams_to_send(t + D), t + 2 * D)
    feed(b, a.datagrams_to_send(t + 2 * D), t + 3 * D)
    assert b.drain_received() == msgs
    feed(a, b.datagrams_to_send(t + 3 * D), t + 4 * D)
    assert a.acked == 12


def test_receive_window_is_respected() -> None:
    a, b = make_pair(cfg(rwnd_packets=4))
    t = establish(a, b)
    for i in range(10):
        a.send(bytes([i]), t)
    now = t
    got: list[bytes] = []
    for _ in range(10):
        out = a.datagrams_to_send(now)
        assert len(out) <= 4
        feed(b, out, now + D)
        assert len(b.receiver.delivered) <= 4  # never more than rwnd undrained
        feed(a, b.datagrams_to_send(now + D), now + 2 * D)
        now += 2 * D
        if len(b.receiver.delivered) == 4:
            # The window is closed until the owner drains: nothing may come.
            assert a.datagrams_to_send(now) == []
            got += b.drain_received()  # reopens: a window update goes out
            feed(a, b.datagrams_to_send(now), now + D)
            now += D
    got += b.drain_received()
    assert got == [bytes([i]) for i in range(10)]
    assert b.stats.out_of_window == 0


def test_send_rejects_oversize_and_bounds_queue() -> None:
    a, _ = make_pair(cfg(send_buffer_packets=5))
    with pytest.raises(ValueError):
        a.send(bytes(a.config.max_payload + 1), 0.0)
    assert a.send_space() == 5
    for _ in range(5):
        a.send(b"", 0.0)
    assert a.send_space() == 0


def test_garbage_is_counted_not_raised() -> None:
    a, b = make_pair()
    t = establish(a, b)
    a.send(b"data", t)
    (good,) = a.datagrams_to_send(t)
    bad_crc = bytearray(good)
    bad_crc[-5] ^= 0xFF
    wrong_tag = wl.encode(wl.LinkHeader(wl.PacketType.DATA, 0, 0, b.tag ^ 1, 0, 0, 0, 0, 1), b"x")
    bad_type = bytearray(wl.encode(wl.LinkHeader(wl.PacketType.ACK, 0, 0, b.tag, 0, 0, 0, 0, 1)))
    bad_type[1] = 77
    from udpverbs.wire.crc import crc32c
    bad_type[-4:] = crc32c(bytes(bad_type[:-4])).to_bytes(4, "big")
    init_garbage = wl.encode(wl.LinkHeader(wl.PacketType.INIT, 0, 0, 0, 0, 0, 0, 0, 1), b"short")
    for junk in (b"", b"abc", bytes(bad_crc), wrong_tag, bytes(bad_type), init_garbage,
                 bytes(200), good[:20]):
        b.datagram_received(junk, t + D)
    s = b.stats
    assert (s.truncated, s.bad_crc, s.bad_tag, s.malformed) == (3, 2, 1, 2)
    assert b.state == LinkState.ESTABLISHED and b.drain_received() == []
    b.datagram_received(good, t + D)
    assert b.drain_received() == [b"data"]


def test_packets_for_another_connection_are_dropped() -> None:
    a, b = make_pair()
    t = establish(a, b)
    c, d = make_pair(seed=3)
    establish(c, d)
    c.send(b"stray", t)
    feed(b, c.datagrams_to_send(t), t + D)  # right format, wrong conn_tag
    assert b.drain_received() == [] and b.stats.bad_tag == 1


def test_peer_that_dropped_its_link_resets_ours() -> None:
    c = cfg()
    a, b = make_pair(c)
    t = establish(a, b)
    b2 = Link(c, rng=random.Random(77), incarnation=2)  # same daemon run, new link
    b2.connect(t)
    feed(a, b2.datagrams_to_send(t), t + D)
    _unanswered_claim(a, t + D)
    assert events(a) == [LinkFailed("peer_reset")]
    # A retransmitted copy of a's own peer's INIT (same tag) is not a reset.
    a3, b3 = make_pair(c, seed=11)
    b3.connect(0.0)
    init = b3.datagrams_to_send(0.0)
    feed(a3, init, D)
    feed(b3, a3.datagrams_to_send(D), 2 * D)
    feed(a3, b3.datagrams_to_send(2 * D), 3 * D)
    feed(a3, init, 4 * D)
    assert a3.state == LinkState.ESTABLISHED and LinkFailed("peer_reset") not in events(a3)


def test_window_update_reopens_a_zero_window_at_once() -> None:
    a, b = make_pair(cfg(rwnd_packets=4))
    t = establish(a, b)
    for i in range(6):
        a.send(bytes([i]), t)
    feed(b, a.datagrams_to_send(t), t + D)
    feed(a, b.datagrams_to_send(t + D), t + 2 * D)  # window 0 advertised
    assert a.datagrams_to_send(t + 2 * D) == []
    assert b.drain_received() == [bytes([i]) for i in range(4)]
    (update,) = b.datagrams_to_send(t + 2 * D)  # no waiting for the keep-alive
    assert wl.decode_untrusted(update)[0].rwnd == 4
    feed(a, [update], t + 3 * D)
    assert len(a.datagrams_to_send(t + 3 * D)) == 2  # messages 4 and 5


def test_window_does_not_grow_when_not_the_limit() -> None:
    # RFC 7661: the peer's 4-packet window, not cwnd, limits this sender, so
    # ACKs must not inflate a window that is never used.
    a, b = make_pair(cfg(cc="aimd", cc_params={}, rwnd_packets=4))
    t = establish(a, b)
    start = a.cwnd_bytes
    now = t
    for i in range(200):
        a.send(bytes([i % 256]), now)
    for _ in range(60):
        feed(b, a.datagrams_to_send(now), now + D)
        b.drain_received()
        feed(a, b.datagrams_to_send(now + D), now + 2 * D)
        now += 2 * D
    assert a.acked == 200
    assert a.cwnd_bytes == start


def test_delivered_messages_never_alias_a_buffer_that_can_change() -> None:
    # In order from an immutable datagram, a message is a view (no copy);
    # from a bytearray the caller may reuse, it is a copy.
    a, b = make_pair()
    now = establish(a, b)
    a.send(b"first", now)
    a.send(b"second", now)
    first, second = a.datagrams_to_send(now)
    b.datagram_received(first, now)  # bytes
    reused = bytearray(second)
    b.datagram_received(reused, now)
    got = b.drain_received()
    assert [bytes(m) for m in got] == [b"first", b"second"]
    assert isinstance(got[0], memoryview) and got[0].readonly
    reused[:] = bytes(len(reused))  # the caller reuses its receive buffer
    assert bytes(got[1]) == b"second"


def test_time_a_datagram_waited_for_its_reader_is_not_path_delay() -> None:
    # A kernel arrival stamp lets the owner say when a datagram reached the
    # host.  The wait until the daemon ran is scheduling: congestion
    # control's sample leaves it out (ours here, and the peer's through the
    # echo), the RTO estimator keeps it.
    a, b = make_pair()
    t = establish(a, b)
    wait = 0.003
    a.send(b"x", t)
    (d,) = a.datagrams_to_send(t)
    b.datagram_received(d, t + D + wait, arrived=t + D)  # b ran 3 ms late
    (ack,) = b.datagrams_to_send(t + D + wait)
    samples = []
    a.cc.on_packets_acked = lambda acked, rtt_s, now, limited=True: samples.append(rtt_s)  # type: ignore[method-assign]
    a.datagram_received(ack, t + 2 * D + wait + wait, arrived=t + 2 * D + wait)  # and so did a
    assert samples == [pytest.approx(2 * D)]  # the path alone: b's wait went into its echoed hold
    assert a.rtt.latest_s == pytest.approx(2 * D + wait)  # the timer's sample keeps a's own wait


def test_a_burst_is_stamped_packet_by_packet_when_given_a_clock() -> None:
    a, b = make_pair()
    t = establish(a, b)
    for i in range(3):
        a.send(bytes([i]), t)
    ticks = iter([t + 0.0001, t + 0.0002, t + 0.0003])
    out = a.datagrams_to_send(t, clock=lambda: next(ticks))
    assert [wl.decode_untrusted(d)[0].ts_us for d in out] == [int((t + k * 0.0001) * 1e6) for k in (1, 2, 3)]
    # Without a clock, the whole burst carries ``now``.
    for i in range(2):
        a.send(bytes([i]), t)
    assert {wl.decode_untrusted(d)[0].ts_us for d in a.datagrams_to_send(t + 0.001)} == {int((t + 0.001) * 1e6)}
