"""Queue pairs: the RDMAP engine (RFC 5040) of the emulated RNIC, one QP at a time.

Theory of operation
-------------------
A ``QueuePair`` owns its SQ and RQ rings (shared memory, ``wire/shm.py``),
its attributes and state, and the two read queues of the ExpEther RNIC: the
ORRQ (Read Requests and atomics this QP sent, waiting for their responses)
and the IRRQ (requests the peer sent, whose answers this QP still has to
send).  Its engine is split by role, as rdma-core's rxe splits its own:

- ``requester.py`` (rxe_req.c): send WQEs taken off the SQ and cut into DDP
  segments on the QP's peer link;
- ``responder.py`` (rxe_resp.c): segments from the peer checked and placed,
  requests answered, receives completed, Modified ACK/NACK sent;
- ``completer.py`` (rxe_comp.c): the peer's answers to our requests, its
  Modified ACKs and NACKs, Terminates, and the CQEs of our send WRs.

Every role works on the state kept here; each initializes its own part
(``reset_requester``, ``reset_responder``).  The QP reaches the rest of the
daemon only through its :class:`~udpverbs.daemon.ports.QPHost` (the STag
table, counters, the pass's time, the scheduler's "visit me") and its
:class:`~udpverbs.daemon.peer.PeerLink` (what it sends).

``pump`` is what the device's scheduler calls for a QP's turn: the peer's
answers first, then the requester's messages, then the flow control owed.
ERR is sticky: every outstanding and later-posted WR completes with
IBV_WC_WR_FLUSH_ERR (send and receive queues alike).
"""

from __future__ import annotations

import logging
from typing import Any

from ..wire import shm
from ..wire.shm import EventType, QPState as S, WcOpcode, WcStatus as W
from . import tables
from .completer import Completer
from .cq import CompletionQueue, SharedReceiveQueue, release_segment
from .opcodes import wc_opcode
from .peer import PeerLink
from .ports import QPHost
from .requester import Requester
from .responder import Responder
from .txbatch import TxBatch

log = logging.getLogger("udpverbs.daemon")


