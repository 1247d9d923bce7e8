"""The Read batch's responder (``daemon/readbatch.py``) does what the usual responder path does.

Two responding devices built from the same seed, one with the compiled
lanes (where a GRO buffer of Read Requests is checked and answered in one
call, the responses' payloads copied from the region when they leave) and
one without, get the same datagrams from one requester: ORD windows of
small Reads, mixed with Reads of several segments or of another size,
with atomics (which share the IRRQ with the Reads, in order), with RDMA
Writes into the bytes the Reads read, and with requests the batch must
leave to the usual path (a bad rkey, a region without remote read access,
out of bounds), lost, duplicated, swapped, corrupted and coalesced.  After
every step they must answer with the same bytes, be in the same link
state and have written the same CQEs; at the end they hold the same
memory, counters and QP state.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from udpverbs.bench.inprocess import MR_LEN, Host
from udpverbs.wire import native
from udpverbs.wire.shm import QPState as S, WrOpcode

from .twins import assert_twins_agree, close_all, turn, twins, twins_answer, with_twins

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler here: the daemon uses the Python path")

_STEP_S = 0.001
_SRC = 64 * 1024  # the bytes the Reads read, at the start of the responders' region
_SINK_AT = MR_LEN // 2  # where the requester's Reads land
_READ, _FADD, _WRITE = WrOpcode.IBV_WR_RDMA_READ, WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD, WrOpcode.IBV_WR_RDMA_WRITE
_ORD = 16
_SPARE = 0x900000  # where Host.spare_stag's region is (local access only)
_LANE = ("rx_native_datagrams", "rx_native_requests", "rx_read_batched", "rx_atomic_batched", "tx_native_datagrams")


def _post(a: Host, peer: Host, i: int, kind: str, at: int, rng: random.Random, no_access: int) -> None:
    sink = _SINK_AT + 4096 * (i % 64)
    size, rkey = 64, None
    if kind == "fadd":
        a.post_write(i, sink, 8, peer, 8 * (at % 512), opcode=_FADD, compare_add=rng.getrandbits(64))
        return
    if kind == "write":
        a.post_write(i, sink, 64, peer, at)  # into the bytes a Read may read
        return
    if kind == "other_size":
        size = 100
    elif kind == "big":
        size = 3000  # several segments
    elif kind == "oob":
        at = MR_LEN - 32
    elif kind == "bad_rkey":
        rkey = peer.mr.stag ^ 0x100
    elif kind == "no_access":
        rkey, at = no_access, _SPARE - peer.mr.addr  # a page of that region
    a.post_write(i, sink, size, peer, at, rkey, opcode=_READ)


def _stream(seed: int, ops: list[tuple[str, int]], loss: float, gro: float, ird: int = _ORD) -> tuple[Host, Host, Host]:
    """A posts ``ops`` ((kind, source offset)) to both responders (whose IRD is
    ``ird``, A's ORD 16); returns A and them."""
    rng = random.Random(seed)
    return with_twins(lambda a, fast, slow: _exchange(rng, a, fast, slow, ops, loss, gro, ird))


def _exchange(rng: random.Random, a: Host, fast: Host, slow: Host, ops: list[tuple[str, int]], loss: float,
              gro: float, ird: int) -> tuple[Host, Host, Host]:
    clock, pa, pf, ps = twins(a, fast, slow)
    a.qp.attrs["max_rd_atomic"] = _ORD
    src = rng.randbytes(_SRC)
    no_access = [h.spare_stag() for h in (fast, slow)]
    assert no_access[0] == no_access[1]
    for h in (fast, slow):
        h.qp.attrs["max_dest_rd_atomic"] = ird
        h.mr.view[:_SRC] = src
    a.mr.view[_SINK_AT:] = rng.randbytes(MR_LEN - _SINK_AT)  # what a Write carries
    for i, (kind, at) in enumerate(ops):
        _post(a, fast, i, kind, at, rng, no_access[0])
    done: list[tuple[int, int]] = []
    held: list[bytes] = []
    for step in range(3000):
        clock[0] += _STEP_S
        now = clock[0]
        held += turn(a, pa, now)
        if rng.random() < 0.3:
            continue
        twins_answer(held, (a, fast, slow), (pa, pf, ps), rng, loss, gro, now)
        held = []
        done += a.completions()
        assert fast.cqes() == slow.cqes()
        if len(done) == len(ops) or a.qp.state == S.IBV_QPS_ERR and step > 100:
            break
    assert_twins_agree(fast, slow, pf, ps, _LANE)
    assert (fast.qp.rx_read_msn, fast.qp.atomic_resp_msn, len(fast.qp.irrq)) == \
        (slow.qp.rx_read_msn, slow.qp.atomic_resp_msn, len(slow.qp.irrq))
    return a, fast, slow


_OP = st.tuples(st.sampled_from(["read"] * 12 + ["fadd"] * 2 + ["write", "other_size", "big"]),
                st.integers(0, _SRC - 3000))
#: at most one request the responder refuses, somewhere in the stream (it ends the QP)
_FAULT = st.one_of(st.none(), st.tuples(st.sampled_from(["oob", "bad_rkey", "no_access"]), st.integers(0, 60),
                                        st.integers(1, 3)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32), ops=st.lists(_OP, min_size=1, max_size=60), fault=_FAULT,
       loss=st.sampled_from([0.0, 0.0, 0.02, 0.1]), gro=st.sampled_from([0.7, 1.0]))
def test_the_read_batch_and_the_usual_path_agree(seed: int, ops: list[tuple[str, int]],
                                                 fault: tuple[str, int, int] | None, loss: float, gro: float) -> None:
    if fault is not None:
        kind, at, n = fault
        ops = ops[:at] + [(kind, 0)] * n + ops[at:60 - n]
    close_all(*_stream(seed, ops, loss, gro))


def test_an_ord_window_of_reads_is_answered_in_batches() -> None:
    ops = [("read", 64 * i) for i in range(60)]
    a, fast, slow = _stream(5, ops, 0.0, 1.0)
    try:
        assert fast.dev.stats["rx_read_batched"] >= 40 and "rx_read_batched" not in slow.dev.stats
        assert a.qp.state == S.IBV_QPS_RTS
        # every Read brought the responder's bytes into its sink
        for i in range(60):
            sink = _SINK_AT + 4096 * i
            assert bytes(a.mr.view[sink:sink + 64]) == bytes(fast.mr.view[64 * i:64 * i + 64])
    finally:
        close_all(a, fast, slow)


@pytest.mark.parametrize("kind", ["oob", "bad_rkey", "no_access"])
def test_a_request_the_batch_leaves_behind_ends_alike(kind: str) -> None:
    # (after an ORD window, several: they start a GRO buffer, whose first request the batch checks)
    ops = [("read", 64)] * 16 + [(kind, 128)] * 3 + [("read", 64)] * 20
    a, fast, slow = _stream(9, ops, 0.0, 1.0)
    try:
        assert fast.dev.stats["rx_read_batched"] >= 8
        assert fast.dev.stats["terminate_sent"] == 1 and fast.qp.state == S.IBV_QPS_ERR
        assert a.qp.state == S.IBV_QPS_ERR
    finally:
        close_all(a, fast, slow)


def test_more_requests_than_the_ird_end_alike() -> None:
    # a requester that does not keep to our IRD: the request that finds
    # the IRRQ full is refused by the usual path's Terminate
    a, fast, slow = _stream(3, [("read", 64)] * 40, 0.0, 1.0, ird=6)
    try:
        assert fast.dev.stats["rx_read_batched"] >= 4
        assert fast.dev.stats["terminate_sent"] == 1 and a.qp.state == S.IBV_QPS_ERR
    finally:
        close_all(a, fast, slow)


def test_reads_and_atomics_take_their_turns() -> None:
    # batches of Reads and of atomics one behind the other on the IRRQ:
    # the Atomic Responses keep their MSNs (queue 3) and every answer its place
    ops = ([("read", 0)] * 6 + [("fadd", 1)] * 5 + [("read", 640)] * 4 + [("big", 0)]) * 4
    a, fast, slow = _stream(11, ops, 0.0, 1.0)
    try:
        assert fast.dev.stats["rx_read_batched"] >= 10 and fast.dev.stats["rx_atomic_batched"] >= 10
        assert a.qp.state == S.IBV_QPS_RTS
    finally:
        close_all(a, fast, slow)


def test_a_response_carries_the_bytes_as_they_are_when_it_leaves() -> None:
    # Reads and then Writes into the bytes they read, in one pass: the
    # responses leave when the pass pumps, after the Writes are placed,
    # with the bytes the Writes left, as the usual path reads them then
    ops = ([("read", 0)] * 8 + [("write", 0)]) * 6
    a, fast, slow = _stream(13, ops, 0.0, 1.0)
    try:
        assert fast.dev.stats["rx_read_batched"] >= 10 and a.qp.state == S.IBV_QPS_RTS
    finally:
        close_all(a, fast, slow)
