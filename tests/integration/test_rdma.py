"""RDMA Write and Read between two real daemons: byte-exact, several SGEs, unaligned offsets."""

from __future__ import annotations

import random

import pytest
import trio

from udpverbs import verbs
from udpverbs.verbs.enums import (
    IBV_QP_STATE,
    IBV_QPS_RTS,
    IBV_QPS_SQD,
    IBV_SEND_INLINE,
    IBV_SEND_SIGNALED,
    IBV_WC_RDMA_READ,
    IBV_WC_RDMA_WRITE,
    IBV_WC_RECV_RDMA_WITH_IMM,
    IBV_WC_SUCCESS,
    IBV_WC_WITH_IMM,
    IBV_WR_RDMA_READ,
    IBV_WR_RDMA_WRITE,
    IBV_WR_RDMA_WRITE_WITH_IMM,
)
from udpverbs.wire import link, segment

from .conftest import Side, connect_manual

#: DDP payload bytes per segment at the daemons' default 1472-byte UDP payload
SEG = 1472 - link.OVERHEAD - segment.TAGGED_PREFIX_LEN


def _sges(mr: verbs.MR, offset: int, length: int, parts: int) -> list[verbs.SGE]:
    """Split [offset, offset+length) of ``mr`` into ``parts`` SGEs of uneven size."""
    if length < parts:
        parts = max(1, length)
    cuts = sorted({0, length, *(length * k // parts + k for k in range(1, parts))})
    cuts = [c for c in cuts if c <= length]
    return [verbs.SGE(mr.buf + offset + s, e - s, mr.lkey) for s, e in zip(cuts, cuts[1:])] or \
        [verbs.SGE(mr.buf + offset, 0, mr.lkey)]


def _post(qp: verbs.QP, opcode: int, sg: list[verbs.SGE], rkey: int, raddr: int, wr_id: int,
          imm: int = 0) -> None:
    wr = verbs.SendWR(wr_id=wr_id, opcode=opcode, sg=sg, send_flags=IBV_SEND_SIGNALED, imm_data=imm)
    wr.set_wr_rdma(rkey, raddr)
    qp.post_send(wr)


@pytest.mark.parametrize("size", [0, 1, SEG - 1, SEG, SEG + 1, 64 * 1024, 8 * 1024 * 1024])
def test_write_then_read_back_byte_exact(daemons, size: int) -> None:
    rng = random.Random(size)
    mr_size = 2 * size + 3 * 4096
    a, b = Side(daemons[0], mr_size), Side(daemons[1], mr_size)
    try:
        connect_manual(a, a.qp, b, b.qp)
        data = rng.randbytes(size)
        src_off, dst_off, back_off = 3, 4096 + 5, size + 4096 + 7
        a.mr.write(data, size, src_off)
        guard = rng.randbytes(mr_size)
        b.mr.write(guard, mr_size, 0)
        _post(a.qp, IBV_WR_RDMA_WRITE, _sges(a.mr, src_off, size, 3), b.mr.rkey, b.mr.buf + dst_off, 1)
        (wc,) = a.cq.poll_blocking(1, timeout=30)
        assert (wc.status, wc.opcode, wc.wr_id, wc.byte_len) == (IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, 1, size)
        got = b.mr.read(mr_size, 0)
        assert got[dst_off:dst_off + size] == data
        # Nothing outside the target range moved.
        assert got[:dst_off] == guard[:dst_off] and got[dst_off + size:] == guard[dst_off + size:]
        # Read it back into another, unaligned place on A, scattered over 3 SGEs.
        _post(a.qp, IBV_WR_RDMA_READ, _sges(a.mr, back_off, size, 3), b.mr.rkey, b.mr.buf + dst_off, 2)
        (wc,) = a.cq.poll_blocking(1, timeout=30)
        assert (wc.status, wc.opcode, wc.wr_id, wc.byte_len) == (IBV_WC_SUCCESS, IBV_WC_RDMA_READ, 2, size)
        assert a.mr.read(size, back_off) == data
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("posting", ["one_by_one", "list", "chain"])
def test_unsignaled_and_pipelined(pair, posting: str) -> None:
    a, b = pair
    rng = random.Random(5)
    blobs = [rng.randbytes(3000) for _ in range(20)]
    for i, blob in enumerate(blobs):
        a.mr.write(blob, len(blob), i * 4000)
    wrs = []
    for i in range(20):
        wr = verbs.SendWR(wr_id=i, opcode=IBV_WR_RDMA_WRITE, sg=[verbs.SGE(a.mr.buf + i * 4000, 3000, a.mr.lkey)],
                          send_flags=IBV_SEND_SIGNALED if i == 19 else 0)
        wr.set_wr_rdma(b.mr.rkey, b.mr.buf + i * 4000)
        wrs.append(wr)
    if posting == "one_by_one":
        for wr in wrs:
            a.qp.post_send(wr)
    elif posting == "list":  # a post list: one call, one doorbell
        a.qp.post_send(wrs)
    else:
        for w, nxt in zip(wrs, wrs[1:]):
            w.next_wr = nxt
        a.qp.post_send(wrs[0])
    (wc,) = a.cq.poll_blocking(1, timeout=10)
    assert (wc.wr_id, wc.status) == (19, IBV_WC_SUCCESS)
    assert a.cq.poll(10) == (0, [])  # unsignaled successes leave no CQE
    for i, blob in enumerate(blobs):
        assert b.mr.read(3000, i * 4000) == blob


def test_write_with_immediate_consumes_a_receive(pair) -> None:
    a, b = pair
    b.qp.post_recv(verbs.RecvWR(wr_id=77, sg=[]))
    a.mr.write(b"hello world", 11, 0)
    _post(a.qp, IBV_WR_RDMA_WRITE_WITH_IMM, [verbs.SGE(a.mr.buf, 11, a.mr.lkey)], b.mr.rkey, b.mr.buf + 100,
          9, imm=0x12345678)
    (wc,) = a.cq.poll_blocking(1, timeout=10)
    assert wc.status == IBV_WC_SUCCESS
    (rwc,) = b.cq.poll_blocking(1, timeout=10)
    assert (rwc.wr_id, rwc.status, rwc.opcode, rwc.imm_data, rwc.byte_len) == \
        (77, IBV_WC_SUCCESS, IBV_WC_RECV_RDMA_WITH_IMM, 0x12345678, 11)
    assert rwc.wc_flags & IBV_WC_WITH_IMM and rwc.qp_num == b.qp.qp_num and rwc.src_qp == a.qp.qp_num
    assert b.mr.read(11, 100) == b"hello world"


def test_64_qps_at_once(daemons) -> None:
    a, b = Side(daemons[0], 64 * 8192), Side(daemons[1], 64 * 8192)
    try:
        qps = []
        for _ in range(64):
            qa, qb = a.new_qp(), b.new_qp()
            connect_manual(a, qa, b, qb)
            qps.append((qa, qb))
        rng = random.Random(64)
        blobs = [rng.randbytes(5000 + i) for i in range(64)]
        for i, ((qa, _), blob) in enumerate(zip(qps, blobs)):
            a.mr.write(blob, len(blob), i * 8192)
            _post(qa, IBV_WR_RDMA_WRITE, [verbs.SGE(a.mr.buf + i * 8192, len(blob), a.mr.lkey)], b.mr.rkey,
                  b.mr.buf + i * 8192, i)
        wcs = a.cq.poll_blocking(64, timeout=30)
        assert sorted(w.wr_id for w in wcs) == list(range(64))
        assert all(w.status == IBV_WC_SUCCESS for w in wcs)
        assert {w.qp_num for w in wcs} == {qa.qp_num for qa, _ in qps}
        for i, blob in enumerate(blobs):
            assert b.mr.read(len(blob), i * 8192) == blob
    finally:
        a.close()
        b.close()


async def test_trio_api(daemons) -> None:
    a, b = Side(daemons[0]), Side(daemons[1])
    try:
        connect_manual(a, a.qp, b, b.qp)
        with trio.fail_after(20):
            for i in range(5):
                payload = bytes([i]) * (10000 + i)
                a.mr.write(payload, len(payload), 0)
                _post(a.qp, IBV_WR_RDMA_WRITE, [verbs.SGE(a.mr.buf, len(payload), a.mr.lkey)], b.mr.rkey,
                      b.mr.buf, i)
                (wc,) = await a.cq.poll_async(1)
                assert (wc.wr_id, wc.status) == (i, IBV_WC_SUCCESS)
                assert b.mr.read(len(payload), 0) == payload
            # and a Read, waited for through a completion channel
            ch = verbs.CompChannel(a.ctx)
            cq2 = verbs.CQ(a.ctx, 16, channel=ch)
            qa = verbs.QP(a.pd, verbs.QPInitAttr(scq=cq2, rcq=cq2, cap=verbs.QPCap(4, 4)))
            qb = b.new_qp()
            connect_manual(a, qa, b, qb)
            cq2.req_notify()
            _post(qa, IBV_WR_RDMA_READ, [verbs.SGE(a.mr.buf + 50000, 10004, a.mr.lkey)], b.mr.rkey, b.mr.buf, 42)
            assert await ch.get_cq_event_async() is cq2
            n, (wc,) = cq2.poll(1)
            assert (n, wc.wr_id, wc.status) == (1, 42, IBV_WC_SUCCESS)
            assert a.mr.read(10004, 50000) == bytes([4]) * 10004
    finally:
        a.close()
        b.close()


def test_inline_write_and_sqd_pause(daemons) -> None:
    a, b = Side(daemons[0], cap=verbs.QPCap(16, 16, 4, 4, max_inline_data=128)), Side(daemons[1])
    try:
        connect_manual(a, a.qp, b, b.qp)
        # Inline: the library copies the bytes into the WQE; the source need not stay intact.
        a.mr.write(b"inline payload!!", 16, 0)
        wr = verbs.SendWR(wr_id=1, opcode=IBV_WR_RDMA_WRITE, sg=[verbs.SGE(a.mr.buf, 16, a.mr.lkey)],
                          send_flags=IBV_SEND_SIGNALED | IBV_SEND_INLINE)
        wr.set_wr_rdma(b.mr.rkey, b.mr.buf + 3)
        a.qp.post_send(wr)
        a.mr.write(b"X" * 16, 16, 0)
        (wc,) = a.cq.poll_blocking(1, timeout=10)
        assert wc.status == IBV_WC_SUCCESS and b.mr.read(16, 3) == b"inline payload!!"
        # SQD: the send queue stops taking WQEs; back to RTS, they go.
        a.qp.modify(verbs.QPAttr(qp_state=IBV_QPS_SQD), IBV_QP_STATE)
        _post(a.qp, IBV_WR_RDMA_WRITE, [verbs.SGE(a.mr.buf, 16, a.mr.lkey)], b.mr.rkey, b.mr.buf + 100, 2)
        with pytest.raises(TimeoutError):
            a.cq.wait(timeout=0.3)
        assert b.mr.read(16, 100) == bytes(16)
        a.qp.modify(verbs.QPAttr(qp_state=IBV_QPS_RTS), IBV_QP_STATE)
        (wc,) = a.cq.poll_blocking(1, timeout=10)
        assert (wc.wr_id, wc.status) == (2, IBV_WC_SUCCESS) and b.mr.read(16, 100) == b"X" * 16
    finally:
        a.close()
        b.close()
