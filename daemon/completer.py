"""The completer: what answers our requests, and the CQEs of our send WRs.

Theory of operation
-------------------
Completions keep SQ order (verbs RC semantics): ``outstanding`` holds the
in-flight WRs in posting order and ``complete_acked`` retires them from
the head only.  An RDMA Write is complete when the link has acknowledged
its last message (``OutWR.last_n`` below ``link.acked``); a Send or
Immediate Data when the receiver's Modified ACK covers its last queue-0
message (``on_flow``); a Read when its last Read Response segment is placed
(``on_read_response``); an atomic when its Atomic Response lands the
original value.  Unsignaled successful WRs produce no CQE; errors always do.

The requester side of Modified ACK/NACK (RHiNET/PM, ``wire/flow.py``) is
here too: an RNR NACK rewinds queue 0 to the NACKed message and sets a
back-off that doubles per try (a RESUME from the receiver ends it at once);
``rnr_retry`` NACKs (7 = forever) end the WR with IBV_WC_RNR_RETRY_EXC_ERR.
A Terminate from the peer (RFC 5040 §4.8) fails the WR it names, completes
the ones before it and moves the QP to ERR.

This is one role of a :class:`~udpverbs.daemon.qp.QueuePair` (rdma-core's
rxe splits its QP engine the same way: ``rxe_req.c``, ``rxe_resp.c``,
``rxe_comp.c``); the state it works on lives on the QP.
"""

from __future__ import annotations

from typing import Any

from ..wire import flow, rdmap
from ..wire.flow import FlowType
from ..wire.rdmap import Opcode
from ..wire.shm import QPState as S, WcStatus as W
from .opcodes import HOST_ORDER, U32
from .records import OutWR, PendingAtomic, PendingRead

#: The longest RNR back-off a sender waits before it tries again (a RESUME ends it sooner).
RNR_BACKOFF_MAX_S = 1.0


