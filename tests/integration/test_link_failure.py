"""A peer daemon that dies: the link exhausts its budget and WRs end as IBV_WC_RETRY_EXC_ERR."""

from __future__ import annotations

import tempfile

from udpverbs import verbs
from udpverbs.verbs.enums import (
    IBV_EVENT_QP_FATAL,
    IBV_SEND_SIGNALED,
    IBV_WC_RETRY_EXC_ERR,
    IBV_WC_SUCCESS,
    IBV_WC_WR_FLUSH_ERR,
    IBV_WR_RDMA_WRITE,
)

from .conftest import Side, connect_manual
from .daemons import DaemonProc

# Give up fast: a dead peer is declared after 0.5 s of silence.
FAST = ("--link", "dead_peer_s=0.5", "--link", "keepalive_idle_s=0.1", "--link", "max_retransmits=3",
        "--link", "initial_rto_s=0.01")


def test_dead_peer_gives_retry_exceeded() -> None:
    with tempfile.TemporaryDirectory(prefix="udpverbs-lf-") as d:
        with DaemonProc("uvF", "127.0.0.2", d, extra=FAST, seed=3) as da:
            db = DaemonProc("uvG", "127.0.0.3", d, extra=FAST, seed=4).start()
            try:
                a, b = Side(da, 1 << 16), Side(db, 1 << 16)
                connect_manual(a, a.qp, b, b.qp)
                wr = verbs.SendWR(wr_id=1, opcode=IBV_WR_RDMA_WRITE, sg=[verbs.SGE(a.mr.buf, 100, a.mr.lkey)],
                                  send_flags=IBV_SEND_SIGNALED)
                wr.set_wr_rdma(b.mr.rkey, b.mr.buf)
                a.qp.post_send(wr)
                (wc,) = a.cq.poll_blocking(1, timeout=10)
                assert wc.status == IBV_WC_SUCCESS
                assert db.proc is not None
                db.proc.kill()  # the peer host dies without a word
                db.proc.wait(10)
                b.ctx._ctl.close()
                for i in (2, 3):
                    wr.wr_id = i
                    a.qp.post_send(wr)
                w2, w3 = a.cq.poll_blocking(2, timeout=20)
                assert (w2.wr_id, w2.status) == (2, IBV_WC_RETRY_EXC_ERR)
                assert (w3.wr_id, w3.status) == (3, IBV_WC_WR_FLUSH_ERR)
                ev = a.ctx.get_async_event(timeout=5)
                assert (ev.event_type, ev.element) == (IBV_EVENT_QP_FATAL, a.qp.qp_num)
                a.close()
            finally:
                db.stop()
