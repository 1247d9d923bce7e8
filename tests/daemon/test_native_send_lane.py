"""The compiled send lane does what the Python path does.

Two sending devices built from the same seed, one with the lane and one
without, are given the same work: RDMA Writes and Sends (one SGE or
several, of odd lengths) and RDMA Reads posted by their peer, which they
answer with Read Responses.  One receiver talks to the first; every datagram it sends (ACKs,
Read Requests, Writes back) reaches both senders alike, through a network
that loses, duplicates, swaps and corrupts.  After every step the two senders
must emit the same datagrams byte for byte and be in the same link state;
at the end the receiver's memory must hold what was written.  The clock is
a number advanced by hand, so nothing depends on scheduling.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from udpverbs.wire import native
from udpverbs.wire.shm import QPState as S, WcStatus as W, WrOpcode

from udpverbs.bench.inprocess import MR_LEN, Host
from udpverbs.daemon.policy import IN_PASS_ORDER

from .twins import carry, link_state, turn, twins

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler here: the daemon uses the Python path")

_STEP_S = 0.001
_READ = WrOpcode.IBV_WR_RDMA_READ
_SEND = WrOpcode.IBV_WR_SEND
#: where the peer's receives start in its region (above the Reads' sinks)
_RECV_AT = 3 * MR_LEN // 4
_SEND_KINDS = (WrOpcode.IBV_WR_SEND, WrOpcode.IBV_WR_SEND_WITH_IMM, WrOpcode.IBV_WR_SEND_WITH_INV)


def _exchange(seed: int, writes: list[list[tuple[int, int]]], reads: list[int], loss: float,
              mtu: int = 1472, sends: Sequence[list[tuple[int, int]]] = ()) -> tuple[Host, Host, Host]:
    """``fast`` and ``slow`` each Write ``writes`` (SGE lists: (offset, length)
    in their region) to ``peer``, then Send ``sends`` (at most the 4
    receives a Host's QP holds, posted in advance), and answer its Reads of
    ``reads`` bytes."""
    rng = random.Random(seed)
    # GSO on: a stream's messages are cut evenly where that pays (equal_segment_size)
    fast, slow = (Host("127.0.0.2", gso=True, mtu=mtu, native=on, policy=IN_PASS_ORDER) for on in (True, False))
    peer = Host("127.0.0.3", gso=False, mtu=mtu, native=True, policy=IN_PASS_ORDER)
    clock, pp, pf, ps = twins(peer, fast, slow)
    fast.mr.view[:] = slow.mr.view[:] = rng.randbytes(MR_LEN)
    at = 0
    for i, sges in enumerate(writes):
        total = sum(n for _, n in sges)
        for h in (fast, slow):
            h.post_write(i, 0, 0, peer, at, sges=sges)
        at += total
    at = _RECV_AT
    for i, sges in enumerate(sends):
        # a plain Send, one with Immediate Data (the envelope flag on its
        # last segment), one that invalidates an STag (in every segment)
        opcode = _SEND_KINDS[i % len(_SEND_KINDS)]
        imm = peer.spare_stag() if opcode == WrOpcode.IBV_WR_SEND_WITH_INV else 0x5EED
        total = sum(n for _, n in sges)
        peer.post_recv(200 + i, at, total)
        for h in (fast, slow):
            h.post_write(len(writes) + i, 0, 0, peer, 0, sges=sges, opcode=opcode, imm=imm)
        at += total
    for i, length in enumerate(reads):  # into the peer's upper half, from the senders' regions
        peer.post_write(100 + i, MR_LEN // 2 + i * 4096, length, fast, 4096 * i, opcode=_READ)
    done_f: list[tuple[int, int]] = []
    done_s: list[tuple[int, int]] = []
    done_p: list[tuple[int, int]] = []
    held: list[bytes] = []
    for _ in range(4000):
        clock[0] += _STEP_S
        out_f, out_s = turn(fast, pf, clock[0], fast.dev.clock), turn(slow, ps, clock[0], slow.dev.clock)
        assert out_f == out_s  # the same datagrams, byte for byte
        assert link_state(pf) == link_state(ps)
        assert pf.link.recovery.in_flight() == ps.link.recovery.in_flight()
        assert pf.link.pacer.next_send_s == ps.link.pacer.next_send_s
        # a batch is let go once sent, whichever path sent it (SACK blocks
        # may keep the lane off for a long time)
        assert all(run[1] > pf.link.snd_nxt for run in pf.link.queued_runs)
        held += out_f
        if rng.random() < 0.3:
            continue
        carry(peer, pp, held, ((fast, pf), (slow, ps)), rng, loss, clock[0])
        held = []
        done_f += fast.completions()
        done_s += slow.completions()
        done_p += peer.completions()
        if len(done_f) == len(writes) + len(sends) and len(done_p) == len(reads) + len(sends):
            break
    assert done_f == done_s == [(i, W.IBV_WC_SUCCESS) for i in range(len(writes) + len(sends))]
    assert sorted(done_p) == [(100 + i, W.IBV_WC_SUCCESS) for i in range(len(reads))] + \
        [(200 + i, W.IBV_WC_SUCCESS) for i in range(len(sends))]
    src = bytes(fast.mr.view)
    at = 0
    for sges in writes:
        for off, n in sges:
            assert bytes(peer.mr.view[at:at + n]) == src[off:off + n]
            at += n
    at = _RECV_AT
    for sges in sends:
        for off, n in sges:
            assert bytes(peer.mr.view[at:at + n]) == src[off:off + n]
            at += n
    for i, length in enumerate(reads):
        assert bytes(peer.mr.view[MR_LEN // 2 + i * 4096:][:length]) == src[4096 * i:4096 * i + length]
    assert pf.link.stats.as_dict() == ps.link.stats.as_dict()
    return fast, slow, peer


def _close(*hosts: Host) -> None:
    for h in hosts:
        h.close()


_SGE = st.tuples(st.integers(0, MR_LEN // 2), st.integers(0, 20_000))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), writes=st.lists(st.lists(_SGE, min_size=1, max_size=3), min_size=1, max_size=4),
       reads=st.lists(st.integers(0, 30_000), max_size=2), loss=st.sampled_from([0.0, 0.02, 0.1]),
       sends=st.lists(st.lists(_SGE, min_size=1, max_size=3), max_size=3))
def test_the_send_lane_and_the_python_path_agree(seed: int, writes: list[list[tuple[int, int]]], reads: list[int],
                                                 loss: float, sends: list[list[tuple[int, int]]]) -> None:
    _close(*_exchange(seed, writes, reads, loss, sends=sends))


@pytest.mark.parametrize("mtu", [1472, 9000])
@pytest.mark.parametrize("loss", [0.0, 0.05])
def test_long_writes_and_reads_go_through_the_lane(mtu: int, loss: float) -> None:
    writes = [[(0, 300_000)], [(1, 1), (7, 5000), (100_000, 50_001)], [(2, 1448 * 3)]]
    sends = [[(3, 100_000)], [(5, 3), (9, 9000), (200_000, 40_001)], [(4, 1444 * 3)]]
    hosts = _exchange(5, writes, [200_000, 3000], loss, mtu, sends)
    try:
        fast, slow, _ = hosts
        # most of it went through the lane (not what a segment spanning two SGEs, a
        # retransmission or a packet with SACK blocks needs)
        framed = fast.dev.dump_stats()["tx_native_datagrams"]
        sent = fast.dev.dump_stats()["link_data_sent"]
        assert framed > 0.7 * sent and "tx_native_datagrams" not in slow.dev.dump_stats()
        assert fast.qp.state == slow.qp.state == S.IBV_QPS_RTS
    finally:
        _close(*hosts)
