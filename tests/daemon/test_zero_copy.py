"""Large tagged segments sent from the registered region (zero copy) are
the datagrams the send lane's buffer would have carried.

Two sending devices built from the same seed, both with the compiled lanes,
one sending a large Write's segments as ``Gather`` messages (``sendmsg`` of
header, region slice and CRC) and one building them into a buffer as
before, get the same work: RDMA Writes of 64 KB datagrams on a 65,507-byte
path, and Reads their peer posts (answered with Read Responses of the same
size).  Every datagram the peer sends reaches both alike, through a network
that loses, duplicates, swaps and corrupts, so retransmissions (which the
zero-copy sender rebuilds from the region) are compared too.  After every
step both must emit the same bytes and be in the same link state; at the
end the peer's memory holds what was written.  With a cluster key the
zero-copy path does not apply, and the sender's datagrams are the same.
"""

from __future__ import annotations

import collections
import random
import socket

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from udpverbs.bench.inprocess import MR_LEN, Host
from udpverbs.daemon.clusterkey import Guard
from udpverbs.daemon.policy import IN_PASS_ORDER
from udpverbs.daemon.peer import ZERO_COPY_MIN, PeerLink
from udpverbs.transport.link import Gathered, PathMtu
from udpverbs.wire import native
from udpverbs.wire.shm import WcStatus as W, WrOpcode

from .twins import carry, link_state, turn, twins

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler here: the daemon uses the Python path")

_STEP_S = 0.001
_MTU = 65507  # the largest UDP payload over IPv4: loopback's datagrams
_READ = WrOpcode.IBV_WR_RDMA_READ
_KEY = bytes(range(32))


def _pass(fast: Host, slow: Host, pf: object, ps: object, now: float) -> tuple[list[bytes], int]:
    """One pass of both senders: the same bytes, the same link state;
    returns what they sent and how many of the fast one's were gathered."""
    out_f, out_s = turn(fast, pf, now, fast.dev.clock), turn(slow, ps, now, slow.dev.clock)
    gathered = sum(type(d) is Gathered for d in out_f)
    assert not any(type(d) is Gathered for d in out_s)
    out_f, out_s = [bytes(d) for d in out_f], [bytes(d) for d in out_s]
    assert out_f == out_s  # the same datagrams, byte for byte
    assert link_state(pf) == link_state(ps)
    assert pf.link.recovery.in_flight() == ps.link.recovery.in_flight()  # type: ignore[attr-defined]
    return out_f, gathered


def _exchange(seed: int, writes: list[tuple[int, int]], reads: list[int], loss: float,
              key: bool = False) -> tuple[tuple[Host, Host, Host], int]:
    """``fast`` (zero copy) and ``slow`` (the send lane's buffer) each Write
    ``writes`` ((offset, length) in their region) to ``peer`` and answer its
    Reads of ``reads`` bytes; returns the hosts and how many datagrams
    ``fast`` sent gathered."""
    rng = random.Random(seed)
    fast, slow = (Host("127.0.0.2", gso=True, mtu=_MTU, native=True, policy=IN_PASS_ORDER) for _ in range(2))
    peer = Host("127.0.0.3", gso=False, mtu=_MTU, native=True, policy=IN_PASS_ORDER)
    slow.dev.zero_copy = False
    if key:  # sealing happens at the socket: what the link sends is compared unsealed
        fast.dev.udp.seal_with(Guard(_KEY, ("127.0.0.2", 1), collections.Counter()))
    try:
        return (fast, slow, peer), _run(rng, (fast, slow, peer), writes, reads, loss)
    except BaseException:
        _close(fast, slow, peer)
        raise


def _path_mtu(pls: tuple[PeerLink, ...]) -> None:
    """What the device's pass does with its links' PathMtu events (``turn`` does not)."""
    for pl in pls:
        while (ev := pl.link.next_event()) is not None:
            if isinstance(ev, PathMtu):
                pl.path_mtu(ev)


