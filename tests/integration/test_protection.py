"""Protection: every violation ends as the right WC status, the target untouched, the QPs in ERR."""

from __future__ import annotations

import pytest

from udpverbs import verbs
from udpverbs.verbs.enums import (
    IBV_ACCESS_LOCAL_WRITE,
    IBV_ACCESS_REMOTE_READ,
    IBV_ACCESS_REMOTE_WRITE,
    IBV_EVENT_QP_ACCESS_ERR,
    IBV_EVENT_QP_FATAL,
    IBV_EVENT_QP_REQ_ERR,
    IBV_QPS_ERR,
    IBV_SEND_SIGNALED,
    IBV_WC_LOC_PROT_ERR,
    IBV_WC_REM_ACCESS_ERR,
    IBV_WC_SUCCESS,
    IBV_WC_WR_FLUSH_ERR,
    IBV_WR_RDMA_READ,
    IBV_WR_RDMA_WRITE,
)

from .conftest import ACCESS_ALL, Side, connect_manual

PATTERN = bytes(range(256)) * 64  # 16 KiB the target starts with


@pytest.fixture
def sides(daemons):
    a, b = Side(daemons[0], 1 << 16), Side(daemons[1], 1 << 16)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _wr(wr_id: int, opcode: int, sge: verbs.SGE, rkey: int, raddr: int) -> verbs.SendWR:
    wr = verbs.SendWR(wr_id=wr_id, opcode=opcode, sg=[sge], send_flags=IBV_SEND_SIGNALED)
    wr.set_wr_rdma(rkey, raddr)
    return wr


def _violate(a: Side, b: Side, target: verbs.MR, opcode: int, rkey: int, raddr: int, length: int,
             want: int = IBV_WC_REM_ACCESS_ERR) -> None:
    """Post a violating WR and a good one behind it; check statuses, bytes and states."""
    qa, qb = a.new_qp(), b.new_qp()
    connect_manual(a, qa, b, qb)
    target.write(PATTERN, len(PATTERN), 0)
    a.mr.write(b"\xee" * length, length, 0)
    qa.post_send(_wr(1, opcode, verbs.SGE(a.mr.buf, length, a.mr.lkey), rkey, raddr))
    qa.post_send(_wr(2, IBV_WR_RDMA_WRITE, verbs.SGE(a.mr.buf, 8, a.mr.lkey), b.mr.rkey, b.mr.buf))
    w1, w2 = a.cq.poll_blocking(2, timeout=10)
    assert (w1.wr_id, w1.status) == (1, want)
    assert (w2.wr_id, w2.status) == (2, IBV_WC_WR_FLUSH_ERR)
    assert target.read(len(PATTERN), 0) == PATTERN  # nothing was written
    if opcode == IBV_WR_RDMA_READ:
        assert a.mr.read(length, 0) == b"\xee" * length  # nothing was placed at the requester either
    assert qa.query()[0].qp_state == IBV_QPS_ERR
    if want == IBV_WC_REM_ACCESS_ERR:
        assert qb.query()[0].qp_state == IBV_QPS_ERR
        ev = b.ctx.get_async_event(timeout=5)
        assert (ev.event_type, ev.element) == (IBV_EVENT_QP_ACCESS_ERR, qb.qp_num)
        ev = a.ctx.get_async_event(timeout=5)
        assert (ev.event_type, ev.element) == (IBV_EVENT_QP_FATAL, qa.qp_num)
    # A WR posted after the error is flushed too.
    qa.post_send(_wr(3, IBV_WR_RDMA_WRITE, verbs.SGE(a.mr.buf, 8, a.mr.lkey), b.mr.rkey, b.mr.buf))
    (w3,) = a.cq.poll_blocking(1, timeout=10)
    assert (w3.wr_id, w3.status) == (3, IBV_WC_WR_FLUSH_ERR)


def test_write_with_unknown_stag(sides) -> None:
    a, b = sides
    bogus = (b.mr.rkey + (77 << 8)) & 0xFFFFFFFF
    _violate(a, b, b.mr, IBV_WR_RDMA_WRITE, bogus, b.mr.buf, 100)


def test_write_beyond_the_region(sides) -> None:
    a, b = sides
    _violate(a, b, b.mr, IBV_WR_RDMA_WRITE, b.mr.rkey, b.mr.buf + b.mr.length - 50, 100)


def test_write_before_the_region(sides) -> None:
    a, b = sides
    _violate(a, b, b.mr, IBV_WR_RDMA_WRITE, b.mr.rkey, b.mr.buf - 1, 10)


