"""Path MTU discovery (transport/pmtud.py): the state machine alone, two links wired by hand, and netsim.

Sizes are link bodies (``max_payload`` units); a datagram is ``wl.OVERHEAD``
bytes more.  The numbers mirror a daemon with ``--mtu 8972`` on a path of
1500-byte IP packets: base 1440 (1472-byte datagrams), top 8940.
"""

from __future__ import annotations

import hashlib
import random

import pytest

from udpverbs.transport import netsim
from udpverbs.transport.link import Link, LinkConfig, LinkState, PathMtu
from udpverbs.transport.pmtud import MAX_PROBES, SEARCH_STEP, Plpmtud, PmtudState, fragmentable
from udpverbs.wire import link as wl

BASE = 1472 - wl.OVERHEAD
TOP = 8972 - wl.OVERHEAD
FLOOR = 1200 - wl.OVERHEAD
PATH = 1500 - 28  # the largest UDP payload a 1500-byte IP path carries
D = 0.0005  # one-way delay of the hand-wired pair


# --- the state machine alone ----------------------------------------------------

def run_search(m: Plpmtud, carries, refuses=lambda size: False, peer_max: int = TOP) -> tuple[list[int], float]:
    """Drive ``m`` from start to SEARCH_COMPLETE on a path that ``carries``
    a body size (or whose sender ``refuses`` it at once); returns the probe
    sizes sent and the time the search took (timeout 10 ms, RTT 1 ms)."""
    now, timeout, sent = 0.0, 0.01, []
    size = m.start(peer_max, now, timeout)
    for _ in range(200):
        if m.state == PmtudState.SEARCH_COMPLETE:
            return sent, now
        if size:
            sent.append(size)
            if refuses(size):
                size = m.too_big(size, now, timeout)
                continue
            if carries(size):
                now += 0.001
                size = m.probe_acked(size, now, timeout)
                continue
        assert m.deadline is not None
        now = m.deadline
        size = m.timer(now, timeout)
    raise AssertionError(f"no convergence: {m.state}")


@pytest.mark.parametrize("path", [PATH - wl.OVERHEAD, 4000, 7000, TOP, BASE + 10])
def test_search_converges_below_the_path_within_a_step(path: int) -> None:
    m = Plpmtud(FLOOR, BASE, TOP)
    sent, _ = run_search(m, lambda size: size <= path)
    assert m.state == PmtudState.SEARCH_COMPLETE
    assert max(BASE, path - SEARCH_STEP) <= m.plpmtu <= path
    assert sent[0] == TOP  # --mtu first: what an operator who set it expects the path to carry
    assert all(s <= TOP for s in sent) and len(sent) < 40


def test_a_jumbo_path_is_confirmed_by_one_probe() -> None:
    m = Plpmtud(FLOOR, BASE, TOP)
    sent, took = run_search(m, lambda size: True)
    assert sent == [TOP] and m.plpmtu == TOP and took == pytest.approx(0.001)


def test_emsgsize_ends_each_probe_at_once() -> None:
    # The sender's own interface is the narrowest hop: every probe above it
    # is refused as it is sent, so the search takes no time at all.
    m = Plpmtud(FLOOR, BASE, TOP)
    sent, took = run_search(m, lambda size: True, refuses=lambda size: size > PATH - wl.OVERHEAD)
    assert took == 0.0 and m.lost == 0
    assert m.plpmtu == BASE and m.upper < BASE + SEARCH_STEP
    assert sent[0] == TOP and len(sent) <= 12


def test_a_lost_probe_is_tried_max_probes_times() -> None:
    m = Plpmtud(FLOOR, BASE, TOP)
    sent, took = run_search(m, lambda size: size <= 2000)
    assert sent[:MAX_PROBES] == [TOP] * MAX_PROBES and sent[MAX_PROBES] != TOP
    assert m.lost >= MAX_PROBES


def test_the_peers_max_bounds_the_search() -> None:
    m = Plpmtud(FLOOR, BASE, TOP)
    sent, _ = run_search(m, lambda size: True, peer_max=4000)
    assert sent == [4000] and m.plpmtu == 4000 and m.max == 4000


