"""The rest of the Send family (RFC 5040 §5.3, RFC 7306 §4): Immediate, Invalidate, Solicited Event."""

from __future__ import annotations

from udpverbs import verbs
from udpverbs.verbs.enums import (
    IBV_ACCESS_LOCAL_WRITE,
    IBV_ACCESS_REMOTE_WRITE,
    IBV_SEND_SIGNALED,
    IBV_SEND_SOLICITED,
    IBV_WC_LOC_PROT_ERR,
    IBV_WC_RECV,
    IBV_WC_REM_ACCESS_ERR,
    IBV_WC_REM_OP_ERR,
    IBV_WC_SEND,
    IBV_WC_SUCCESS,
    IBV_WC_WITH_IMM,
    IBV_WC_WITH_INV,
    IBV_WR_RDMA_WRITE,
    IBV_WR_SEND,
    IBV_WR_SEND_WITH_IMM,
    IBV_WR_SEND_WITH_INV,
)

from .conftest import Side, connect_manual


def _recv(side: Side, qp: verbs.QP, wr_id: int, n: int = 4096) -> None:
    qp.post_recv(verbs.RecvWR(wr_id=wr_id, sg=[verbs.SGE(side.mr.buf + 65536, n, side.mr.lkey)]))


def test_send_with_immediate(pair) -> None:
    a, b = pair
    _recv(b, b.qp, 5)
    a.mr.write(b"hello, immediate", 16, 0)
    a.qp.post_send(verbs.SendWR(wr_id=1, opcode=IBV_WR_SEND_WITH_IMM, imm_data=0xDEADBEEF,
                                sg=[verbs.SGE(a.mr.buf, 16, a.mr.lkey)], send_flags=IBV_SEND_SIGNALED))
    (wc,) = a.cq.poll_blocking(1, timeout=10)
    assert (wc.wr_id, wc.status, wc.opcode) == (1, IBV_WC_SUCCESS, IBV_WC_SEND)
    (rwc,) = b.cq.poll_blocking(1, timeout=10)
    assert (rwc.wr_id, rwc.status, rwc.opcode, rwc.byte_len, rwc.imm_data) == \
        (5, IBV_WC_SUCCESS, IBV_WC_RECV, 16, 0xDEADBEEF)
    assert rwc.wc_flags & IBV_WC_WITH_IMM and not rwc.wc_flags & IBV_WC_WITH_INV
    assert b.mr.read(16, 65536) == b"hello, immediate"
    # One receive per Send with Immediate: the next plain Send takes the next one.
    _recv(b, b.qp, 6)
    a.qp.post_send(verbs.SendWR(wr_id=2, sg=[verbs.SGE(a.mr.buf, 5, a.mr.lkey)], send_flags=IBV_SEND_SIGNALED))
    a.cq.poll_blocking(1, timeout=10)
    (rwc,) = b.cq.poll_blocking(1, timeout=10)
    assert (rwc.wr_id, rwc.byte_len, rwc.wc_flags) == (6, 5, 0)


def test_send_with_invalidate_kills_the_stag_at_once(pair) -> None:
    a, b = pair
    target = verbs.MR(b.pd, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)
    target.write(b"\x11" * 64, 64, 0)
    _recv(b, b.qp, 7)
    a.qp.post_send(verbs.SendWR(wr_id=1, opcode=IBV_WR_SEND_WITH_INV, invalidate_rkey=target.rkey,
                                sg=[verbs.SGE(a.mr.buf, 8, a.mr.lkey)], send_flags=IBV_SEND_SIGNALED))
    (wc,) = a.cq.poll_blocking(1, timeout=10)
    assert wc.status == IBV_WC_SUCCESS
    (rwc,) = b.cq.poll_blocking(1, timeout=10)
    assert (rwc.wr_id, rwc.status, rwc.byte_len) == (7, IBV_WC_SUCCESS, 8)
    assert rwc.wc_flags & IBV_WC_WITH_INV and rwc.invalidated_rkey == target.rkey
    # A Write naming the invalidated STag fails and writes nothing.
    a.mr.write(b"\x22" * 64, 64, 0)
    wr = verbs.SendWR(wr_id=2, opcode=IBV_WR_RDMA_WRITE, sg=[verbs.SGE(a.mr.buf, 64, a.mr.lkey)],
                      send_flags=IBV_SEND_SIGNALED)
    wr.set_wr_rdma(target.rkey, target.buf)
    a.qp.post_send(wr)
    (wc,) = a.cq.poll_blocking(1, timeout=10)
    assert (wc.wr_id, wc.status) == (2, IBV_WC_REM_ACCESS_ERR)
    assert target.read(64, 0) == b"\x11" * 64


