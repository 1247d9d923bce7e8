"""Twin devices: what the daemon's tests that compare two devices share.

Two receiving devices built from the same seed, one with the compiled lanes
and one without, get the same datagrams from one sender, carried by the
test (``mangle``: lost, duplicated, swapped, corrupted, coalesced into GRO
buffers), on one clock turned by hand; after every step they must answer
with the same bytes.  Twins run in pass order (``policy.IN_PASS_ORDER``),
so that what each sends depends on its input and its clock alone.
"""

from __future__ import annotations

import random
import socket
import sys
from collections.abc import Callable
from typing import Any

from udpverbs.bench.inprocess import Host
from udpverbs.daemon.policy import IN_PASS_ORDER
from udpverbs.wire.shm import QPState as S


def mangle(out: list[bytes], rng: random.Random, loss: float, gro: float) -> list[tuple[bytes, int]]:
    """What the network and the kernel make of ``out``: ``(buffer, segment size)`` receives."""
    arriving: list[bytes] = []
    for d in map(bytes, out):
        x = rng.random()
        if x < loss:
            continue
        if x < 2 * loss:
            i = rng.randrange(len(d))
            d = d[:i] + bytes([d[i] ^ (1 << rng.randrange(8))]) + d[i + 1:]
        arriving.append(d)
        if rng.random() < loss:
            arriving.append(d)
    for i in range(len(arriving) - 1):
        if rng.random() < loss:
            arriving[i], arriving[i + 1] = arriving[i + 1], arriving[i]
    # GRO: a run of equal sizes, the last possibly shorter, in one buffer
    receives: list[tuple[bytes, int]] = []
    i = 0
    while i < len(arriving):
        size = len(arriving[i])
        j = i + 1
        if rng.random() < gro:
            while j < len(arriving) and j - i < 64 and len(arriving[j]) <= size:
                j += 1
                if len(arriving[j - 1]) < size:
                    break
        receives.append((b"".join(arriving[i:j]), size))
        i = j
    return receives


def receive_all(host: Host, pl: object, receives: list[tuple[bytes, int]], now: float) -> None:
    dev = host.dev
    for buf, seg in receives:
        dev.receiver.receive(pl, buf, seg, now, now)  # type: ignore[arg-type]
        while dev.receiver.rest is not None:  # what the next passes would do first (rx_dispatch_budget)
            dev.receiver.receive_rest(now)
    for msg in pl.link.drain_received():  # type: ignore[attr-defined]
        dev.receiver.dispatch(pl, msg)  # type: ignore[arg-type]


