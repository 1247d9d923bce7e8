"""Edges of the QP engine found in review: what a failing send side owes its receives, max_msg_sz.

A real ``Device`` and QP in RTS towards a link (``test_fuzz.setup_qp``); WQEs
go into the rings through the same struct layouts the verbs library uses.
"""

from __future__ import annotations

import pytest

from udpverbs.daemon import tables
from udpverbs.daemon.device import Device, DeviceConfig
from udpverbs.wire import envelope, rdmap, segment, shm
from udpverbs.wire.envelope import Kind
from udpverbs.wire.rdmap import Opcode
from udpverbs.wire.shm import AccessFlags as A, QPState as S, WcStatus as W, WrOpcode

from .test_fuzz import setup_qp


def _post_recv(qp, wr_id: int, mr: tables.MemoryRegion, length: int) -> None:
    rq = qp.recv_ring
    at = rq.next_slot_offset()
    shm.RECV_WQE_HEAD.pack_into(rq.buf, at, wr_id, 1)
    shm.SGE.pack_into(rq.buf, at + shm.RECV_WQE_SG_OFFSET, mr.addr, length, mr.stag)
    rq.push()
    rq.publish()


def _post_send(qp, wr_id: int, opcode: int, mr: tables.MemoryRegion, length: int) -> None:
    sq = qp.sq
    at = sq.next_slot_offset()
    shm.SEND_WQE_HEAD.pack_into(sq.buf, at, wr_id, 0x100000, opcode, int(shm.SendFlags.IBV_SEND_SIGNALED), 1, 0,
                                0x101, 0, 0, 0)
    shm.SGE.pack_into(sq.buf, at + shm.SEND_WQE_SG_OFFSET, mr.addr, length, mr.stag)
    sq.push()
    sq.publish()


def _cqes(cq) -> list[tuple[int, int]]:
    ring, out = cq.ring, []
    while ring.available():
        wr_id, status, *_ = shm.CQE.unpack_from(ring.buf, ring.slot_offset())
        out.append((wr_id, status))
        ring.pop()
    return out


def _queued_kinds(qp, since: set[int]) -> list[int]:
    rec = qp.link.link.recovery
    return [envelope.decode_untrusted(bytes(rec.message(n)))[0].kind for n in sorted(rec.queued() - since)]


async def test_a_due_flow_ack_leaves_even_when_the_send_side_fails() -> None:
    # The peer's Send completed a receive here, so the peer's WR waits for our
    # Modified ACK; the QP's send side then fails in the same pass.  The ACK
    # must still go out (it is queued last in a pass, hence in a finally).
    dev = Device(DeviceConfig(seed=1))
    sess, qp, mrs = setup_qp(dev)
    _post_recv(qp, 42, mrs[0], 100)
    dev.receiver.dispatch(qp.link, segment.encode(qp.qpn, qp.dest_qpn, rdmap.encode_untagged(Opcode.SEND, True, 1, 0, b"hi")))
    assert qp.flow_ack_due
    before = qp.link.link.recovery.queued()

    def broken(link, budget, start):
        raise RuntimeError("an engine bug")

    qp.pump_messages = broken
    dev.poll_once()
    assert dev.stats["qp_exception"] == 1 and qp.state == S.IBV_QPS_ERR
    assert Kind.FLOW in _queued_kinds(qp, before)
    assert not qp.flow_ack_due
    sess.teardown()
    dev.close()


async def test_a_full_link_still_carries_the_flow_ack_a_qp_owes() -> None:
    # The pump skips a QP whose link takes nothing more this pass (64 QPs
    # streaming), but not the Modified ACK it owes: that goes past the send
    # buffer, or the peer's Send would wait for it until the link drains.
    dev = Device(DeviceConfig(seed=1))
    sess, qp, mrs = setup_qp(dev)
    _post_send(qp, 7, WrOpcode.IBV_WR_RDMA_WRITE, mrs[0], 10)
    link = qp.link.link
    while link.send_space():
        link.send(b"filler", 0.0)
    before = link.recovery.queued()
    qp.pump(64)
    assert _queued_kinds(qp, before) == []  # the Write waits for room
    _post_recv(qp, 42, mrs[0], 100)
    dev.receiver.dispatch(qp.link, segment.encode(qp.qpn, qp.dest_qpn, rdmap.encode_untagged(Opcode.SEND, True, 1, 0, b"hi")))
    assert qp.flow_ack_due
    qp.pump(64)
    assert _queued_kinds(qp, before) == [Kind.FLOW] and not qp.flow_ack_due
    sess.teardown()
    dev.close()


@pytest.mark.parametrize("opcode", [WrOpcode.IBV_WR_RDMA_WRITE, WrOpcode.IBV_WR_RDMA_READ, WrOpcode.IBV_WR_SEND])
async def test_a_message_longer_than_max_msg_sz_completes_with_loc_len_err(opcode: int) -> None:
    # A Read Request's size and a Send's MO are 32-bit; the port says
    # max_msg_sz = 2 GiB.  Beyond it: IBV_WC_LOC_LEN_ERR, not an engine error.
    dev = Device(DeviceConfig(seed=2))
    sess, qp, mrs = setup_qp(dev)
    size = shm.MAX_MSG_SZ + 4096
    _, mm = shm.new_segment(size, "sparse")  # a sparse memfd: no memory is touched
    big = tables.MemoryRegion(9, qp.pd, int(A.IBV_ACCESS_LOCAL_WRITE), 0x10_0000_0000, size, mm)
    dev.stags.register(big)
    _post_send(qp, 7, int(opcode), big, shm.MAX_MSG_SZ + 1)
    dev.poll_once()
    dev.poll_once()
    assert dev.stats["qp_exception"] == 0
    assert _cqes(qp.send_cq) == [(7, W.IBV_WC_LOC_LEN_ERR)]
    assert qp.state == S.IBV_QPS_ERR
    sess.teardown()
    big.close()
    dev.close()