class Completer:
    """The completer's methods of a QueuePair (see the module docstring)."""

    # -- CQEs -----------------------------------------------------------------
    def _complete(self, wr: OutWR) -> None:
        if wr.status != 0 or wr.signaled:
            self.send_cq.push(wr.wr_id, wr.status, wr.wc_opcode, wr.byte_len if wr.status == 0 else 0,
                              self.qpn, self.dest_qpn)

    def complete_acked(self, acked: int) -> bool:
        """Retire WRs at the head of the SQ that are done or that the link
        acknowledged below ``acked`` (-1: only those done); return True if any."""
        q = self.outstanding
        progressed = False
        while q:
            wr = q[0]
            if not (wr.done or (0 <= wr.last_n < acked)):
                break
            q.popleft()
            self._complete(wr)
            progressed = True
        return progressed

    def complete_all(self) -> None:
        """Complete every outstanding WR (with IBV_WC_WR_FLUSH_ERR unless it has a status already)."""
        for wr in self.outstanding:
            if wr.status == W.IBV_WC_SUCCESS:
                wr.status = W.IBV_WC_WR_FLUSH_ERR
            self._complete(wr)
        self.outstanding.clear()

    def fail_oldest(self, acked: int) -> None:
        """The link's retry budget is gone: the oldest WR neither done nor
        acknowledged below ``acked`` gets IBV_WC_RETRY_EXC_ERR."""
        for wr in self.outstanding:
            if not wr.done and not (0 <= wr.last_n < acked):
                wr.status = W.IBV_WC_RETRY_EXC_ERR
                wr.done = True
                break

    # -- Modified ACK/NACK, the requester's side (wire/flow.py) ------------------
    def _unwrap_msn(self, wire_msn: int) -> int:
        """The unwrapped MSN of a queue-0 message we sent, from its 32-bit wire form."""
        base = self.q0[0].msn if self.q0 else self.send_msn
        return base + ((wire_msn - base) & U32) if (wire_msn - base) & U32 < 1 << 31 \
            else base - ((base - wire_msn) & U32)

    def on_flow(self, payload: memoryview) -> None:
        """A Modified ACK/NACK message from the peer QP (never raises on bad input)."""
        try:
            m = flow.decode_untrusted(payload)
        except Exception:  # WireError only; a bad message is a counter, not a crash
            self.device.stats["rx_bad_flow"] += 1
            return
        if self.state == S.IBV_QPS_ERR:
            return
        msn = self._unwrap_msn(m.msn)
        if m.ftype == FlowType.ACK:
            self._flow_acked(msn)
        elif m.ftype == FlowType.RNR_NACK:
            self._on_rnr_nack(msn, m.backoff_us)
        elif m.ftype == FlowType.RESUME:
            stats = self.device.stats
            stats["rnr_resume_received"] += 1
            if self.rnr_blocked_msn == msn:
                if self.rnr_until is not None:
                    stats["rnr_backoff_cut"] += 1  # the re-send need not wait out the back-off
                self.rnr_until = None  # the receiver has a buffer now: re-send at once

    def _on_rnr_nack(self, msn: int, backoff_us: int) -> None:
        """The receiver had no buffer for queue-0 message ``msn``: rewind to
        it and back off, or fail its WR once ``rnr_retry`` is spent."""
        stats = self.device.stats
        stats["rnr_nack_received"] += 1
        self.rnr_nacks_received += 1
        idx = next((i for i, e in enumerate(self.q0) if e.msn == msn), -1)
        if idx < 0 or idx >= self.q0_cursor and self.q0[idx].sent == 0:
            stats["rnr_nack_stale"] += 1
            return
        retry = int(self.attrs["rnr_retry"])
        if retry != 7 and self.rnr_tries >= retry:  # verbs: 7 means retry forever
            stats["rnr_retry_exceeded"] += 1
            wr = self.q0[idx].wr
            wr.status = W.IBV_WC_RNR_RETRY_EXC_ERR
            wr.done = True
            self.fatal(f"RNR retry count ({retry}) exceeded at MSN {msn}")
            return
        self.rnr_tries += 1
        # Go back to the NACKed message: it and everything after it on queue 0
        # was dropped by the receiver (RHiNET's Modified ACK/NACK).
        for i in range(idx, len(self.q0)):
            e = self.q0[i]
            e.sent = 0
            if e.gather is not None:
                e.gather.rewind()
        self.q0_cursor = idx
        self.rnr_blocked_msn = msn
        backoff_s = max(backoff_us, 10) * 1e-6 * (1 << min(self.rnr_tries - 1, 16))
        self.rnr_until = self.device.now + min(backoff_s, RNR_BACKOFF_MAX_S)
        self.device.rnr_waiting.add(self)

    def on_flow_ack(self, wire_msn: int) -> None:
        """A Modified ACK carried by a DDP message (envelope FLOW_ACK)."""
        if self.state != S.IBV_QPS_ERR:
            self._flow_acked(self._unwrap_msn(wire_msn))

    def _flow_acked(self, msn: int) -> None:
        """Every queue-0 message below ``msn`` was placed: their WRs may complete."""
        q = self.q0
        popped = 0
        while q and q[0].msn < msn and popped < self.q0_cursor:
            e = q.popleft()
            popped += 1
            if e.msn == e.wr.q0_last:
                e.wr.done = True
        self.q0_cursor -= popped
        if self.rnr_blocked_msn >= 0 and (not q or q[0].msn > self.rnr_blocked_msn):
            self.rnr_blocked_msn = -1  # the NACKed message got in: new messages may go
            self.rnr_tries = 0
            self.rnr_until = None

    # -- responses to our Reads and atomics -----------------------------------
    def on_read_response(self, hdr: Any, payload: memoryview, raw: memoryview) -> None:
        """A Read Response segment (the Python path): placed into the sink of
        the Read at the ORRQ head, in order, or a Terminate."""
        n = len(payload)
        rd = self.orrq[0] if self.orrq else None
        if rd is None or hdr.stag != rd.wr.sink_stag or hdr.to != rd.placed or rd.placed + n > rd.size \
                or (hdr.last and rd.placed + n != rd.size):
            # A response we did not ask for, or outside the sink: RFC 5041 §7.2 tagged buffer error.
            if rd is not None:
                rd.wr.status = W.IBV_WC_BAD_RESP_ERR
                rd.wr.done = True
            self.terminate(rdmap.DdpTaggedErrorCode.INVALID_STAG, raw, n, layer=rdmap.TermLayer.DDP,
                           etype=rdmap.DdpErrorType.TAGGED_BUFFER)
            return
        if n:
            rd.gather.scatter(rd.placed, payload)
        rd.placed += n
        if hdr.last:
            self.read_placed()

    def read_placed(self) -> None:
        """The last Read Response of the Read at the ORRQ head is placed: it completes."""
        self.orrq.popleft().wr.done = True

    def read_sink(self) -> PendingRead | None:
        """The Read at the ORRQ head, if the compiled lane can place its
        responses (its sink is one SGE); else None."""
        rd = self.orrq[0] if self.orrq else None
        if type(rd) is not PendingRead or len(rd.gather.pieces) != 1:
            return None
        return rd

    def read_response_placed(self, rd: PendingRead, nbytes: int, ended: bool) -> None:
        """The compiled lane placed ``nbytes`` more of ``rd``'s responses
        (``ended``: its last; ``rd`` is the ORRQ head)."""
        rd.placed += nbytes
        if ended:
            self.read_placed()

    def on_atomic_response(self, msn: int, payload: memoryview, raw: memoryview) -> None:
        """The Atomic Response (message ``msn`` of queue 3) to the atomic at
        the ORRQ head: the Python path's segment or one the compiled lane
        took whole (``raw`` from the DDP header, as for ``on_segment``)."""
        # Where the compiled lane expects the next one.  As for Read
        # Requests, this path holds no response to it: the link delivers in
        # order, and the ORRQ head and request identifier decide.
        self.rx_atomic_resp_msn = (msn + 1) & U32
        rd = self.orrq[0] if self.orrq else None
        try:
            resp = rdmap.decode_atomic_response_untrusted(payload)
        except Exception:
            resp = None
        if type(rd) is not PendingAtomic or resp is None or resp.req_id != rd.req_id:
            if rd is not None:
                rd.wr.status = W.IBV_WC_BAD_RESP_ERR
                rd.wr.done = True
            self.terminate(rdmap.RdmapErrorCode.UNEXPECTED_OPCODE, raw, len(payload),
                           etype=rdmap.RdmapErrorType.REMOTE_OPERATION)
            return
        # The original value lands in host byte order, as an RNIC's DMA leaves it.
        rd.gather.scatter(0, memoryview(resp.orig_value.to_bytes(8, HOST_ORDER)))
        self.orrq.popleft()
        rd.wr.done = True

    # -- Terminate from the peer (RFC 5040 §4.8) -------------------------------
    def on_terminate(self, payload: memoryview) -> None:
        """The peer found a violation in something we sent: fail that WR, then ERR."""
        try:
            t = rdmap.decode_terminate_untrusted(payload)
        except Exception:
            t = rdmap.Terminate(rdmap.TermLayer.RDMAP, rdmap.RdmapErrorType.REMOTE_OPERATION, 0xFF)
        status = terminate_status(t)
        victim = self._find_victim(t)
        if victim is not None:
            victim.status = status
            # In-order processing at the peer: everything before the victim was
            # placed, so it completes normally; everything after it is flushed.
            q = self.outstanding
            while q:
                wr = q.popleft()
                if wr is not victim:
                    wr.done = True
                self._complete(wr)
                if wr is victim:
                    break
        self.fatal(f"received Terminate layer={t.layer} etype={t.etype} ecode={t.ecode:#x}")

    def _find_victim(self, t: rdmap.Terminate) -> OutWR | None:
        """The outstanding WR the peer rejected, from the headers the Terminate copies."""
        if t.rdmap_header:
            try:
                req = rdmap.decode_read_request_untrusted(t.rdmap_header)
            except Exception:
                req = None
            if req is not None:
                for wr in self.outstanding:
                    if wr.sink_stag == req.sink_stag:
                        return wr
        h = t.ddp_header
        if len(h) == rdmap.ddp.TAGGED_HEADER_LEN:
            _, rctl, stag, to = rdmap.ddp.TAGGED.unpack(h)
            if rctl & 0x0F == Opcode.RDMA_WRITE:
                for wr in self.outstanding:
                    if wr.sink_stag < 0 and wr.rkey == stag and wr.raddr <= to <= wr.raddr + wr.byte_len:
                        return wr
        elif len(h) == rdmap.ddp.UNTAGGED_HEADER_LEN:
            _, rctl, _, qn, msn = rdmap.ddp.UNTAGGED.unpack(h)[:5]
            if rctl & 0x0F == Opcode.ATOMIC_REQUEST and qn == rdmap.QueueNumber.READ_REQUEST:
                for wr in self.outstanding:
                    if wr.atomic_msn >= 0 and wr.atomic_msn & U32 == msn:
                        return wr
            # A Send or Immediate Data: the oldest unfinished WR that is not a Read.
            for wr in self.outstanding:
                if wr.sink_stag < 0 and wr.atomic_msn < 0 and not wr.done:
                    return wr
        for wr in self.outstanding:
            if not wr.done:
                return wr
        return None


