"""The atomic take (``daemon/atombatch.py``) does what the per-WQE path does.

Two requesting devices built from the same seed, one with the compiled
lanes (where an ORD window of atomic WQEs that are alike is taken off the
SQ and built into Atomic Requests in one call, and a GRO batch of their
Atomic Responses completed in one loop) and one without, are given
the same WQEs: Fetch-and-Adds and Compare-and-Swaps, signaled or not, mixed
with Reads and with WQEs the take must leave to the per-WQE path (a fence,
a sink of two SGEs or of 4 bytes) and with faults (an unknown lkey, a sink
outside its region, an rkey the responder does not know).  One responder
talks to the first; what it sends back reaches both.  After every step the
two must send the same datagrams byte for byte, be in the same link state
and have written the same CQEs; at the end their sinks hold the same
original values.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from udpverbs.bench.inprocess import MR_LEN, Host
from udpverbs.wire import native, rdmap, shm
from udpverbs.wire.shm import QPState as S, SendFlags as F, WcStatus as W, WrOpcode

from .twins import close_all, requester_twins, twins_round

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler here: the daemon uses the Python path")

_STEP_S = 0.001
_ORD = 16
_SINK_AT = MR_LEN // 2
_OPCODE = {"fadd": WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD, "cas": WrOpcode.IBV_WR_ATOMIC_CMP_AND_SWP,
           "read": WrOpcode.IBV_WR_RDMA_READ}
_KINDS = ["", "", "", "", "", "", "unsignaled", "fence", "two", "short", "lkey", "bounds", "rkey"]


def _post(host: Host, peer: Host, wr_id: int, op: str, kind: str, word: int, operands: tuple[int, int]) -> None:
    """An atomic (or Read) WQE written into ``host``'s SQ by hand; ``kind``
    makes it unusual or wrong."""
    ring = host.qp.sq
    ring.prod = ring.hdr.producer
    at = ring.next_slot_offset()
    flags = (0 if kind == "unsignaled" else int(F.IBV_SEND_SIGNALED)) | (int(F.IBV_SEND_FENCE) if kind == "fence" else 0)
    sink = host.mr.addr + (MR_LEN - 4 if kind == "bounds" else _SINK_AT + 8 * wr_id)
    sges = [(sink, 4), (sink + 4, 4)] if kind == "two" else [(sink, 4 if kind == "short" else 8)]
    rkey = peer.mr.stag ^ 0x5A00 if kind == "rkey" else peer.mr.stag
    shm.SEND_WQE_HEAD.pack_into(ring.buf, at, wr_id, peer.mr.addr + 8 * word, int(_OPCODE[op]), flags, len(sges), 0,
                                rkey, 0, *operands)
    lkey = host.mr.stag ^ 0x100 if kind == "lkey" else host.mr.stag
    for i, (addr, n) in enumerate(sges):
        shm.SGE.pack_into(ring.buf, at + shm.SEND_WQE_SG_OFFSET + i * shm.SGE_SIZE, addr, n, lkey)
    ring.push()
    ring.publish()


def _stream(seed: int, runs: list[tuple[str, str, int]], loss: float,
            peer_native: bool = True) -> tuple[Host, Host, Host, list[tuple[int, ...]]]:
    """Post ``runs`` ((operation, kind, how many)) on both twins (at most
    60 WQEs); turn until every WR completed; return the hosts and the CQEs."""
    rng = random.Random(seed)
    fast, slow, peer, clock, pp, pf, ps = requester_twins(_ORD, peer_native, False)
    peer.mr.view[:4096] = rng.randbytes(4096)
    n = 0
    for op, kind, count in runs:
        for _ in range(min(count, 60 - n)):
            word = rng.randrange(8)
            operands = (rng.choice([0, rng.getrandbits(64)]), rng.getrandbits(64))
            for h in (fast, slow):
                _post(h, peer, n, op, kind, word, operands)
            n += 1
    cqes: tuple[list[tuple[int, ...]], list[tuple[int, ...]]] = ([], [])
    held: list[bytes] = []
    for step in range(3000):
        clock[0] += _STEP_S
        held = twins_round((fast, slow, peer), (pf, ps, pp), held, cqes, rng, loss, clock[0], _orrq_state)
        if not fast.qp.outstanding and not fast.qp.sq.available() and step > 40:
            break
    assert bytes(fast.mr.view) == bytes(slow.mr.view)
    return fast, slow, peer, cqes[0]


def _orrq_state(qp: Any) -> tuple[int, int, int]:
    return qp.read_msn, qp.next_req_id, len(qp.orrq)


_RUN = st.tuples(st.sampled_from(["fadd"] * 4 + ["cas"] * 2 + ["read"]), st.sampled_from(_KINDS), st.integers(1, 20))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), runs=st.lists(_RUN, min_size=1, max_size=8),
       loss=st.sampled_from([0.0, 0.0, 0.03, 0.1]))
def test_the_atomic_take_and_the_per_wqe_path_agree(seed: int, runs: list[tuple[str, str, int]], loss: float) -> None:
    close_all(*_stream(seed, runs, loss)[:3])


@pytest.mark.parametrize("op", ["fadd", "cas"])
def test_an_ord_window_of_atomics_is_taken_in_batches(op: str) -> None:
    fast, slow, peer, cqes = _stream(7, [(op, "", 60)], 0.0)
    try:
        assert [c[:2] for c in cqes] == [(i, W.IBV_WC_SUCCESS) for i in range(60)]
        assert fast.dev.stats["tx_batched_atomics"] >= 40 and "tx_batched_atomics" not in slow.dev.stats
        assert fast.dev.stats["rx_atomic_responses_batched"] >= 40
        assert bytes(fast.mr.view[_SINK_AT:_SINK_AT + 480]) != bytes(480)  # the original values landed
    finally:
        close_all(fast, slow, peer)


@pytest.mark.parametrize("kind", ["fence", "two", "short", "lkey", "bounds", "rkey", "unsignaled"])
def test_a_wqe_the_take_leaves_behind_ends_alike(kind: str) -> None:
    fast, slow, peer, cqes = _stream(3, [("fadd", "", 10), ("fadd", kind, 1), ("fadd", "", 10)], 0.0)
    try:
        assert fast.dev.stats["tx_batched_atomics"] >= 8
        statuses = dict(c[:2] for c in cqes)
        if kind in ("fence", "two", "unsignaled"):
            assert set(statuses.values()) == {W.IBV_WC_SUCCESS} and len(statuses) == (20 if kind == "unsignaled" else 21)
        else:
            assert statuses[10] != W.IBV_WC_SUCCESS and fast.qp.state == slow.qp.state
    finally:
        close_all(fast, slow, peer)


def test_a_response_to_another_request_ends_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    # a responder that answers the 31st request with another's identifier:
    # the batch stops there and the usual path's Terminate ends the QP
    encode = rdmap.encode_atomic_response

    def forged(a: rdmap.AtomicResponse) -> bytes:
        return encode(a._replace(req_id=a.req_id + 1) if a.req_id == 30 else a)

    monkeypatch.setattr(rdmap, "encode_atomic_response", forged)
    fast, slow, peer, cqes = _stream(5, [("fadd", "", 60)], 0.0, peer_native=False)
    try:
        assert fast.dev.stats["rx_atomic_responses_batched"] >= 10
        assert W.IBV_WC_BAD_RESP_ERR in dict(c[:2] for c in cqes).values() and fast.qp.state == S.IBV_QPS_ERR
    finally:
        close_all(fast, slow, peer)