def test_nothing_to_search_when_base_is_the_top() -> None:
    m = Plpmtud(FLOOR, BASE, BASE)
    assert m.start(TOP, 0.0, 0.01) == 0
    assert m.state == PmtudState.SEARCH_COMPLETE and m.deadline is None and m.plpmtu == BASE
    m = Plpmtud(FLOOR, BASE, TOP)
    assert m.start(1000, 0.0, 0.01) == 0  # a peer that takes less than our base
    assert m.plpmtu == 1000 and m.state == PmtudState.SEARCH_COMPLETE


def test_black_hole_goes_back_to_base_then_error_then_recovers() -> None:
    m = Plpmtud(FLOOR, BASE, TOP)
    run_search(m, lambda size: True)
    assert m.plpmtu == TOP
    assert m.black_hole(1.0, 0.01) == BASE
    assert m.state == PmtudState.BASE and m.plpmtu == BASE
    now = 1.0
    for _ in range(MAX_PROBES - 1):
        now = m.deadline
        assert m.timer(now, 0.01) == BASE
    now = m.deadline
    assert m.timer(now, 0.01) == BASE  # not even the base: ERROR, the base tried again later
    assert m.state == PmtudState.ERROR and m.plpmtu == FLOOR
    assert m.deadline == pytest.approx(now + 1.0)
    # the base gets through again: the search runs from it
    assert m.probe_acked(BASE, m.deadline, 0.01) == TOP
    assert m.state == PmtudState.SEARCHING and m.plpmtu == BASE


def test_refused_data_shrinks_the_plpmtu() -> None:
    m = Plpmtud(FLOOR, BASE, TOP)
    run_search(m, lambda size: True)
    # the local interface now takes 4000-byte bodies: data of 8940 is refused
    size = m.too_big(TOP, 5.0, 0.01)
    assert m.plpmtu == BASE and m.upper == TOP - 1 and size == (BASE + TOP) // 2
    # refused below the base: ERROR, at the floor
    m.too_big(1300, 5.0, 0.01)
    assert m.state == PmtudState.ERROR and m.plpmtu == FLOOR


def test_search_complete_searches_again_later() -> None:
    m = Plpmtud(FLOOR, BASE, TOP)
    run_search(m, lambda size: size <= 4000)
    assert m.deadline is not None and m.deadline > 600
    assert m.timer(m.deadline, 0.01) == TOP  # PMTU_RAISE_TIMER: the whole range again


# --- two links, wired by hand ---------------------------------------------------

def cfg(max_payload: int = TOP, **kw) -> LinkConfig:
    base = dict(max_payload=max_payload, base_payload=BASE, min_payload=FLOOR, initial_rto_s=0.05, min_rto_s=0.01,
                max_rto_s=1.0, cc="fixed", cc_params={"window_packets": 16})
    base.update(kw)
    return LinkConfig(**base)


class Wire:
    """Two links and a path between them that carries datagrams up to
    ``mtu`` bytes (longer: dropped silently) or whose sender's stack
    refuses them (``refuse``); each direction takes ``D``."""

    def __init__(self, ca: LinkConfig, cb: LinkConfig | None = None, mtu: int = PATH, refuse: bool = False) -> None:
        self.a = Link(ca, rng=random.Random(1), incarnation=1)
        self.b = Link(cb or ca, rng=random.Random(2), incarnation=2)
        self.mtu, self.refuse = mtu, refuse
        self.now = 0.0
        self.dropped: list[int] = []
        self.sizes: list[int] = []  # every datagram that crossed
        self.received: list[bytes] = []

    def step(self) -> None:
        """Move what each side sends now; advance the clock by D (firing timers)."""
        for src, dst in ((self.a, self.b), (self.b, self.a)):
            for _ in range(16):
                refused = False
                for d in src.datagrams_to_send(self.now):
                    n = len(d)
                    if n > self.mtu and not (src.fragment_above and fragmentable(d, src.fragment_above)):
                        if self.refuse:
                            src.datagram_refused(n, self.now)
                            refused = True
                        else:
                            self.dropped.append(n)
                        continue
                    self.sizes.append(n)
                    dst.datagram_received(d, self.now + D)
                if not refused:
                    break
        self.received += self.b.drain_received()
        self.now += D
        for link in (self.a, self.b):
            dl = link.next_deadline()
            if dl is not None and dl <= self.now:
                link.timer_fired(self.now)

    def run(self, seconds: float) -> None:
        end = self.now + seconds
        while self.now < end:
            self.step()

    def events(self, link: Link) -> list:
        out = []
        while (e := link.next_event()) is not None:
            out.append(e)
        return out