class Recorder:
    """A device's socket that keeps what is sent to it instead (the tests
    hand the datagrams over themselves)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sent: list[bytes] = []

    def sendto(self, data: bytes, addr: object) -> int:
        self.sent.append(bytes(data))
        return len(data)

    def sendmsg(self, buffers: list[Any], ancdata: list[tuple[int, int, bytes]] = (),  # type: ignore[assignment]
                flags: int = 0, addr: object = None) -> int:
        """A UDP_SEGMENT send: its datagrams, as the kernel cuts them (a
        twin may group them into sends differently: what leaves is compared)."""
        data = b"".join(bytes(b) for b in buffers)
        size = int.from_bytes(ancdata[0][2], sys.byteorder) if ancdata else len(data)
        self.sent.extend(data[i:i + size] for i in range(0, len(data), size))
        return len(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def turn(host: Host, pl: object, now: float, clock: object = None) -> list[bytes]:
    """The rest of a data-loop pass: timers, completions, pump, what leaves
    (stamped by ``clock`` if given, as the device's loop does): what the
    pump sent at once (``PeerLink.send_alone``), then what the link sends."""
    dev, qp, link = host.dev, host.qp, pl.link  # type: ignore[attr-defined]
    if type(dev.udp.sock) is not Recorder:
        dev.udp.sock = Recorder(dev.udp.sock)  # type: ignore[assignment]
    dev.now = now
    d = link.next_deadline()
    if d is not None and d <= now:
        link.timer_fired(now)
    if qp.state == S.IBV_QPS_ERR:
        qp.flush_rings()
    else:
        if qp.outstanding:
            qp.complete_acked(link.acked)
        qp.pump(64)
    if pl.requests:  # type: ignore[attr-defined]
        pl.flush_requests()  # type: ignore[attr-defined]  # as PeerLink.flush does
    sent, dev.udp.sock.sent = dev.udp.sock.sent, []  # type: ignore[union-attr]
    return sent + link.datagrams_to_send(now, clock)


def carry(peer: Host, pp: Any, held: list[bytes], twins: tuple[tuple[Host, Any], tuple[Host, Any]],
          rng: random.Random, loss: float, now: float, back_gro: float = 0.0) -> None:
    """One round of the network: ``held`` (what the twins sent) reaches
    ``peer`` (its link ``pp``), mangled, and what the peer then sends
    reaches both twins (each ``(host, its link)``) alike (``back_gro``:
    coalesced as ``mangle``'s ``gro``)."""
    receive_all(peer, pp, mangle(held, rng, loss, 0.7), now)
    back = mangle(turn(peer, pp, now, peer.dev.clock), rng, loss, back_gro)
    for host, pl in twins:
        receive_all(host, pl, back, now)


def link_state(pl: object) -> tuple[object, ...]:
    link = pl.link  # type: ignore[attr-defined]
    return (link.rcv_nxt, link.peer_rwnd, link.last_ack_field, link.last_rx_ts, link.receiver.ack_now, link.receiver.ack_count,
            link.acked, link.srtt_s, link.cwnd_bytes, link.stats.as_dict())


def twins(peer: Host, fast: Host, slow: Host) -> tuple[list[float], Any, Any, Any]:
    """Connect ``peer`` with ``fast`` and both twins with ``peer``, every device
    on one hand-turned clock; return the clock and the links (peer's, fast's, slow's).
    ``slow`` is never connected to from ``peer``: it gets ``fast``'s traffic."""
    clock = [1.0]
    for h in (peer, fast, slow):
        # The lane answers a lone request while it receives, the Python path
        # when the pass pumps: the same datagram, with an ACK field of a
        # different moment; likewise the lane sends a ping-pong's run of
        # segments as soon as it is queued, the Python path its segments at
        # the pass's flush; and on the hand-turned clock a hand-over would
        # only count real scheduler turns, differently for each twin.  So
        # twins run in pass order.
        assert h.dev.policy == IN_PASS_ORDER, "make twins with policy=IN_PASS_ORDER"
        h.dev.clock = lambda: clock[0]
    peer.connect(fast)
    fast.connect(peer)
    slow.connect(peer)
    peer_addr = (peer.dev.config.addr, peer.dev.config.port)
    return (clock, peer.dev.links[(fast.dev.config.addr, fast.dev.config.port)], fast.dev.links[peer_addr],
            slow.dev.links[peer_addr])


def with_twins(exchange: Callable[[Host, Host, Host], tuple[Host, Host, Host]]) -> tuple[Host, Host, Host]:
    """Make a peer A and twins (``fast`` with the compiled lanes, ``slow``
    without) and run ``exchange(a, fast, slow)``; on failure close all three."""
    a = Host("127.0.0.2", gso=True, policy=IN_PASS_ORDER)
    fast, slow = (Host("127.0.0.3", gso=False, native=on, policy=IN_PASS_ORDER) for on in (True, False))
    try:
        return exchange(a, fast, slow)
    except BaseException:
        for h in (a, fast, slow):
            h.close()
        raise


def assert_twins_agree(fast: Host, slow: Host, pf: Any, ps: Any, lane: tuple[str, ...]) -> None:
    """At the end of an exchange: the twins hold the same memory, link
    counters, QP state and device counters (but the ``lane`` counters only
    the fast one keeps)."""
    assert bytes(fast.mr.view) == bytes(slow.mr.view)
    assert pf.link.stats.as_dict() == ps.link.stats.as_dict()
    assert fast.qp.state == slow.qp.state
    kept = {k: fast.dev.stats.pop(k, 0) for k in lane}
    assert +fast.dev.stats == +slow.dev.stats
    fast.dev.stats.update(kept)


def requester_twins(ord_: int, peer_native: bool, peer_gso: bool) -> tuple[Host, Host, Host, list[float], Any,
                                                                           Any, Any]:
    """Requesting twins (``fast`` with the compiled lanes, ``slow`` without)
    of ORD ``ord_`` and their peer, of IRD ``ord_``, connected (``twins``):
    ``(fast, slow, peer, clock, peer's link, fast's, slow's)``."""
    fast, slow = (Host("127.0.0.2", gso=True, native=on, policy=IN_PASS_ORDER) for on in (True, False))
    peer = Host("127.0.0.3", gso=peer_gso, native=peer_native, policy=IN_PASS_ORDER)
    clock, pp, pf, ps = twins(peer, fast, slow)
    for h in (fast, slow):
        h.qp.attrs["max_rd_atomic"] = ord_
    peer.qp.attrs["max_dest_rd_atomic"] = ord_
    return fast, slow, peer, clock, pp, pf, ps


def close_all(*hosts: Host) -> None:
    for h in hosts:
        h.close()


def twins_answer(held: list[bytes], hosts: tuple[Host, Host, Host], links: tuple[Any, Any, Any],
                 rng: random.Random, loss: float, gro: float, now: float) -> None:
    """One round of the network for a peer A and twins (``hosts``, their
    ``links``): ``held`` (what A sent) reaches both twins, mangled, and they
    must answer alike (bytes and link state); the fast one's answer reaches A."""
    a, fast, slow = hosts
    pa, pf, ps = links
    receives = mangle(held, rng, loss, gro)
    receive_all(fast, pf, receives, now)
    receive_all(slow, ps, receives, now)
    out_f, out_s = turn(fast, pf, now), turn(slow, ps, now)
    assert out_f == out_s  # the same answers, ACKs, Modified ACKs, NACKs, Terminates
    assert link_state(pf) == link_state(ps)
    receive_all(a, pa, [(d, len(d)) for d in out_f if rng.random() >= loss], now)


def twins_send(fast: Host, slow: Host, pf: Any, ps: Any, now: float) -> list[bytes]:
    """A pass of two sending twins: they must send the same datagrams, byte
    for byte, and be in the same link and QP state; return what they sent."""
    out_f, out_s = turn(fast, pf, now, fast.dev.clock), turn(slow, ps, now, slow.dev.clock)
    assert out_f == out_s  # the same datagrams, byte for byte
    assert link_state(pf) == link_state(ps)
    assert pf.link.recovery.in_flight() == ps.link.recovery.in_flight()
    assert fast.qp.state == slow.qp.state
    return out_f


def twins_round(hosts: tuple[Host, Host, Host], links: tuple[Any, Any, Any], held: list[bytes],
                cqes: tuple[list[tuple[int, ...]], list[tuple[int, ...]]], rng: random.Random, loss: float,
                now: float, state: Callable[[Any], tuple[Any, ...]], back_gro: float = 0.0) -> list[bytes]:
    """A pass of two sending twins (``twins_send``; ``state`` of each QP
    must agree too) talking to a peer (``hosts``: fast, slow, peer; their
    ``links``): now and then what they held reaches the peer and its answer
    both, and the CQEs they then wrote (added to ``cqes``) must agree.
    Returns what is held for the next pass."""
    fast, slow, peer = hosts
    pf, ps, pp = links
    held = held + twins_send(fast, slow, pf, ps, now)
    assert state(fast.qp) == state(slow.qp)
    if rng.random() < 0.3:
        return held
    carry(peer, pp, held, ((fast, pf), (slow, ps)), rng, loss, now, back_gro)
    cqes[0].extend(fast.cqes())
    cqes[1].extend(slow.cqes())
    assert cqes[0] == cqes[1]
    peer.cqes()
    return []
