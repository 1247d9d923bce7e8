"""Send / Receive (RFC 5040 §5.3): untagged messages land in posted receives, in order."""

from __future__ import annotations

import random
import time

from udpverbs import verbs
from udpverbs.verbs.enums import (
    IBV_QPS_ERR,
    IBV_QPS_RTS,
    IBV_SEND_INLINE,
    IBV_SEND_SIGNALED,
    IBV_SEND_SOLICITED,
    IBV_WC_LOC_LEN_ERR,
    IBV_WC_RECV,
    IBV_WC_RECV_RDMA_WITH_IMM,
    IBV_WC_REM_INV_REQ_ERR,
    IBV_WC_RNR_RETRY_EXC_ERR,
    IBV_WC_SEND,
    IBV_WC_SUCCESS,
    IBV_WR_RDMA_WRITE_WITH_IMM,
    IBV_WR_SEND,
    IBV_WR_SEND_WITH_IMM,
)

from .conftest import ACCESS_ALL, Side, connect_manual


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


def _rnr_pair(daemons, rnr_retry: int, min_rnr_timer: int, cap: verbs.QPCap | None = None) -> tuple[Side, Side]:
    a, b = Side(daemons[0], cap=cap), Side(daemons[1], cap=cap)
    for me, qp, peer, pqp in ((a, a.qp, b, b.qp), (b, b.qp, a, a.qp)):
        attr = verbs.QPAttr(qp_access_flags=ACCESS_ALL, dest_qp_num=pqp.qp_num, rnr_retry=rnr_retry,
                            min_rnr_timer=min_rnr_timer)
        attr.ah_attr = verbs.AHAttr(dlid=peer.ctx.query_port().lid, gr=verbs.GlobalRoute(dgid=peer.ctx.query_gid()))
        qp.to_rts(attr)
    return a, b


