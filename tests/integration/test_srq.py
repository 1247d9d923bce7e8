"""Shared receive queues: many QPs, one receive pool, with RNR and the limit event."""

from __future__ import annotations

import errno

import pytest

from udpverbs import verbs
from udpverbs.verbs.enums import (
    IBV_EVENT_SRQ_LIMIT_REACHED,
    IBV_SEND_SIGNALED,
    IBV_SRQ_LIMIT,
    IBV_WC_RECV,
    IBV_WC_SUCCESS,
    IBV_WR_SEND,
)

from .conftest import Side, connect_manual


def _srq_qps(a: Side, b: Side, n: int, srq: verbs.SRQ) -> list[tuple[verbs.QP, verbs.QP]]:
    pairs = []
    for _ in range(n):
        qa = a.new_qp()
        qb = verbs.QP(b.pd, verbs.QPInitAttr(scq=b.cq, rcq=b.cq, srq=srq, cap=verbs.QPCap(8, 1)))
        connect_manual(a, qa, b, qb)
        pairs.append((qa, qb))
    return pairs


def _send(qp: verbs.QP, mr: verbs.MR, off: int, n: int, wr_id: int) -> None:
    qp.post_send(verbs.SendWR(wr_id=wr_id, opcode=IBV_WR_SEND, sg=[verbs.SGE(mr.buf + off, n, mr.lkey)],
                              send_flags=IBV_SEND_SIGNALED))


def test_three_qps_share_one_pool(daemons) -> None:
    a, b = Side(daemons[0]), Side(daemons[1])
    try:
        srq = verbs.SRQ(b.pd, verbs.SrqInitAttr(verbs.SrqAttr(max_wr=16, max_sge=2)))
        pairs = _srq_qps(a, b, 3, srq)
        for i in range(6):
            srq.post_recv(verbs.RecvWR(wr_id=100 + i, sg=[verbs.SGE(b.mr.buf + i * 4096, 4096, b.mr.lkey)]))
        for i in range(6):
            qa, _ = pairs[i % 3]
            a.mr.write(bytes([i + 1]) * (100 + i), 100 + i, i * 4096)
            _send(qa, a.mr, i * 4096, 100 + i, i)
            (wc,) = a.cq.poll_blocking(1, timeout=10)
            assert (wc.wr_id, wc.status) == (i, IBV_WC_SUCCESS)
        rwcs = b.cq.poll_blocking(6, timeout=10)
        # Receives are taken in posting order, whichever QP the Send came on.
        assert [(w.wr_id, w.status, w.opcode, w.byte_len) for w in rwcs] == \
            [(100 + i, IBV_WC_SUCCESS, IBV_WC_RECV, 100 + i) for i in range(6)]
        assert [w.qp_num for w in rwcs] == [pairs[i % 3][1].qp_num for i in range(6)]
        for i in range(6):
            assert b.mr.read(100 + i, i * 4096) == bytes([i + 1]) * (100 + i)
        with pytest.raises(verbs.VerbsError) as e:
            pairs[0][1].post_recv(verbs.RecvWR(wr_id=1, sg=[verbs.SGE(b.mr.buf, 8, b.mr.lkey)]))
        assert e.value.errno == errno.EINVAL
        with pytest.raises(verbs.VerbsError) as e:
            b.ctx.call(verbs.device.Op.DESTROY_SRQ, srq_handle=srq.handle)  # still used by three QPs
        assert e.value.errno == errno.EBUSY
    finally:
        a.close()
        b.close()


def test_empty_pool_nacks_and_a_post_resumes_every_sender(daemons) -> None:
    a, b = Side(daemons[0]), Side(daemons[1])
    try:
        srq = verbs.SRQ(b.pd, verbs.SrqInitAttr(verbs.SrqAttr(max_wr=8, max_sge=1)))
        pairs = _srq_qps(a, b, 2, srq)
        for i, (qa, _) in enumerate(pairs):
            _send(qa, a.mr, 0, 32, i)
        assert a.cq.poll(2)[0] == 0
        srq.post_recv(verbs.RecvWR(wr_id=7, sg=[verbs.SGE(b.mr.buf, 64, b.mr.lkey)],
                                   next_wr=verbs.RecvWR(wr_id=8, sg=[verbs.SGE(b.mr.buf + 64, 64, b.mr.lkey)])))
        swcs = a.cq.poll_blocking(2, timeout=10)
        assert sorted((w.wr_id, w.status) for w in swcs) == [(0, IBV_WC_SUCCESS), (1, IBV_WC_SUCCESS)]
        rwcs = b.cq.poll_blocking(2, timeout=10)
        assert sorted(w.wr_id for w in rwcs) == [7, 8] and all(w.byte_len == 32 for w in rwcs)
    finally:
        a.close()
        b.close()


def test_limit_event(daemons) -> None:
    a, b = Side(daemons[0]), Side(daemons[1])
    try:
        srq = verbs.SRQ(b.pd, verbs.SrqInitAttr(verbs.SrqAttr(max_wr=8, max_sge=1)))
        ((qa, _),) = _srq_qps(a, b, 1, srq)
        for i in range(4):
            srq.post_recv(verbs.RecvWR(wr_id=i, sg=[verbs.SGE(b.mr.buf + 64 * i, 64, b.mr.lkey)]))
        srq.modify(verbs.SrqAttr(srq_limit=3), IBV_SRQ_LIMIT)
        assert srq.query().srq_limit == 3
        _send(qa, a.mr, 0, 8, 1)  # 3 left: not below the limit
        _send(qa, a.mr, 0, 8, 2)  # 2 left: the event, once
        _send(qa, a.mr, 0, 8, 3)
        a.cq.poll_blocking(3, timeout=10)
        ev = b.ctx.get_async_event(timeout=10)
        assert (ev.event_type, ev.element) == (IBV_EVENT_SRQ_LIMIT_REACHED, srq.handle)
        with pytest.raises(TimeoutError):
            b.ctx.get_async_event(timeout=0.2)
        assert srq.query().srq_limit == 0  # disarmed, as in verbs
    finally:
        a.close()
        b.close()