def test_send_with_solicited_event_and_invalidate(daemons) -> None:
    a, b = Side(daemons[0]), Side(daemons[1])
    try:
        ch = verbs.CompChannel(b.ctx)
        cq = verbs.CQ(b.ctx, 16, channel=ch)
        qb = verbs.QP(b.pd, verbs.QPInitAttr(scq=cq, rcq=cq, cap=verbs.QPCap(4, 4)))
        connect_manual(a, a.qp, b, qb)
        target = verbs.MR(b.pd, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)
        _recv(b, qb, 1)
        cq.req_notify(solicited_only=True)
        a.qp.post_send(verbs.SendWR(wr_id=1, opcode=IBV_WR_SEND_WITH_INV, invalidate_rkey=target.rkey,
                                    sg=[verbs.SGE(a.mr.buf, 8, a.mr.lkey)],
                                    send_flags=IBV_SEND_SIGNALED | IBV_SEND_SOLICITED))
        assert ch.get_cq_event(timeout=10) is cq
        n, (rwc, *_) = cq.poll(4)
        assert n == 1 and rwc.wc_flags & IBV_WC_WITH_INV and rwc.invalidated_rkey == target.rkey
        # Send with Immediate and SE wakes a solicited-only CQ too.
        _recv(b, qb, 2)
        cq.req_notify(solicited_only=True)
        a.qp.post_send(verbs.SendWR(wr_id=2, opcode=IBV_WR_SEND_WITH_IMM, imm_data=7,
                                    sg=[verbs.SGE(a.mr.buf, 8, a.mr.lkey)],
                                    send_flags=IBV_SEND_SIGNALED | IBV_SEND_SOLICITED))
        assert ch.get_cq_event(timeout=10) is cq
        n, (rwc, *_) = cq.poll(4)
        assert n == 1 and (rwc.wr_id, rwc.imm_data) == (2, 7) and rwc.wc_flags & IBV_WC_WITH_IMM
        # Plain Sends with SE, one after the other: the daemon's compiled
        # lane takes the second (the first points it at such Sends), and
        # each wakes the CQ.
        for wr_id in (3, 4):
            _recv(b, qb, wr_id)
            cq.req_notify(solicited_only=True)
            a.qp.post_send(verbs.SendWR(wr_id=wr_id, opcode=IBV_WR_SEND, sg=[verbs.SGE(a.mr.buf, 8, a.mr.lkey)],
                                        send_flags=IBV_SEND_SIGNALED | IBV_SEND_SOLICITED))
            assert ch.get_cq_event(timeout=10) is cq
            n, (rwc, *_) = cq.poll(4)
            assert n == 1 and (rwc.wr_id, rwc.status, rwc.byte_len) == (wr_id, IBV_WC_SUCCESS, 8)
        assert [w.status for w in a.cq.poll_blocking(4, timeout=10)] == [IBV_WC_SUCCESS] * 4
    finally:
        a.close()
        b.close()


def test_invalidating_a_foreign_stag_is_an_error(daemons) -> None:
    a, b = Side(daemons[0]), Side(daemons[1])
    try:
        connect_manual(a, a.qp, b, b.qp)
        other_pd = verbs.PD(b.ctx)
        foreign = verbs.MR(other_pd, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)
        _recv(b, b.qp, 3)
        a.qp.post_send(verbs.SendWR(wr_id=1, opcode=IBV_WR_SEND_WITH_INV, invalidate_rkey=foreign.rkey,
                                    sg=[verbs.SGE(a.mr.buf, 8, a.mr.lkey)], send_flags=IBV_SEND_SIGNALED))
        (wc,) = a.cq.poll_blocking(1, timeout=10)
        assert (wc.wr_id, wc.status) == (1, IBV_WC_REM_OP_ERR)
        (rwc,) = b.cq.poll_blocking(1, timeout=10)
        assert (rwc.wr_id, rwc.status) == (3, IBV_WC_LOC_PROT_ERR)
    finally:
        a.close()
        b.close()