def terminate_status(t: rdmap.Terminate) -> int:
    """The requester's WC status for a received Terminate (RFC 5040 §4.8 layer/etype)."""
    if t.layer == rdmap.TermLayer.RDMAP:
        if t.etype == rdmap.RdmapErrorType.REMOTE_PROTECTION:
            return W.IBV_WC_REM_ACCESS_ERR
        if t.etype == rdmap.RdmapErrorType.REMOTE_OPERATION:
            return W.IBV_WC_REM_OP_ERR
        return W.IBV_WC_REM_ABORT_ERR
    if t.layer == rdmap.TermLayer.DDP:
        if t.etype == rdmap.DdpErrorType.TAGGED_BUFFER:
            return W.IBV_WC_REM_ACCESS_ERR
        if t.etype == rdmap.DdpErrorType.UNTAGGED_BUFFER and t.ecode == rdmap.DdpUntaggedErrorCode.INVALID_MSN_NO_BUFFER:
            return W.IBV_WC_RNR_RETRY_EXC_ERR
        if t.etype == rdmap.DdpErrorType.UNTAGGED_BUFFER and t.ecode == rdmap.DdpUntaggedErrorCode.MESSAGE_TOO_LONG:
            return W.IBV_WC_REM_INV_REQ_ERR  # verbs: the receive buffer was too small
        return W.IBV_WC_REM_OP_ERR
    return W.IBV_WC_REM_ABORT_ERR
