"""The Send batch: a GRO buffer of small Sends placed and completed in one compiled call.

Theory of operation
-------------------
In a stream of one-datagram Sends (perftest's ``send_bw -s 64``) every
datagram is a whole message that takes the next posted receive and ends
with its CQE.  The receive lane (``rxlane.py``) ends its run at each such
message, so each cost the receiving daemon a lane set-up (the receive
resolved), a lane call, the receive's completion and the link's accounting,
in Python.  Once the lane has taken the first Send of a buffer the usual
way, :func:`more_sends` hands the rest of the buffer to
``udpv_rx_send_batch`` (``wire/_native_batch.c``): for each datagram, the
lane's own checks (``udpv_rx_write_run``, one whole plain Send with the next
MSN), the next receive taken from the RQ (one SGE in one region checked
here once: the QP's PD, local write), the payload placed, the CQE written;
then the receives leave the ring, the CQEs are published (one wake-up if
the CQ is armed) and the link accounts for the run, in one step each.

It stops where the per-message path must decide: a Send with Solicited
Event, Invalidate or Immediate Data, of several segments, one longer than
its receive, a receive of several SGEs or elsewhere, no receive posted
(RNR), a full CQ, anything the lane refuses.  What it leaves, the usual
path takes (``Receiver.receive`` goes on where it stopped).  Not with an
SRQ (its low-water event is counted per receive taken), nor on a link of
several paths.
``tests/daemon/test_rx_sends.py`` checks that a receiver with the batch and
one without answer alike and complete alike.
"""

from __future__ import annotations

import struct
from typing import Any

from ..wire import rdmap, segment, shm
from ..wire.rdmap import Opcode
from .opcodes import LOCAL_WRITE, RECEIVING, U32
from .peer import PeerLink

_SEND_CTRL = (*rdmap.UNTAGGED_CONTROL[Opcode.SEND, False][:2], rdmap.UNTAGGED_CONTROL[Opcode.SEND, True][0])
_WC_RECV = int(shm.WcOpcode.IBV_WC_RECV)
_RECV_SG_OFFSET = shm.RECV_WQE_SG_OFFSET
_RECV_NUM_SGE = struct.Struct("=8xI")  # struct uv_recv_wqe's num_sge (RECV_WQE_HEAD's second field)
_SGE = shm.SGE


class SendBatch:
    """The Send batch's descriptor and its own lane run (``udpv_rx_run``)."""

    def __init__(self, native: Any) -> None:
        ffi = native.ffi
        self.ffi = ffi
        self.lib = native.lib
        self.s = ffi.new("udpv_rx_sends *")
        self.run = ffi.new("udpv_rx_run *")
        self.s.rq_sg_at = _RECV_SG_OFFSET
        self.s.wc_recv = _WC_RECV
        r = self.run
        # one whole plain Send per datagram (see udpv_rx_send_batch)
        r.qn = r.last_fills = r.many = r.base = r.stag = 0
        r.untagged = r.last_ends = r.sequential = r.whole = 1
        r.ctrl_more, r.rctl, r.ctrl_last = _SEND_CTRL


def more_sends(b: SendBatch, pl: PeerLink, qp: Any, stats: Any, data: bytes, off: int, end: int, seg: int,
               now: float, arrived: float) -> int:
    """Place and complete the one-segment Sends for ``qp`` at
    ``data[off:end]`` (datagrams of ``seg`` bytes) in one compiled call,
    right after the lane took the Send before them; return the bytes
    consumed (0: none, the usual path goes on)."""
    if (qp.srq is not None or qp.rx_recv is not None or qp.rx_imm_pending or qp.rx_rnr
            or qp.state not in RECEIVING or qp.recv_cq.overrun or pl.link.multipath):
        return 0
    rq = qp.recv_ring
    cq = qp.recv_cq.ring
    try:
        posted = rq.available()
        room = cq.free()
    except shm.RingError:
        return 0  # the usual path reports it
    if not posted or not room:
        return 0
    at = rq.slot_offset()
    if _RECV_NUM_SGE.unpack_from(rq.buf, at)[0] != 1:
        return 0
    addr, length, lkey = _SGE.unpack_from(rq.buf, at + _RECV_SG_OFFSET)
    mr = qp.device.stags.lookup(lkey)
    if mr is None or mr.check(qp.pd, LOCAL_WRITE, addr, length, tagged=False)[0]:
        return 0
    expect = pl.link.run_receivable()
    if expect is None:
        return 0
    r = b.run
    r.conn_tag, r.seq, r.max_count = expect
    r.w0, r.w1, r.msn = segment.DDP_WORD | qp.qpn, qp.dest_qpn, qp.rx_msn
    s = b.s
    ffi = b.ffi
    s.rq = ffi.cast("uint8_t *", int(shm.ffi.cast("uintptr_t", rq._slots)))
    s.rq_cons, s.rq_mask, s.rq_entry_size, s.rq_avail = rq.cons, rq.mask, rq.entry_size, posted
    s.lkey, s.addr, s.len = lkey, mr.addr, mr.length
    s.cq = ffi.cast("uint8_t *", int(shm.ffi.cast("uintptr_t", cq._slots)))
    s.cq_prod, s.cq_mask, s.cq_entry_size, s.cq_room = cq.prod, cq.mask, cq.entry_size, room
    s.qp_num, s.src_qp = qp.qpn, qp.dest_qpn
    try:
        mem = ffi.from_buffer("uint8_t[]", mr.view, require_writable=True)
    except ValueError:
        return 0
    buf = ffi.from_buffer("uint8_t[]", data)
    try:
        k = b.lib.udpv_rx_send_batch(s, r, buf + off, end - off, seg, mem)
    finally:
        # no export may outlive the call: deregistration releases the view
        ffi.release(mem)
        ffi.release(buf)
    if not k:
        return 0
    _taken(pl, qp, s, k, stats, now, arrived)
    used = k * seg
    return used if used < end - off else end - off


def _taken(pl: PeerLink, qp: Any, s: Any, k: int, stats: Any, now: float, arrived: float) -> None:
    """What ``k`` Sends placed by the batch leave to do: as the usual path
    does for each (``Responder.sends_placed``, ``ReceiveLane.run_taken``),
    once for all."""
    qp.recv_ring.pop(k)
    qp.recv_cq.pushed(k)
    qp.rx_msn = (qp.rx_msn + k) & U32
    qp.rx_placed = s.last_len  # as the last receive's completion leaves it
    qp.flow_ack_due = True  # Modified ACK: the sender may complete the WRs
    stats["rx_native_sends"] += k
    stats["rx_native_datagrams"] += k
    stats["rx_batched_sends"] += k
    pl.link.data_run_received(k, s.ack, s.ts, s.echo, s.rwnd, s.flags, s.last_ts, s.last_rwnd, s.flags_or, now,
                              arrived)
    if s.flow_ack:
        qp.on_flow_ack(s.flow_ack_msn)