@pytest.mark.parametrize("mtu", [PATH, 4000])
def test_links_find_the_path(mtu: int) -> None:
    w = Wire(cfg(), mtu=mtu)
    w.a.connect(0.0)
    assert w.a.payload_limit == BASE  # before the search: the base, so the link works at once
    w.run(1.0)
    a = w.a
    assert a.state == LinkState.ESTABLISHED
    assert a.pmtud.state == PmtudState.SEARCH_COMPLETE
    assert BASE <= a.payload_limit <= mtu - wl.OVERHEAD and a.payload_limit > mtu - wl.OVERHEAD - SEARCH_STEP
    ends = [e for e in w.events(a) if isinstance(e, PathMtu)]
    assert ends and ends[-1].state == "SEARCH_COMPLETE" and ends[-1].payload == a.payload_limit
    assert ends[-1].path_max == TOP
    st = a.stats
    assert st.pmtu_probes_sent == st.pmtu_probes_acked + st.pmtu_probes_lost  # each one answered or lost
    assert st.pmtu_probes_lost >= MAX_PROBES and (st.pmtu_probes_acked >= 1) == (mtu > PATH)
    assert w.b.stats.pmtu_probes_answered == st.pmtu_probes_acked
    # probes are no data: nothing was resent, no timeout, nothing in flight
    assert st.retransmits == st.rto_count == st.fast_retransmits == 0 and a.bytes_in_flight == 0


def test_probe_loss_is_not_congestion() -> None:
    cc_cfg = cfg(cc="aimd", cc_params={})
    w = Wire(cc_cfg)
    w.a.connect(0.0)
    cwnd = None
    for _ in range(2000):
        w.step()
        if cwnd is None and w.a.state == LinkState.ESTABLISHED:
            cwnd = w.a.cwnd_bytes
        if w.a.pmtud.state == PmtudState.SEARCH_COMPLETE:
            break
    assert w.a.stats.pmtu_probes_lost >= MAX_PROBES and w.dropped
    assert w.a.cwnd_bytes == cwnd  # AIMD would have halved it on a loss it saw


def test_emsgsize_drives_the_search_without_waiting() -> None:
    w = Wire(cfg(), refuse=True)
    w.a.connect(0.0)
    for _ in range(6):  # the handshake and the search: a few one-way delays
        w.step()
    a = w.a
    assert a.pmtud.state == PmtudState.SEARCH_COMPLETE
    assert a.payload_limit == BASE and a.stats.pmtu_too_big >= 5 and a.stats.pmtu_probes_lost == 0


def test_the_peers_max_payload_is_respected() -> None:
    # one side allows jumbo, the other 1472-byte datagrams, on a jumbo path
    w = Wire(cfg(TOP), cfg(BASE), mtu=9000)
    w.a.connect(0.0)
    w.run(0.2)
    assert w.a.payload_limit == w.b.payload_limit == BASE
    assert w.a.stats.pmtu_probes_sent == w.b.stats.pmtu_probes_sent == 0
    assert max(w.sizes) <= BASE + wl.OVERHEAD
    with pytest.raises(ValueError):
        w.b.send(bytes(BASE + 1), w.now)


def test_a_jumbo_path_carries_jumbo_messages() -> None:
    w = Wire(cfg(), mtu=9000)
    w.a.connect(0.0)
    w.run(0.1)
    assert w.a.payload_limit == TOP and w.a.stats.pmtu_probes_sent == 1
    w.a.send(bytes(TOP), w.now)
    w.run(0.01)
    assert [len(m) for m in w.received] == [TOP]