def _run(rng: random.Random, hosts: tuple[Host, Host, Host], writes: list[tuple[int, int]], reads: list[int],
         loss: float) -> int:
    fast, slow, peer = hosts
    clock, pp, pf, ps = twins(peer, fast, slow)
    for _ in range(100):  # the links search up to 64 KB datagrams (PMTUD) before the Writes
        clock[0] += _STEP_S
        carry(peer, pp, _pass(fast, slow, pf, ps, clock[0])[0], ((fast, pf), (slow, ps)), rng, 0.0, clock[0])
        _path_mtu((pp, pf, ps))
        if min(pp.max_data, pf.max_data, ps.max_data) > 60_000:
            break
    assert min(pp.max_data, pf.max_data, ps.max_data) > 60_000 > ZERO_COPY_MIN
    fast.mr.view[:] = slow.mr.view[:] = rng.randbytes(MR_LEN)
    at = 0
    for i, (off, n) in enumerate(writes):
        for h in (fast, slow):
            h.post_write(i, off, n, peer, at)
        at += n
    for i, length in enumerate(reads):  # into the peer's upper half, from the senders' regions
        peer.post_write(100 + i, MR_LEN // 2 + i * 4096, length, fast, 4096 * i, opcode=_READ)
    done_f: list[tuple[int, int]] = []
    done_s: list[tuple[int, int]] = []
    done_p: list[tuple[int, int]] = []
    held: list[bytes] = []
    gathered = 0
    for _ in range(4000):
        clock[0] += _STEP_S
        out, k = _pass(fast, slow, pf, ps, clock[0])
        gathered += k
        held += out
        if rng.random() < 0.3:
            continue
        carry(peer, pp, held, ((fast, pf), (slow, ps)), rng, loss, clock[0])
        held = []
        done_f += fast.completions()
        done_s += slow.completions()
        done_p += peer.completions()
        if len(done_f) == len(writes) and len(done_p) == len(reads):
            break
    assert done_f == done_s == [(i, W.IBV_WC_SUCCESS) for i in range(len(writes))]
    assert sorted(done_p) == [(100 + i, W.IBV_WC_SUCCESS) for i in range(len(reads))]
    src = bytes(fast.mr.view)
    at = 0
    for off, n in writes:
        assert bytes(peer.mr.view[at:at + n]) == src[off:off + n]
        at += n
    for i, length in enumerate(reads):
        assert bytes(peer.mr.view[MR_LEN // 2 + i * 4096:][:length]) == src[4096 * i:4096 * i + length]
    assert pf.link.stats.as_dict() == ps.link.stats.as_dict()
    return gathered


def _close(*hosts: Host) -> None:
    for h in hosts:
        h.close()


_WRITE = st.tuples(st.integers(0, MR_LEN // 4), st.integers(1, 170_000))  # 3 of them fit below the sinks


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), writes=st.lists(_WRITE, min_size=1, max_size=3),
       reads=st.lists(st.integers(0, 140_000), max_size=2), loss=st.sampled_from([0.0, 0.05, 0.15]))
def test_gathered_datagrams_are_the_send_lanes(seed: int, writes: list[tuple[int, int]], reads: list[int],
                                               loss: float) -> None:
    hosts, _ = _exchange(seed, writes, reads, loss)
    _close(*hosts)


@pytest.mark.parametrize("loss", [0.0, 0.1])
def test_large_writes_leave_gathered_and_retransmit_alike(loss: float) -> None:
    hosts, gathered = _exchange(7, [(0, 300_000), (3, 65_536), (11, 130_001)], [131_000], loss)
    try:
        fast, slow, _ = hosts
        # every large segment's first transmission was gathered; with loss
        # the retransmissions were rebuilt from the region, the same bytes
        assert gathered >= 10 and fast.dev.stats["tx_gather_segments"] >= gathered
        assert "tx_gather_segments" not in slow.dev.stats
        if loss:
            assert fast.qp.link.link.stats.retransmits > 0  # type: ignore[union-attr]
    finally:
        _close(*hosts)


def test_a_cluster_key_keeps_the_copy() -> None:
    # A seal covers the joined datagram, so the sender builds it as before.
    hosts, gathered = _exchange(3, [(0, 300_000)], [], 0.05, key=True)
    try:
        assert gathered == 0 and "tx_gather_segments" not in hosts[0].dev.stats
    finally:
        _close(*hosts)


def test_a_gathered_datagram_leaves_in_one_sendmsg() -> None:
    # What the socket receives is the datagram's parts joined by the kernel.
    hosts, _ = _exchange(1, [(0, 70_000)], [], 0.0)
    fast = hosts[0]
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.bind(("127.0.0.1", 0))
        rx.settimeout(5)
        lead, payload = b"L" * 50, fast.mr.view[100:100 + 60_000]
        d = Gathered((lead, payload, b"TAIL"))
        fast.dev.udp.sock = fast.dev.udp.sock.sock  # the real socket, not twins' Recorder
        fast.dev.udp.send_segmented([b"x" * 10, d, b"y" * 10], rx.getsockname())
        got = [rx.recv(1 << 16) for _ in range(3)]
        assert got == [b"x" * 10, lead + bytes(payload) + b"TAIL", b"y" * 10]
        assert fast.dev.stats["tx_gathered"] == 1
    finally:
        rx.close()
        _close(*hosts)