def _wait_stat(ctx: verbs.Context, name: str, at_least: int, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        v = ctx.query_stats().get(name, 0)
        if v >= at_least or time.monotonic() > deadline:
            return v
        time.sleep(0.005)


def test_rnr_retry_zero_fails_the_send(daemons) -> None:
    a, b = _rnr_pair(daemons, rnr_retry=0, min_rnr_timer=1)
    try:
        _send(a.qp, a.mr, 0, 10, 1)
        (wc,) = a.cq.poll_blocking(1, timeout=10)
        assert (wc.wr_id, wc.status) == (1, IBV_WC_RNR_RETRY_EXC_ERR)
        assert a.qp.query()[0].qp_state == IBV_QPS_ERR
        # As in verbs, the responder is not at fault: its QP stays usable.
        assert b.qp.query()[0].qp_state == IBV_QPS_RTS
    finally:
        a.close()
        b.close()


def test_send_before_the_receive_completes_once_it_is_posted(daemons) -> None:
    # The longest first back-off there is, 655 ms (min_rnr_timer 0): without the
    # receiver's RESUME the Send could not complete until ~650 ms after the post.
    a, b = _rnr_pair(daemons, rnr_retry=7, min_rnr_timer=0)
    try:
        before_a, before_b = a.ctx.query_stats(), b.ctx.query_stats()
        blob = random.Random(5).randbytes(5000)
        a.mr.write(blob, len(blob), 0)
        _send(a.qp, a.mr, 0, len(blob), 1)
        assert _wait_stat(b.ctx, "rnr_nack_sent", before_b.get("rnr_nack_sent", 0) + 1) > \
            before_b.get("rnr_nack_sent", 0)
        assert a.cq.poll(1)[0] == 0  # not complete while no receive is posted
        b.qp.post_recv(verbs.RecvWR(wr_id=9, sg=[verbs.SGE(b.mr.buf, 8192, b.mr.lkey)]))
        (wc,) = a.cq.poll_blocking(1, timeout=10)
        assert (wc.wr_id, wc.status, wc.opcode) == (1, IBV_WC_SUCCESS, IBV_WC_SEND)
        (rwc,) = b.cq.poll_blocking(1, timeout=10)
        assert (rwc.wr_id, rwc.status, rwc.byte_len) == (9, IBV_WC_SUCCESS, len(blob))
        assert b.mr.read(len(blob), 0) == blob
        after_a, after_b = a.ctx.query_stats(), b.ctx.query_stats()
        assert after_b["rnr_resume_sent"] > before_b.get("rnr_resume_sent", 0)
        assert after_a["rnr_resume_received"] > before_a.get("rnr_resume_received", 0)
        # the RESUME ended the sender's back-off: it re-sent at once, not 655 ms later
        assert after_a.get("rnr_backoff_cut", 0) == before_a.get("rnr_backoff_cut", 0) + 1
        assert after_a["rnr_nack_received"] == before_a.get("rnr_nack_received", 0) + 1
    finally:
        a.close()
        b.close()


def _receive_one_at_a_time(b: Side, blobs: list[bytes], stride: int) -> None:
    """Post B's receives one by one (``stride`` bytes apart), each after the
    last completed: the Sends land in order, byte-exact."""
    got = []
    for i in range(len(blobs)):
        b.qp.post_recv(verbs.RecvWR(wr_id=i, sg=[verbs.SGE(b.mr.buf + i * stride, stride, b.mr.lkey)]))
        (rwc,) = b.cq.poll_blocking(1, timeout=10)
        got.append((rwc.wr_id, rwc.status, rwc.byte_len))
    assert got == [(i, IBV_WC_SUCCESS, len(x)) for i, x in enumerate(blobs)]
    assert [b.mr.read(len(x), i * stride) for i, x in enumerate(blobs)] == blobs


def test_rnr_loses_and_reorders_nothing(daemons) -> None:
    # Ten Sends, receives trickling in one at a time: every Send is NACKed at
    # least once, re-sent, and still lands in order, byte-exact.
    a, b = _rnr_pair(daemons, rnr_retry=7, min_rnr_timer=1)
    try:
        rng = random.Random(6)
        blobs = [rng.randbytes(n) for n in (1, 3000, 0, 1500, 7, 20000, 64, 1471, 2, 9000)]
        off = 0
        for i, blob in enumerate(blobs):
            a.mr.write(blob, len(blob), off)
            _send(a.qp, a.mr, off, len(blob), i)
            off += len(blob) + 1
        _receive_one_at_a_time(b, blobs, 32768)
        swcs = a.cq.poll_blocking(len(blobs), timeout=10)
        assert [(w.wr_id, w.status) for w in swcs] == [(i, IBV_WC_SUCCESS) for i in range(len(blobs))]
    finally:
        a.close()
        b.close()


def test_inline_sends_resent_after_rnr_are_what_was_posted(daemons) -> None:
    # A one-segment Send leaves from its WQE, and the daemon keeps its segment
    # to send again: each of these is NACKed (no receive yet) and re-sent
    # from that copy, the application having reused its buffer meanwhile.
    a, b = _rnr_pair(daemons, rnr_retry=7, min_rnr_timer=1, cap=verbs.QPCap(16, 16, 4, 4, max_inline_data=128))
    try:
        rng = random.Random(7)
        blobs = [rng.randbytes(n) for n in (2, 0, 128, 37)]
        for i, blob in enumerate(blobs):
            a.mr.write(blob, len(blob), 0)
            flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE | (IBV_SEND_SOLICITED if i == 2 else 0)
            a.qp.post_send(verbs.SendWR(wr_id=i, opcode=IBV_WR_SEND, sg=[verbs.SGE(a.mr.buf, len(blob), a.mr.lkey)],
                                        send_flags=flags))
            a.mr.write(bytes(128), 128, 0)
        assert _wait_stat(b.ctx, "rnr_nack_sent", 1) >= 1
        _receive_one_at_a_time(b, blobs, 256)
        swcs = a.cq.poll_blocking(len(blobs), timeout=10)
        assert [(w.wr_id, w.status, w.opcode) for w in swcs] == [(i, IBV_WC_SUCCESS, IBV_WC_SEND)
                                                                  for i in range(len(blobs))]
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


def test_immediate_data_without_a_receive_waits_for_one(daemons) -> None:
    # Write with Immediate and Send with Immediate both end in an Immediate Data
    # message that needs a receive: NACKed, re-sent, then each completes once.
    a, b = _rnr_pair(daemons, rnr_retry=7, min_rnr_timer=1)
    try:
        before = b.ctx.query_stats().get("rnr_nack_sent", 0)
        a.mr.write(b"W" * 3000, 3000, 0)
        wr = verbs.SendWR(wr_id=1, opcode=IBV_WR_RDMA_WRITE_WITH_IMM, imm_data=11,
                          sg=[verbs.SGE(a.mr.buf, 3000, a.mr.lkey)], send_flags=IBV_SEND_SIGNALED)
        wr.set_wr_rdma(b.mr.rkey, b.mr.buf + 8192)
        a.qp.post_send(wr)
        a.mr.write(b"S" * 2000, 2000, 4096)
        a.qp.post_send(verbs.SendWR(wr_id=2, opcode=IBV_WR_SEND_WITH_IMM, imm_data=22,
                                    sg=[verbs.SGE(a.mr.buf + 4096, 2000, a.mr.lkey)], send_flags=IBV_SEND_SIGNALED))
        assert _wait_stat(b.ctx, "rnr_nack_sent", before + 1) > before
        for i in (5, 6):
            b.qp.post_recv(verbs.RecvWR(wr_id=i, sg=[verbs.SGE(b.mr.buf + 65536 * i, 4096, b.mr.lkey)]))
        rwcs = b.cq.poll_blocking(2, timeout=10)
        assert [(w.wr_id, w.status, w.opcode, w.byte_len, w.imm_data) for w in rwcs] == [
            (5, IBV_WC_SUCCESS, IBV_WC_RECV_RDMA_WITH_IMM, 3000, 11), (6, IBV_WC_SUCCESS, IBV_WC_RECV, 2000, 22)]
        assert b.mr.read(3000, 8192) == b"W" * 3000 and b.mr.read(2000, 65536 * 6) == b"S" * 2000
        swcs = a.cq.poll_blocking(2, timeout=10)
        assert [(w.wr_id, w.status) for w in swcs] == [(1, IBV_WC_SUCCESS), (2, IBV_WC_SUCCESS)]
        assert a.cq.poll(4)[0] == 0 and b.cq.poll(4)[0] == 0  # nothing twice
    finally:
        a.close()
        b.close()