def test_write_without_remote_write_access(sides) -> None:
    a, b = sides
    ro = verbs.MR(b.pd, 1 << 16, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ)
    _violate(a, b, ro, IBV_WR_RDMA_WRITE, ro.rkey, ro.buf, 100)


def test_read_without_remote_read_access(sides) -> None:
    a, b = sides
    wo = verbs.MR(b.pd, 1 << 16, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)
    _violate(a, b, wo, IBV_WR_RDMA_READ, wo.rkey, wo.buf, 3000)


def test_region_of_another_pd(sides) -> None:
    a, b = sides
    other = verbs.MR(verbs.PD(b.ctx), 1 << 16, ACCESS_ALL)
    _violate(a, b, other, IBV_WR_RDMA_WRITE, other.rkey, other.buf, 100)


def test_stale_stag_after_reregistration(sides) -> None:
    a, b = sides
    old = verbs.MR(b.pd, 1 << 16, ACCESS_ALL)
    stale = old.rkey
    old.close()
    new = verbs.MR(b.pd, 1 << 16, ACCESS_ALL)
    assert new.rkey != stale  # a new STag (index and key drawn at random), and the old one refused
    _violate(a, b, new, IBV_WR_RDMA_WRITE, stale, new.buf, 100)


def test_local_protection_error(sides) -> None:
    a, b = sides
    qa, qb = a.new_qp(), b.new_qp()
    connect_manual(a, qa, b, qb)
    b.mr.write(PATTERN, len(PATTERN), 0)
    qa.post_send(_wr(1, IBV_WR_RDMA_WRITE, verbs.SGE(a.mr.buf + a.mr.length - 4, 8, a.mr.lkey), b.mr.rkey,
                     b.mr.buf))
    (wc,) = a.cq.poll_blocking(1, timeout=10)
    assert (wc.wr_id, wc.status) == (1, IBV_WC_LOC_PROT_ERR)
    assert b.mr.read(len(PATTERN), 0) == PATTERN
    ev = a.ctx.get_async_event(timeout=5)
    assert (ev.event_type, ev.element) == (IBV_EVENT_QP_REQ_ERR, qa.qp_num)
    # the peer QP is untouched and still works with a fresh partner
    assert qb.query()[0].qp_state != IBV_QPS_ERR


def test_good_traffic_after_violations(sides) -> None:
    a, b = sides
    qa, qb = a.new_qp(), b.new_qp()
    connect_manual(a, qa, b, qb)
    a.mr.write(b"fine", 4, 0)
    qa.post_send(_wr(5, IBV_WR_RDMA_WRITE, verbs.SGE(a.mr.buf, 4, a.mr.lkey), b.mr.rkey, b.mr.buf + 9))
    (wc,) = a.cq.poll_blocking(1, timeout=10)
    assert wc.status == IBV_WC_SUCCESS and b.mr.read(4, 9) == b"fine"


def test_deregistering_a_region_in_use_ends_the_qp_not_the_daemon(sides, daemons) -> None:
    a, b = sides
    qa, qb = a.new_qp(), b.new_qp()
    connect_manual(a, qa, b, qb)
    big = verbs.MR(a.pd, 32 << 20, ACCESS_ALL)
    target = verbs.MR(b.pd, 32 << 20, ACCESS_ALL)
    wr = verbs.SendWR(wr_id=1, opcode=IBV_WR_RDMA_WRITE, sg=[verbs.SGE(big.buf, 32 << 20, big.lkey)],
                      send_flags=IBV_SEND_SIGNALED)
    wr.set_wr_rdma(target.rkey, target.buf)
    qa.post_send(wr)
    big.close()  # while the daemon is still segmenting from it
    (wc,) = a.cq.poll_blocking(1, timeout=20)
    assert wc.wr_id == 1  # success if it had finished, else an error status: either way, no crash
    for d in daemons:
        assert d.proc is not None and d.proc.poll() is None
    qa2, qb2 = a.new_qp(), b.new_qp()
    connect_manual(a, qa2, b, qb2)
    qa2.post_send(_wr(2, IBV_WR_RDMA_WRITE, verbs.SGE(a.mr.buf, 8, a.mr.lkey), b.mr.rkey, b.mr.buf))
    (wc,) = a.cq.poll_blocking(1, timeout=10)
    assert (wc.wr_id, wc.status) == (2, IBV_WC_SUCCESS)
