"""The data path fed hostile messages: never an exception, never a byte outside a region.

A real ``Device`` with a real client ``Session`` (over a socketpair), a PD,
two MRs and a QP in RTS towards a peer link; then thousands of messages with
a valid envelope and random or mutated DDP/RDMAP headers go through
``Receiver.dispatch``, exactly where the data loop hands them in.
"""

from __future__ import annotations

import random
import socket
import sys

import trio

from udpverbs.daemon.control import Session, modify_qp
from udpverbs.daemon.device import Device, DeviceConfig
from udpverbs.daemon.cq import CompletionQueue
from udpverbs.daemon.qp import QueuePair
from udpverbs.daemon import tables
from udpverbs.wire import ctl, envelope, flow, rdmap, segment, shm
from udpverbs.wire.rdmap import Opcode
from udpverbs.wire.shm import AccessFlags as A, QPAttrMask as M, QPState as S

ALL = A.IBV_ACCESS_LOCAL_WRITE | A.IBV_ACCESS_REMOTE_WRITE | A.IBV_ACCESS_REMOTE_READ | A.IBV_ACCESS_REMOTE_ATOMIC


def setup_qp(dev: Device) -> tuple[Session, QueuePair, list[tables.MemoryRegion]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sess = Session(dev, trio.socket.from_stdlib_socket(a), pid=1)
    b.close()
    dev.sessions.add(sess)
    pd = tables.ProtectionDomain(1, sess)
    mrs = []
    for access in (ALL, A.IBV_ACCESS_LOCAL_WRITE):
        fd, mm = shm.new_segment(8192, "fuzz")
        mr = tables.MemoryRegion(len(mrs) + 1, pd, access, 0x100000 * (len(mrs) + 1), 5000, mm)
        dev.stags.register(mr)
        mrs.append(mr)
    cq = CompletionQueue(1, sess, 64, None)
    qp = QueuePair(dev, 5, sess, pd, cq, cq, {"max_send_wr": 16, "max_recv_wr": 16, "max_send_sge": 4,
                                              "max_recv_sge": 4, "max_inline_data": 0}, False)
    dev.qps[5] = qp
    _to_rts(qp)
    return sess, qp, mrs


def _to_rts(qp: QueuePair) -> None:
    if qp.state != S.IBV_QPS_RESET:
        modify_qp(qp, M.IBV_QP_STATE, dict(qp.attrs, qp_state=S.IBV_QPS_RESET))
    attrs = dict(qp.attrs, qp_state=S.IBV_QPS_INIT, qp_access_flags=ALL)
    modify_qp(qp, M.IBV_QP_STATE | M.IBV_QP_PKEY_INDEX | M.IBV_QP_PORT | M.IBV_QP_ACCESS_FLAGS, attrs)
    attrs.update(qp_state=S.IBV_QPS_RTR, dgid=ctl.gid_from_ip("127.0.0.9"), dlid=9, dest_qp_num=7,
                 max_dest_rd_atomic=4)
    modify_qp(qp, M.IBV_QP_STATE | M.IBV_QP_AV | M.IBV_QP_PATH_MTU | M.IBV_QP_DEST_QPN | M.IBV_QP_RQ_PSN
              | M.IBV_QP_MAX_DEST_RD_ATOMIC | M.IBV_QP_MIN_RNR_TIMER, attrs)
    attrs.update(qp_state=S.IBV_QPS_RTS, max_rd_atomic=4)
    modify_qp(qp, M.IBV_QP_STATE | M.IBV_QP_SQ_PSN | M.IBV_QP_TIMEOUT | M.IBV_QP_RETRY_CNT | M.IBV_QP_RNR_RETRY
              | M.IBV_QP_MAX_QP_RD_ATOMIC, attrs)


def _message(rng: random.Random, mrs: list[tables.MemoryRegion]) -> bytes:
    kind = rng.randrange(8)
    # Mostly near-valid (so placements and responses happen), sometimes wild.
    stag = rng.choice([mrs[0].stag] * 4 + [mrs[1].stag, rng.getrandbits(32)])
    to = rng.choice([mrs[0].addr + rng.randrange(-100, 5100)] * 4 + [rng.getrandbits(64), 0])
    if kind == 0:  # tagged Write, plausible or not
        payload = rng.randbytes(rng.randrange(0, 300))
        seg = rdmap.encode_tagged(Opcode.RDMA_WRITE, rng.random() < 0.5, stag, to, payload)
    elif kind == 1:  # Read Request with random fields
        body = rdmap.encode_read_request(rdmap.ReadRequest(rng.getrandbits(32), rng.getrandbits(64),
                                                           rng.randrange(0, 1 << 20), stag, to))
        seg = rdmap.encode_untagged(Opcode.RDMA_READ_REQUEST, True, rng.getrandbits(32), 0, body)
    elif kind == 2:  # unsolicited Read Response
        seg = rdmap.encode_tagged(Opcode.RDMA_READ_RESPONSE, rng.random() < 0.5, rng.getrandbits(32), to,
                                  rng.randbytes(rng.randrange(0, 100)))
    elif kind == 3:  # Terminate / Immediate / Send with random bodies
        op = rng.choice([Opcode.TERMINATE, Opcode.IMMEDIATE_DATA, Opcode.SEND, Opcode.ATOMIC_REQUEST])
        seg = rdmap.encode_untagged(op, True, 1, 0, rng.randbytes(rng.randrange(4, 60)))
    elif kind == 6:  # Modified ACK/NACK messages, valid or noise
        body = rng.choice([flow.encode(flow.FlowMessage(rng.choice(list(flow.FlowType)), rng.getrandbits(32)))] * 3
                          + [rng.randbytes(rng.randrange(0, 20))])
        return envelope.encode(envelope.Kind.FLOW, 5, 7, body)
    elif kind == 7:  # atomics at plausible words, and Sends that claim Immediate Data follows
        if rng.random() < 0.5:
            req = rdmap.AtomicRequest(rng.choice(list(rdmap.AtomicOp)), rng.getrandbits(32), stag, to & ~7,
                                      rng.getrandbits(64), rng.getrandbits(64), rng.getrandbits(64),
                                      rng.getrandbits(64))
            seg = rdmap.encode_untagged(Opcode.ATOMIC_REQUEST, True, rng.randrange(1, 4), 0,
                                        rdmap.encode_atomic_request(req))
            return segment.encode(5, 7, seg)
        op = rng.choice([Opcode.SEND, Opcode.SEND_SE_INVALIDATE])
        seg = rdmap.encode_untagged(op, True, rng.randrange(1, 4), 0, rng.randbytes(rng.randrange(0, 50)),
                                    0 if op == Opcode.SEND else stag)
        return segment.encode(5, 7, seg, envelope.Flags.IMM_FOLLOWS)
    else:  # bit flips in a valid Write header, or pure noise
        seg = bytearray(rdmap.encode_tagged(Opcode.RDMA_WRITE, True, stag, to, rng.randbytes(20)))
        for _ in range(rng.randrange(1, 4)):
            seg[rng.randrange(len(seg))] ^= 1 << rng.randrange(8)
        if kind == 5:
            seg = bytearray(rng.randbytes(rng.randrange(0, 60)))
    return segment.encode(5, 7, seg) if rng.random() < 0.95 else segment.encode(5, 8, seg)


async def test_hostile_segments_never_raise_nor_escape_a_region() -> None:
    rng = random.Random(2024)
    placed = 0
    for round_ in range(10):
        dev = Device(DeviceConfig(seed=round_))
        sess, qp, mrs = setup_qp(dev)
        guards = [bytes(mr.mm[mr.length:]) for mr in mrs]  # bytes of the mapping past each region
        before = [bytes(mr.mm[:mr.length]) for mr in mrs]
        for _ in range(300):
            dev.receiver.dispatch(qp.link, _message(rng, mrs))
            placed += qp.rx_write_bytes
            qp.rx_write_bytes = 0
            if qp.state == S.IBV_QPS_ERR:  # a violation ended the QP: bring it back and go on
                _to_rts(qp)
        assert dev.stats["rx_exception"] == 0, dev.stats
        for mr, g in zip(mrs, guards):
            assert bytes(mr.mm[mr.length:]) == g  # never past the registered length
        assert bytes(mrs[1].mm[:mrs[1].length]) == before[1]  # no REMOTE_WRITE: never written
        sess.teardown()
        dev.close()
    assert placed > 10_000  # the fuzz did reach the placement path


async def test_a_repeated_atomic_request_is_answered_but_not_applied_twice() -> None:
    # The link never duplicates, but RFC 7306 asks the responder to cope with a
    # request sent again after its response was lost: answer from the record.
    dev = Device(DeviceConfig(seed=3))
    sess, qp, mrs = setup_qp(dev)
    mr = mrs[0]
    req = rdmap.AtomicRequest(rdmap.AtomicOp.FETCH_ADD, 77, mr.stag, mr.addr + 16, 5, 0, 0, 0)
    msg = segment.encode(5, 7, rdmap.encode_untagged(Opcode.ATOMIC_REQUEST, True, 1, 0,
                                                     rdmap.encode_atomic_request(req)))
    mr.view[16:24] = (100).to_bytes(8, sys.byteorder)
    dev.receiver.dispatch(qp.link, msg)
    dev.receiver.dispatch(qp.link, msg)
    assert int.from_bytes(mr.view[16:24], sys.byteorder) == 105
    assert dev.stats["atomic_replayed"] == 1 and qp.state == S.IBV_QPS_RTS
    replies = [rdmap.decode_atomic_response_untrusted(r.body) for r in qp.irrq]
    assert replies == [rdmap.AtomicResponse(77, 100)] * 2
    # A request from the future (MSN skipped) is a protocol error, not a replay.
    bad = segment.encode(5, 7, rdmap.encode_untagged(Opcode.ATOMIC_REQUEST, True, 9, 0,
                                                     rdmap.encode_atomic_request(req)))
    dev.receiver.dispatch(qp.link, bad)
    assert qp.state == S.IBV_QPS_ERR and int.from_bytes(mr.view[16:24], sys.byteorder) == 105
    sess.teardown()
    dev.close()


def test_masked_atomics_follow_rfc_7306() -> None:
    from udpverbs.daemon.responder import apply_atomic

    # Two 32-bit fields: a mask bit at 31 ends the low field, so its carry is dropped.
    fa = rdmap.AtomicRequest(rdmap.AtomicOp.FETCH_ADD, 1, 0, 0, 0x0000_0001_0000_0001, 1 << 31, 0, 0)
    assert apply_atomic(fa, 0x0000_0000_FFFF_FFFF) == 0x0000_0001_0000_0000
    plain = fa._replace(add_swap_mask=0)
    assert apply_atomic(plain, 0x0000_0000_FFFF_FFFF) == 0x0000_0002_0000_0000
    assert apply_atomic(plain._replace(add_swap_data=1), (1 << 64) - 1) == 0  # wraps
    swap = rdmap.AtomicRequest(rdmap.AtomicOp.SWAP, 1, 0, 0, 0xAAAA, 0x00FF, 0, 0)
    assert apply_atomic(swap, 0x1234) == 0x12AA
    cas = rdmap.AtomicRequest(rdmap.AtomicOp.CMP_SWAP, 1, 0, 0, 0xBEEF, 0xFFFF, 0x0034, 0x00FF)
    assert apply_atomic(cas, 0x1234) == 0xBEEF  # compared on the low byte only
    assert apply_atomic(cas, 0x1235) == 0x1235
