"""The Read batch's requester (``daemon/readbatch.py``) does what the per-WQE path does.

Two requesting devices built from the same seed, one with the compiled
lanes (where an ORD window of Read WQEs that are alike is taken off the
SQ and built into Read Requests in one call, and a buffer of their
one-segment Read Responses placed and completed in one call) and one
without, are given the same WQEs: Reads of one size or of several sizes,
signaled or not, mixed with atomics and Writes and with WQEs the take
must leave to the per-WQE path (a fence, a sink of two SGEs or of none)
and with faults (an unknown lkey, a sink outside its region, an rkey the
responder does not know).  One responder talks to the first; what it
sends back, coalesced into GRO buffers, lost, duplicated, swapped and
corrupted, reaches both.  After every step the two must send the same
datagrams byte for byte, be in the same link state and have written the
same CQEs; at the end their sinks hold the same bytes.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from udpverbs.bench.inprocess import MR_LEN, Host
from udpverbs.wire import native, shm
from udpverbs.wire.shm import QPState as S, SendFlags as F, WcStatus as W, WrOpcode

from .twins import close_all, requester_twins, twins_round

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler here: the daemon uses the Python path")

_STEP_S = 0.001
_ORD = 16
_SINK_AT = MR_LEN // 2
_OPCODE = {"read": WrOpcode.IBV_WR_RDMA_READ, "fadd": WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD,
           "write": WrOpcode.IBV_WR_RDMA_WRITE}
_KINDS = ["", "", "", "", "", "", "", "", "unsignaled", "other_size", "big", "fence", "two", "zero"]
_FAULTS = ["lkey", "bounds", "rkey"]


def _post(host: Host, peer: Host, wr_id: int, op: str, kind: str, src: int) -> None:
    """A Read (or atomic, or Write) WQE written into ``host``'s SQ by hand;
    ``kind`` makes it unusual or wrong."""
    ring = host.qp.sq
    ring.prod = ring.hdr.producer
    at = ring.next_slot_offset()
    flags = (0 if kind == "unsignaled" else int(F.IBV_SEND_SIGNALED)) | (int(F.IBV_SEND_FENCE) if kind == "fence" else 0)
    n = {"other_size": 100, "big": 3000, "zero": 0}.get(kind, 8 if op == "fadd" else 64)
    sink = host.mr.addr + (MR_LEN - 32 if kind == "bounds" else _SINK_AT + 4096 * (wr_id % 64))
    sges = [(sink, n // 2), (sink + n // 2, n - n // 2)] if kind == "two" else [(sink, n)]
    rkey = peer.mr.stag ^ 0x5A00 if kind == "rkey" else peer.mr.stag
    shm.SEND_WQE_HEAD.pack_into(ring.buf, at, wr_id, peer.mr.addr + src, int(_OPCODE[op]), flags, len(sges), 0,
                                rkey, 0, 1, 0)
    lkey = host.mr.stag ^ 0x100 if kind == "lkey" else host.mr.stag
    for i, (addr, length) in enumerate(sges):
        shm.SGE.pack_into(ring.buf, at + shm.SEND_WQE_SG_OFFSET + i * shm.SGE_SIZE, addr, length, lkey)
    ring.push()
    ring.publish()


def _stream(seed: int, runs: list[tuple[str, str, int]], loss: float,
            peer_native: bool = True) -> tuple[Host, Host, Host, list[tuple[int, ...]]]:
    """Post ``runs`` ((operation, kind, how many)) on both twins (at most
    60 WQEs); turn until every WR completed; return the hosts and the CQEs."""
    rng = random.Random(seed)
    # (the peer with GSO: its responses reach the twins coalesced)
    fast, slow, peer, clock, pp, pf, ps = requester_twins(_ORD, peer_native, True)
    peer.mr.view[:65536] = rng.randbytes(65536)
    n = 0
    for op, kind, count in runs:
        for _ in range(min(count, 60 - n)):
            src = 8 * rng.randrange(64) if op == "fadd" else rng.randrange(65536 - 3000)
            for h in (fast, slow):
                _post(h, peer, n, op, kind, src)
            n += 1
    cqes: tuple[list[tuple[int, ...]], list[tuple[int, ...]]] = ([], [])
    held: list[bytes] = []
    for step in range(3000):
        clock[0] += _STEP_S
        held = twins_round((fast, slow, peer), (pf, ps, pp), held, cqes, rng, loss, clock[0], _orrq_state, 0.8)
        if not fast.qp.outstanding and not fast.qp.sq.available() and step > 40:
            break
    assert bytes(fast.mr.view) == bytes(slow.mr.view)
    return fast, slow, peer, cqes[0]


def _orrq_state(qp: Any) -> tuple[int, int, int, int]:
    return qp.read_msn, qp.next_sink, qp.next_req_id, len(qp.orrq)


_RUN = st.tuples(st.sampled_from(["read"] * 6 + ["fadd", "write"]), st.sampled_from(_KINDS), st.integers(1, 20))
_FAULT = st.one_of(st.none(), st.tuples(st.just("read"), st.sampled_from(_FAULTS), st.integers(1, 3)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), runs=st.lists(_RUN, min_size=1, max_size=8), fault=_FAULT,
       at=st.integers(0, 8), loss=st.sampled_from([0.0, 0.0, 0.03, 0.1]))
def test_the_read_take_and_the_per_wqe_path_agree(seed: int, runs: list[tuple[str, str, int]],
                                                  fault: tuple[str, str, int] | None, at: int, loss: float) -> None:
    if fault is not None:
        runs = runs[:at] + [fault] + runs[at:]
    close_all(*_stream(seed, runs, loss)[:3])


def test_an_ord_window_of_reads_is_taken_and_completed_in_batches() -> None:
    fast, slow, peer, cqes = _stream(7, [("read", "", 60)], 0.0)
    try:
        assert [c[:2] for c in cqes] == [(i, W.IBV_WC_SUCCESS) for i in range(60)]
        assert fast.dev.stats["tx_batched_reads"] >= 40 and "tx_batched_reads" not in slow.dev.stats
        assert fast.dev.stats["rx_read_responses_batched"] >= 20
        assert bytes(fast.mr.view[_SINK_AT:_SINK_AT + 4096]) != bytes(4096)  # the Reads' bytes landed
    finally:
        close_all(fast, slow, peer)


@pytest.mark.parametrize("kind", ["fence", "two", "zero", "other_size", "big", "unsignaled", *_FAULTS])
def test_a_wqe_the_take_leaves_behind_ends_alike(kind: str) -> None:
    fast, slow, peer, cqes = _stream(3, [("read", "", 10), ("read", kind, 1), ("read", "", 10)], 0.0)
    try:
        assert fast.dev.stats["tx_batched_reads"] >= 8
        statuses = dict(c[:2] for c in cqes)
        if kind in _FAULTS:
            assert statuses[10] != W.IBV_WC_SUCCESS and fast.qp.state == slow.qp.state == S.IBV_QPS_ERR
        else:
            assert set(statuses.values()) == {W.IBV_WC_SUCCESS} and len(statuses) == (20 if kind == "unsignaled" else 21)
    finally:
        close_all(fast, slow, peer)


def test_reads_atomics_and_writes_keep_their_order() -> None:
    runs = [("read", "", 5), ("fadd", "", 4), ("read", "", 6), ("write", "", 3), ("read", "other_size", 4),
            ("read", "", 8)] * 2
    fast, slow, peer, cqes = _stream(5, runs, 0.0)
    try:
        assert [c[:2] for c in cqes] == [(i, W.IBV_WC_SUCCESS) for i in range(60)]
        assert fast.dev.stats["tx_batched_reads"] >= 20 and fast.dev.stats["tx_batched_atomics"] >= 4
    finally:
        close_all(fast, slow, peer)
