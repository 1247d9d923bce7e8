"""Async events that belong to no single WR: CQ overrun and device fatal."""

from __future__ import annotations

import tempfile

from udpverbs import verbs
from udpverbs.verbs.enums import (
    IBV_EVENT_CQ_ERR,
    IBV_EVENT_DEVICE_FATAL,
    IBV_QPT_RC,
    IBV_SEND_SIGNALED,
    IBV_WC_SUCCESS,
    IBV_WR_RDMA_READ,
    IBV_WR_RDMA_WRITE,
)

from .conftest import Side, connect_manual
from .daemons import DaemonProc


def test_cq_overrun_raises_cq_err(daemons) -> None:
    a, b = Side(daemons[0]), Side(daemons[1])
    try:
        small = verbs.CQ(a.ctx, 2)
        qa = verbs.QP(a.pd, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=small, rcq=small, cap=verbs.QPCap(8, 1)))
        qb = b.new_qp()
        connect_manual(a, qa, b, qb)
        for i in range(4):  # four completions into a 2-entry CQ nobody polls
            wr = verbs.SendWR(wr_id=i, opcode=IBV_WR_RDMA_WRITE, sg=[verbs.SGE(a.mr.buf, 8, a.mr.lkey)],
                              send_flags=IBV_SEND_SIGNALED)
            wr.set_wr_rdma(b.mr.rkey, b.mr.buf)
            qa.post_send(wr)
        ev = a.ctx.get_async_event(timeout=10)
        assert (ev.event_type, ev.element) == (IBV_EVENT_CQ_ERR, small.handle)
        assert small.overrun
        n, wcs = small.poll(4)
        assert n == 2 and [w.wr_id for w in wcs] == [0, 1]  # what fitted is intact
    finally:
        a.close()
        b.close()


def test_many_reads_respect_ord(daemons) -> None:
    a, b = Side(daemons[0]), Side(daemons[1])
    try:
        connect_manual(a, a.qp, b, b.qp, rd=1)  # ORD = IRD = 1: reads go one at a time
        for i in range(16):
            b.mr.write(bytes([i]) * 2000, 2000, i * 2000)
        for i in range(16):
            wr = verbs.SendWR(wr_id=i, opcode=IBV_WR_RDMA_READ, sg=[verbs.SGE(a.mr.buf + i * 2000, 2000, a.mr.lkey)],
                              send_flags=IBV_SEND_SIGNALED)
            wr.set_wr_rdma(b.mr.rkey, b.mr.buf + i * 2000)
            a.qp.post_send(wr)
        wcs = a.cq.poll_blocking(16, timeout=20)
        assert [w.wr_id for w in wcs] == list(range(16)) and all(w.status == IBV_WC_SUCCESS for w in wcs)
        assert all(a.mr.read(2000, i * 2000) == bytes([i]) * 2000 for i in range(16))
    finally:
        a.close()
        b.close()


def test_daemon_shutdown_is_device_fatal() -> None:
    with tempfile.TemporaryDirectory(prefix="udpverbs-ev-") as d:
        p = DaemonProc("uvE", "127.0.0.2", d).start()
        try:
            ctx = verbs.Context(socket_path=p.socket_path)
            assert not ctx.device_fatal
            assert p.stop() == 0
            ev = ctx.get_async_event(timeout=10)
            assert ev.event_type == IBV_EVENT_DEVICE_FATAL and ctx.device_fatal
            ctx.close()
        finally:
            p.stop()
