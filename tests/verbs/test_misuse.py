"""Misuse the daemon cannot see is refused by the library."""

from __future__ import annotations

import errno
import tempfile

import pytest

from udpverbs import verbs
from udpverbs.verbs.enums import IBV_QPT_RC

from ..integration.daemons import DaemonProc


def test_a_qp_with_a_cq_of_another_context_is_refused() -> None:
    # Handles are per daemon: CQ 1 of another device named CQ 1 of this one,
    # and the QP was created bound to it.
    with tempfile.TemporaryDirectory(prefix="udpverbs-m-") as d, \
            DaemonProc("uvM1", "127.0.0.11", d) as d1, DaemonProc("uvM2", "127.0.0.12", d) as d2:
        with verbs.Context(socket_path=d1.socket_path) as a, verbs.Context(socket_path=d2.socket_path) as b:
            pd, own, other = verbs.PD(a), verbs.CQ(a, 8), verbs.CQ(b, 8)
            for scq, rcq in ((other, own), (own, other)):
                with pytest.raises(verbs.VerbsError) as e:
                    verbs.QP(pd, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=scq, rcq=rcq))
                assert e.value.error_code == errno.EINVAL and "another context" in str(e.value)
            with pytest.raises(verbs.UserError, match="out of range"):
                verbs.CQ(a, -5)  # was struct.error
            with pytest.raises(verbs.UserError, match="out of range"):
                verbs.QP(pd, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=own, rcq=own, cap=verbs.QPCap(-1, 4, 1, 1)))
            verbs.QP(pd, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=own, rcq=own))  # the right parents still work


def test_polling_a_negative_count_is_refused_and_the_ring_stays_as_it_was() -> None:
    with tempfile.TemporaryDirectory(prefix="udpverbs-m-") as d, DaemonProc("uvM3", "127.0.0.13", d) as dp:
        with verbs.Context(socket_path=dp.socket_path) as ctx:
            cq = verbs.CQ(ctx, 8)
            with pytest.raises(verbs.UserError, match="not negative"):
                cq.poll(-1)  # used to move the ring's consumer back: an old (here empty) slot came again
            assert cq.poll(8) == (0, [])


def test_negative_or_oversized_fields_on_the_data_path_raise_user_error_and_post_nothing() -> None:
    # On main these raised OverflowError or TypeError from cffi or struct;
    # an inline SGE of length -1 sent one byte.
    from ..integration.conftest import Side, connect_manual
    from udpverbs.verbs.enums import IBV_SEND_INLINE, IBV_SEND_SIGNALED, IBV_WC_SUCCESS, IBV_WR_RDMA_WRITE

    with tempfile.TemporaryDirectory(prefix="udpverbs-m-") as d, \
            DaemonProc("uvM4", "127.0.0.14", d) as d1, DaemonProc("uvM5", "127.0.0.15", d) as d2:
        a, b = Side(d1, 1 << 16, cap=verbs.QPCap(16, 16, 2, 2, 64)), Side(d2, 1 << 16)
        connect_manual(a, a.qp, b, b.qp)
        buf, lkey = a.mr.buf, a.mr.lkey

        def write(sg: list[verbs.SGE], flags: int = 0, num_sge: int | None = None, rkey: int | None = None,
                  remote_addr: int | None = None) -> None:
            wr = verbs.SendWR(wr_id=1, opcode=IBV_WR_RDMA_WRITE, num_sge=num_sge, sg=sg,
                              send_flags=IBV_SEND_SIGNALED | flags)
            wr.set_wr_rdma(b.mr.rkey if rkey is None else rkey, b.mr.buf if remote_addr is None else remote_addr)
            a.qp.post_send(wr)

        sends = {
            "length=-1": lambda: write([verbs.SGE(buf, -1, lkey)]),
            "length=1099511627776": lambda: write([verbs.SGE(buf, 1 << 40, lkey)]),
            "addr=-1": lambda: write([verbs.SGE(-1, 8, lkey)]),
            "lkey=-1": lambda: write([verbs.SGE(buf, 8, -1)]),
            "num_sge=-1": lambda: write([verbs.SGE(buf, 8, lkey)], num_sge=-1),
            "rkey=-1": lambda: write([verbs.SGE(buf, 8, lkey)], rkey=-1),
            "remote_addr=-1": lambda: write([verbs.SGE(buf, 8, lkey)], remote_addr=-1),
            "inline length=-1": lambda: write([verbs.SGE(buf, -1, lkey)], IBV_SEND_INLINE),
            "inline addr=-1": lambda: write([verbs.SGE(-1, 8, lkey)], IBV_SEND_INLINE),
            "inline num_sge=-1": lambda: write([verbs.SGE(buf, 8, lkey), verbs.SGE(buf, 8, lkey)], IBV_SEND_INLINE,
                                               num_sge=-1),
            "recv num_sge=-1": lambda: a.qp.post_recv(verbs.RecvWR(wr_id=1, num_sge=-1)),
            "recv length=-1": lambda: a.qp.post_recv(verbs.RecvWR(wr_id=1, sg=[verbs.SGE(buf, -1, lkey)])),
        }
        for name, post in sends.items():
            with pytest.raises(verbs.UserError, match="out of range|num_sge") as e:
                post()
            assert name.split()[-1].split("=")[0] in str(e.value), (name, str(e.value))
        assert a.cq.poll(16) == (0, [])  # nothing was posted
        write([verbs.SGE(buf, 8, lkey)])  # the queue is as it was
        (wc,) = a.cq.poll_blocking(1, timeout=10)
        assert wc.status == IBV_WC_SUCCESS
        a.close()
        b.close()
