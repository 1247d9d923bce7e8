"""Read and Atomic Requests on one DDP queue (RFC 7306): the requester's MSNs, and a Terminate naming one.

A real ``Device`` and QP in RTS towards a link (``test_fuzz.setup_qp``); WQEs
go into the SQ ring through the struct layouts the verbs library uses.
"""

from __future__ import annotations

from udpverbs.daemon.device import Device, DeviceConfig
from udpverbs.wire import rdmap, segment, shm
from udpverbs.wire.rdmap import Opcode
from udpverbs.wire.shm import WcStatus as W, WrOpcode

from .test_engine_edges import _cqes
from .test_fuzz import setup_qp


def _post(qp, wr_id: int, opcode: int, addr: int, stag: int, compare_add: int = 0) -> None:
    sq = qp.sq
    at = sq.next_slot_offset()
    shm.SEND_WQE_HEAD.pack_into(sq.buf, at, wr_id, 0x100000, opcode, int(shm.SendFlags.IBV_SEND_SIGNALED), 1, 0,
                                0x101, 0, compare_add, 0)
    shm.SGE.pack_into(sq.buf, at + shm.SEND_WQE_SG_OFFSET, addr, 8, stag)
    sq.push()
    sq.publish()


async def test_atomics_share_the_read_requests_queue_and_a_terminate_names_one_by_its_msn() -> None:
    dev = Device(DeviceConfig(seed=4))
    sess, qp, mrs = setup_qp(dev)
    mr = mrs[0]
    rec = qp.link.link.recovery
    before = rec.queued()
    _post(qp, 1, WrOpcode.IBV_WR_RDMA_READ, mr.addr, mr.stag)
    _post(qp, 2, WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD, mr.addr + 8, mr.stag, 1)
    _post(qp, 3, WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD, mr.addr + 16, mr.stag, 1)
    qp.pump(64)
    qp.link.flush_requests()
    sent = [bytes(rec.message(n)) for n in sorted(rec.queued() - before)]
    headers = [segment.decode_untrusted(m)[1] for m in sent]
    # one MSN sequence on queue 1 for both kinds of request
    assert [(h.opcode, h.qn, h.msn) for h in headers] == [
        (Opcode.RDMA_READ_REQUEST, 1, 1), (Opcode.ATOMIC_REQUEST, 1, 2), (Opcode.ATOMIC_REQUEST, 1, 3)]
    # The peer refuses the second atomic: its Terminate copies that request's
    # DDP header (QN 1, MSN 3), which names WR 3, not the oldest WR waiting.
    at = segment.UNTAGGED_PREFIX_LEN - rdmap.ddp.UNTAGGED_HEADER_LEN
    term = rdmap.Terminate(rdmap.TermLayer.RDMAP, rdmap.RdmapErrorType.REMOTE_PROTECTION,
                           rdmap.RdmapErrorCode.ACCESS_RIGHTS_VIOLATION, True, len(sent[2]) - at,
                           sent[2][at:segment.UNTAGGED_PREFIX_LEN])
    dev.receiver.dispatch(qp.link, segment.encode(qp.qpn, qp.dest_qpn, rdmap.encode_untagged(
        Opcode.TERMINATE, True, 1, 0, rdmap.encode_terminate(term))))
    cqes = _cqes(qp.send_cq)
    assert [wr_id for wr_id, status in cqes if status == W.IBV_WC_REM_ACCESS_ERR] == [3], cqes
    sess.teardown()
    dev.close()
