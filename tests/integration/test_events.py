"""Async events that belong to no single WR: CQ overrun and device fatal."""

from __future__ import annotations

import errno
import tempfile
import time

import pytest
import trio

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
        assert ev.event_type.name == "IBV_EVENT_CQ_ERR" and "event_type=IBV_EVENT_CQ_ERR," in repr(ev)
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


def test_a_killed_daemon_is_device_fatal_and_nothing_hangs() -> None:
    # On main the application of a daemon killed with SIGKILL heard nothing:
    # no async event, posts went into rings nobody reads, and a wait without
    # a timeout waited for ever.
    with tempfile.TemporaryDirectory(prefix="udpverbs-ev-") as d:
        with DaemonProc("uvK1", "127.0.0.2", d, seed=51) as da, DaemonProc("uvK2", "127.0.0.3", d, seed=52) as db:
            a, b = Side(da, 1 << 16), Side(db, 1 << 16)
            watcher = verbs.Context(socket_path=da.socket_path)  # a second application of the same device
            trio_cq = verbs.CQ(watcher, 4)
            connect_manual(a, a.qp, b, b.qp)
            wr = verbs.SendWR(wr_id=1, opcode=IBV_WR_RDMA_WRITE, sg=[verbs.SGE(a.mr.buf, 8, a.mr.lkey)],
                              send_flags=IBV_SEND_SIGNALED)
            wr.set_wr_rdma(b.mr.rkey, b.mr.buf)
            a.qp.post_send(wr)
            assert a.cq.poll_blocking(1, timeout=10)[0].status == IBV_WC_SUCCESS
            assert da.proc is not None
            da.proc.kill()
            da.proc.wait(10)
            t0 = time.monotonic()
            ev = a.ctx.get_async_event(timeout=10)
            assert (ev.event_type, ev.element) == (IBV_EVENT_DEVICE_FATAL, 0) and a.ctx.device_fatal
            assert time.monotonic() - t0 < 2
            with pytest.raises(TimeoutError):
                a.ctx.get_async_event(timeout=0.2)  # once
            for post in (lambda: a.qp.post_send(wr), lambda: a.qp.post_recv(verbs.RecvWR(wr_id=2))):
                with pytest.raises(verbs.VerbsError) as e:
                    post()
                assert e.value.error_code == errno.ENODEV
            with pytest.raises(verbs.VerbsError) as e:
                a.cq.poll_blocking(1, timeout=None)  # no timeout: it used to wait for ever
            assert e.value.error_code == errno.ENODEV
            with pytest.raises(verbs.VerbsError):
                for _ in range(100_000):  # a busy-polling loop ends too
                    a.cq.poll(16)
            with pytest.raises(verbs.VerbsError) as e:
                verbs.PD(a.ctx)
            assert e.value.error_code == errno.ENODEV

            async def helpers() -> None:
                with trio.fail_after(10):
                    ev = await watcher.get_async_event_async()
                    assert ev.event_type == IBV_EVENT_DEVICE_FATAL
                    with pytest.raises(verbs.VerbsError):
                        await trio_cq.poll_async(1)

            trio.run(helpers)
            a.close()  # closing what the dead daemon held just works
            watcher.close()
            b.close()
