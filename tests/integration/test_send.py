"""Send / Receive (RFC 5040 §5.3): untagged messages land in posted receives, in order."""

from __future__ import annotations

import random

from udpverbs import verbs
from udpverbs.verbs.enums import (
    IBV_QPS_ERR,
    IBV_SEND_SIGNALED,
    IBV_SEND_SOLICITED,
    IBV_WC_LOC_LEN_ERR,
    IBV_WC_RECV,
    IBV_WC_REM_INV_REQ_ERR,
    IBV_WC_RNR_RETRY_EXC_ERR,
    IBV_WC_SEND,
    IBV_WC_SUCCESS,
    IBV_WR_SEND,
)

from .conftest import Side, connect_manual


def _send(qp: verbs.QP, mr: verbs.MR, off: int, n: int, wr_id: int) -> None:
    qp.post_send(verbs.SendWR(wr_id=wr_id, opcode=IBV_WR_SEND, sg=[verbs.SGE(mr.buf + off, n, mr.lkey)],
                              send_flags=IBV_SEND_SIGNALED))


def test_sends_fill_receives_in_order(pair) -> None:
    a, b = pair
    rng = random.Random(9)
    sizes = [0, 1, 1400, 5000, 70000]
    offs = []
    off = 0
    for n in sizes:  # one receive per Send, each scattered over two SGEs
        half = n // 2
        b.qp.post_recv(verbs.RecvWR(wr_id=100 + len(offs), sg=[verbs.SGE(b.mr.buf + off, half, b.mr.lkey),
                                                                verbs.SGE(b.mr.buf + off + half + 7,
                                                                          n - half + 10, b.mr.lkey)]))
        offs.append(off)
        off += n + 4096
    blobs = [rng.randbytes(n) for n in sizes]
    src = 0
    for i, blob in enumerate(blobs):
        a.mr.write(blob, len(blob), src)
        _send(a.qp, a.mr, src, len(blob), i)
        src += len(blob) + 1
    swcs = a.cq.poll_blocking(len(sizes), timeout=20)
    assert [(w.wr_id, w.status, w.opcode) for w in swcs] == [(i, IBV_WC_SUCCESS, IBV_WC_SEND) for i in range(5)]
    rwcs = b.cq.poll_blocking(len(sizes), timeout=20)
    assert [(w.wr_id, w.status, w.opcode, w.byte_len) for w in rwcs] == \
        [(100 + i, IBV_WC_SUCCESS, IBV_WC_RECV, n) for i, n in enumerate(sizes)]
    for blob, off in zip(blobs, offs):
        half = len(blob) // 2
        assert b.mr.read(half, off) + b.mr.read(len(blob) - half, off + half + 7) == blob


def test_send_without_a_receive(daemons) -> None:
    a, b = Side(daemons[0]), Side(daemons[1])
    try:
        connect_manual(a, a.qp, b, b.qp)
        _send(a.qp, a.mr, 0, 10, 1)
        (wc,) = a.cq.poll_blocking(1, timeout=10)
        # No RNR retries yet (Modified ACK/NACK is a later layer): the retry budget is zero.
        assert (wc.wr_id, wc.status) == (1, IBV_WC_RNR_RETRY_EXC_ERR)
        assert b.qp.query()[0].qp_state == IBV_QPS_ERR
    finally:
        a.close()
        b.close()


def test_send_longer_than_the_receive(daemons) -> None:
    a, b = Side(daemons[0]), Side(daemons[1])
    try:
        connect_manual(a, a.qp, b, b.qp)
        b.mr.write(b"\x55" * 100, 100, 0)
        b.qp.post_recv(verbs.RecvWR(wr_id=7, sg=[verbs.SGE(b.mr.buf, 10, b.mr.lkey)]))
        _send(a.qp, a.mr, 0, 3000, 1)
        (wc,) = a.cq.poll_blocking(1, timeout=10)
        assert (wc.wr_id, wc.status) == (1, IBV_WC_REM_INV_REQ_ERR)
        (rwc,) = b.cq.poll_blocking(1, timeout=10)
        assert (rwc.wr_id, rwc.status) == (7, IBV_WC_LOC_LEN_ERR)
    finally:
        a.close()
        b.close()


def test_solicited_only_notification(pair) -> None:
    a, b = pair
    ch = verbs.CompChannel(b.ctx)
    cq = verbs.CQ(b.ctx, 16, channel=ch)
    qb = verbs.QP(b.pd, verbs.QPInitAttr(scq=cq, rcq=cq, cap=verbs.QPCap(4, 4)))
    qa = a.new_qp()
    connect_manual(a, qa, b, qb)
    for i in range(2):
        qb.post_recv(verbs.RecvWR(wr_id=i, sg=[verbs.SGE(b.mr.buf, 64, b.mr.lkey)]))
    cq.req_notify(solicited_only=True)
    _send(qa, a.mr, 0, 8, 1)  # not solicited: no event
    (wc,) = a.cq.poll_blocking(1, timeout=10)
    assert wc.status == IBV_WC_SUCCESS
    try:
        ch.get_cq_event(timeout=0.3)
        raise AssertionError("an unsolicited Send woke a solicited-only CQ")
    except TimeoutError:
        pass
    qa.post_send(verbs.SendWR(wr_id=2, opcode=IBV_WR_SEND, sg=[verbs.SGE(a.mr.buf, 8, a.mr.lkey)],
                              send_flags=IBV_SEND_SIGNALED | IBV_SEND_SOLICITED))
    assert ch.get_cq_event(timeout=10) is cq
    n, wcs = cq.poll(4)
    assert n == 2 and [w.wr_id for w in wcs] == [0, 1]