class QueuePair(Requester, TxBatch, Responder, Completer):
    """One RC queue pair: rings, attributes, state, and the RDMAP engine."""

    def __init__(self, device: QPHost, qpn: int, session: Any, pd: tables.ProtectionDomain,
                 send_cq: CompletionQueue, recv_cq: CompletionQueue, caps: dict[str, int],
                 sq_sig_all: bool, srq: SharedReceiveQueue | None = None) -> None:
        self.device = device
        self.qpn = qpn
        self.session = session
        self.pd = pd
        self.send_cq = send_cq
        self.recv_cq = recv_cq
        self.caps = caps
        self.sq_sig_all = sq_sig_all
        layout = shm.QPLayout(shm.round_entries(caps["max_send_wr"]), shm.round_entries(caps["max_recv_wr"]))
        self.layout = layout
        self.fd, self.mm = shm.new_segment(layout.size, "uv-qp")
        self.sq = shm.Ring(self.mm, layout.sq_offset, "struct uv_send_wqe", layout.sq_entries, init=True)
        self.rq = shm.Ring(self.mm, layout.rq_offset, "struct uv_recv_wqe", layout.rq_entries, init=True)
        self.srq = srq
        # Where receives come from: the QP's own RQ, or its SRQ (then the RQ stays empty).
        self.recv_ring = srq.ring if srq is not None else self.rq
        self.max_recv_sge = srq.max_sge if srq is not None else caps["max_recv_sge"]
        self.state = S.IBV_QPS_RESET
        self.attrs: dict[str, Any] = {
            "qp_access_flags": 0, "pkey_index": 0, "port_num": 1, "path_mtu": 5, "timeout": 14,
            "retry_cnt": 7, "rnr_retry": 7, "min_rnr_timer": 0, "rq_psn": 0, "sq_psn": 0,
            "max_rd_atomic": 1, "max_dest_rd_atomic": 1, "dest_qp_num": 0, "dlid": 0,
            "dgid": bytes(16), "sq_draining": 0,
        }
        self.link: PeerLink | None = None
        self.dest_qpn = 0
        self.rank = 0  # place in the device's QP table (the order in which a pass visits QPs)
        # receiver-not-ready NACKs over the QP's life (the tools show them)
        self.rnr_nacks_received = 0
        self.rnr_nacks_sent = 0
        self._txb = None  # the batch take's scratch (txbatch.py), made on first use
        self._atake = None  # the atomic take's scratch (atombatch.py), made on first use
        self._rtake = None  # the Read take's scratch (readbatch.py), made on first use
        self.reset_requester()
        self.reset_responder()

    # -- control path -------------------------------------------------------
    @property
    def ord(self) -> int:
        """Outstanding Reads and atomics this QP may have (max_rd_atomic, at least 1)."""
        return max(1, int(self.attrs["max_rd_atomic"]))

    @property
    def ird(self) -> int:
        """Incoming Reads and atomics this QP answers at once (max_dest_rd_atomic, at least 1)."""
        return max(1, int(self.attrs["max_dest_rd_atomic"]))

    def set_state(self, new: int) -> None:
        """Enter ``new`` (already validated): RESET discards, ERR flushes."""
        old = self.state
        self.state = new
        self.device.qp_changed(self)
        if new == S.IBV_QPS_RESET:
            # Discard whatever is queued: RESET empties both work queues.
            try:
                self.sq.pop(self.sq.available())
                self.rq.pop(self.rq.available())
            except shm.RingError:
                pass
            self.reset_requester()
            self.reset_responder()
            self.device.detach_link(self)
        elif new == S.IBV_QPS_ERR and old != S.IBV_QPS_ERR:
            self.flush()

    def fatal(self, reason: str, event: int = EventType.IBV_EVENT_QP_FATAL) -> None:
        """Move to ERR after a protocol or local error; tell the app asynchronously."""
        if self.state == S.IBV_QPS_ERR:
            return
        pl = self.link
        peer = f"{pl.addr[0]}:{pl.addr[1]} qp {self.dest_qpn}" if pl is not None else "none"
        log.info("qp %d of pid %d -> ERR (peer %s): %s", self.qpn, self.session.pid, peer, reason)
        self.set_state(S.IBV_QPS_ERR)
        self.session.async_event(event, self.qpn)

    def uses_view(self, view: memoryview) -> bool:
        """True if an in-flight WR or Read Response references ``view`` (an MR's mapping)."""
        if self.sending is not None and any(p[0] is view for p in self.sending.gather.pieces):
            return True
        if any(p[0] is view for m in self.q0 if m.gather is not None for p in m.gather.pieces):
            return True
        if any(p[0] is view for rd in self.orrq for p in rd.gather.pieces):
            return True
        return any(r.view is view for r in self.irrq)

    def close(self) -> None:
        """Release the rings' shared memory (the QP is out of every table)."""
        self.fd = release_segment(self.fd, self.mm, self.sq, self.rq)

    # -- ERR --------------------------------------------------------------------
    def flush(self) -> None:
        """Complete everything outstanding and queued with IBV_WC_WR_FLUSH_ERR."""
        self.complete_all()
        self.sending = None
        self.q0.clear()
        self.q0_cursor = 0
        self.rnr_until = None
        self.rnr_blocked_msn = -1
        if self.rx_recv is not None:  # a receive half filled by a Send
            self.recv_cq.push(self.rx_recv[0], W.IBV_WC_WR_FLUSH_ERR, WcOpcode.IBV_WC_RECV, 0, self.qpn,
                              self.dest_qpn)
            self.rx_recv = None
        self.orrq.clear()
        self.irrq.clear()
        self.flush_rings()

    def flush_rings(self) -> bool:
        """In ERR: complete newly posted WQEs with FLUSH_ERR.  Returns True if any."""
        did = False
        try:
            n = self.sq.available()
        except shm.RingError:
            n = 0
        for i in range(n):
            w = self.sq.peek(i)
            self.send_cq.push(w.wr_id, W.IBV_WC_WR_FLUSH_ERR, wc_opcode(w.opcode), 0, self.qpn, self.dest_qpn)
        if n:
            self.sq.pop(n)
            did = True
        try:
            n = self.rq.available()
        except shm.RingError:
            n = 0
        for i in range(n):
            w = self.rq.peek(i)
            self.recv_cq.push(w.wr_id, W.IBV_WC_WR_FLUSH_ERR, WcOpcode.IBV_WC_RECV, 0, self.qpn, self.dest_qpn)
        if n:
            self.rq.pop(n)
            did = True
        return did

    # -- a turn --------------------------------------------------------------------
    def pump(self, budget: int, start: bool = True) -> int:
        """Queue up to ``budget`` messages on the link; return how many were
        queued.  ``start=False``: take no new WQE (finish what is under way)."""
        link = self.link
        if link is None or not link.up:
            return 0
        if not self.has_send_work() and self.sq.hdr.producer == self.sq.cons:
            return 0  # nothing to send
        if not link.link.send_space() and not self.flow_ack_due and not self.rx_rnr:
            # The link takes nothing more this pass (another QP filled it) and
            # no flow-control message is owed: with many QPs streaming, going
            # further for each one cost more than their datagrams.
            return 0
        try:
            return self.pump_messages(link, budget, start)
        finally:
            # After our own messages: a flow message is shorter than any
            # segment, so it ends their UDP_SEGMENT run and leaves in the same
            # system call (a Send ping-pong sends both every time).  In a
            # finally: receives already completed here must be ACKed even if
            # this QP's send side fails now.
            self.send_flow_control()

    def has_send_work(self) -> bool:
        """Something to send besides new WQEs: responses, a Write or Send in
        progress, flow control owed (the device pumps such a QP every pass)."""
        return bool(self.irrq or self.sending is not None or self.q0_cursor < len(self.q0) or self.flow_ack_due
                    or (self.rx_rnr and not self.rx_resume_sent))