def test_black_hole_falls_back_to_base_and_old_messages_still_arrive() -> None:
    w = Wire(cfg(max_retransmits=20), mtu=9000)
    w.a.connect(0.0)
    w.run(0.1)
    assert w.a.payload_limit == TOP
    w.mtu = PATH  # the route changes: a hop now drops what is larger, silently
    w.a.send(bytes(TOP), w.now)
    w.a.send(bytes(BASE), w.now)
    w.run(0.5)
    a = w.a
    assert a.stats.pmtu_black_holes == 1 and a.stats.rto_count >= 2
    assert a.payload_limit < TOP and a.pmtud.state == PmtudState.SEARCH_COMPLETE
    # the message cut before the fall leaves fragmented (DF clear): both arrive
    assert a.fragment_above == a.payload_limit + wl.OVERHEAD
    assert [len(m) for m in w.received] == [TOP, BASE] and a.state == LinkState.ESTABLISHED


def test_sack_blocks_never_make_a_datagram_too_long() -> None:
    w = Wire(cfg(), refuse=True)
    w.a.connect(0.0)
    w.run(0.05)
    a, b = w.a, w.b
    limit = a.payload_limit + wl.OVERHEAD
    # b receives holes from a, then sends full-size data, which carries its SACK blocks
    for i in range(12):
        a.send(bytes([i]) * 10, w.now)
    out = a.datagrams_to_send(w.now)
    for i, d in enumerate(out):
        if i % 2 == 0:
            b.datagram_received(d, w.now)
    b.send(bytes(b.payload_limit), w.now)
    data = [d for d in b.datagrams_to_send(w.now) if wl.decode_untrusted(d)[0].ptype == wl.PacketType.DATA]
    assert data and all(len(d) <= limit for d in data)


def test_a_probe_ack_that_is_not_ours_changes_nothing() -> None:
    w = Wire(cfg())
    w.a.connect(0.0)
    for _ in range(4):
        w.step()
    a = w.a
    assert a.pmtud.probed
    forged = wl.encode_fields(wl.PacketType.PROBE_ACK, 0, 0, a.tag, (a.peer_isn + a.rcv_nxt) & 0xFFFFFFFF,
                              (a.isn + a.snd_nxt) & 0xFFFFFFFF, 0, 0, 64, wl.encode_probe_ack(a._probe_id + 1, TOP))
    plpmtu = a.plpmtu
    a.datagram_received(forged, w.now)
    assert a.plpmtu == plpmtu and a.stats.pmtu_probes_acked == 0 and a.stats.unexpected == 1


def test_default_links_do_no_discovery() -> None:
    w = Wire(LinkConfig(), mtu=9000)
    w.a.connect(0.0)
    w.run(0.1)
    assert w.a.payload_limit == LinkConfig().max_payload and w.a.pmtud.state == PmtudState.DISABLED
    assert w.a.stats.pmtu_probes_sent == 0 and not [e for e in w.events(w.a) if isinstance(e, PathMtu)]


# --- netsim: a bulk transfer over a path narrower than max_payload ----------------

@pytest.mark.parametrize("local", [False, True], ids=["hop", "local"])
def test_netsim_bulk_over_a_narrow_path(local: bool) -> None:
    sim = netsim.Simulator(random.Random(5))
    c = cfg(cc="efe", cc_params={})
    data = random.Random(9).randbytes(4 << 20)
    a = netsim.Endpoint(sim, Link(c, rng=random.Random(1), incarnation=1), stream=data, name="a")
    b = netsim.Endpoint(sim, Link(c, rng=random.Random(2), incarnation=2), name="b")
    a.channel = netsim.Channel(sim, b, 50e-6, name="a>b")
    b.channel = netsim.Channel(sim, a, 50e-6, name="b>a")
    for ch in (a.channel, b.channel):
        if local:
            ch.local_mtu = PATH
        else:
            ch.mtu = PATH
    sim.schedule(0.0, lambda ep: ep.connect(), a)
    done = sim.run(5.0, stop=lambda: sum(map(len, b.received)) >= len(data)
                   and a.link.pmtud.state == PmtudState.SEARCH_COMPLETE)
    assert done
    got = b"".join(bytes(m) for m in b.received)
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    assert a.link.payload_limit > PATH - wl.OVERHEAD - SEARCH_STEP
    assert a.link.stats.rto_count == 0
    if local:
        assert a.link.stats.pmtu_too_big >= 1 and a.channel.too_big == 0
    else:
        assert a.channel.too_big == a.link.stats.pmtu_probes_lost >= MAX_PROBES
