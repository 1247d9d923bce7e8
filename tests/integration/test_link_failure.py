"""A peer daemon that dies: the link exhausts its budget and WRs end as IBV_WC_RETRY_EXC_ERR."""

from __future__ import annotations

import tempfile
import time

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

def _write_wr(a: Side, b: Side, size: int, wr_id: int = 1) -> verbs.SendWR:
    wr = verbs.SendWR(wr_id=wr_id, opcode=IBV_WR_RDMA_WRITE, sg=[verbs.SGE(a.mr.buf, size, a.mr.lkey)],
                      send_flags=IBV_SEND_SIGNALED)
    wr.set_wr_rdma(b.mr.rkey, b.mr.buf)
    return wr


def _kill(daemon: DaemonProc, side: Side) -> None:
    assert daemon.proc is not None
    daemon.proc.kill()
    daemon.proc.wait(10)
    side.ctx._ctl.close()


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
                wr = _write_wr(a, b, 100)
                a.qp.post_send(wr)
                (wc,) = a.cq.poll_blocking(1, timeout=10)
                assert wc.status == IBV_WC_SUCCESS
                _kill(db, b)  # the peer host dies without a word
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


def test_link_counters_never_go_backwards_when_a_link_is_replaced() -> None:
    # On main the device summed only the links alive: once the peer
    # restarted and its link was replaced, link_* fell back to the new link's.
    with tempfile.TemporaryDirectory(prefix="udpverbs-lf-") as d:
        with DaemonProc("uvC", "127.0.0.2", d, extra=FAST, seed=5) as da:
            db = DaemonProc("uvD", "127.0.0.3", d, extra=FAST, seed=6).start()
            try:
                a, b = Side(da, 1 << 20), Side(db, 1 << 20)
                connect_manual(a, a.qp, b, b.qp)
                wr = _write_wr(a, b, 1 << 16)
                for i in range(10):
                    a.qp.post_send(wr)
                    assert a.cq.poll_blocking(1, timeout=10)[0].status == IBV_WC_SUCCESS
                before = {k: v for k, v in a.ctx.query_stats().items() if k.startswith("link_")}
                assert before["link_data_sent"] >= 10 * 40
                port = db.port
                _kill(db, b)  # the peer restarts: a new daemon at the same address
                db.stop()
                # Once the old link is gone (0.5 s of silence): a Write posted
                # while it still stood would ride it and fail with it.
                deadline = time.monotonic() + 10
                while "ended: " not in da.log_text():
                    assert time.monotonic() < deadline, da.log_text()
                    time.sleep(0.05)
                db = DaemonProc("uvD", "127.0.0.3", d, extra=FAST + ("--port", str(port)), seed=7).start()
                b = Side(db, 1 << 16)
                qa = a.new_qp()
                connect_manual(a, qa, b, b.qp)
                qa.post_send(_write_wr(a, b, 8, 2))
                wcs = a.cq.poll_blocking(1, timeout=10)
                while not any(wc.qp_num == qa.qp_num for wc in wcs):  # the old QP's flush may come first
                    wcs += a.cq.poll_blocking(1, timeout=10)
                assert [wc.status for wc in wcs if wc.qp_num == qa.qp_num] == [IBV_WC_SUCCESS]
                after = a.ctx.query_stats()
                assert "ended: peer_restarted" in da.log_text() or "ended: dead_peer" in da.log_text()
                assert {k: v for k, v in before.items() if after[k] < v} == {}
                a.close()
                b.close()
            finally:
                db.stop()
