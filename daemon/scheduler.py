"""The QP scheduler: which QPs a pass of the data loop visits, and in what order.

Theory of operation
-------------------
A pass does not walk every QP (with 64 QPs that walk was half of a
receiving daemon's pass).  For completions it visits the QPs a message or
an ACK concerned (``to_complete``).  For sending, each QP waits in one
place:

- idle, in the SQ watch (:class:`SQWatch`): looked at only for a moved SQ
  producer index, all of them in one compiled call where there are many;
- ready, on its link's line (``PeerLink.ready``): data to send, served
  round robin while the link has room, one RDMA Write per turn, so each
  Write's segments leave in one run and no QP holds the link for more;
- in ``to_pump``: visited on every pass in table order (``rank``) until it
  settles, because something happened to it (a message, a state change),
  or it is in ERR (new WQEs to flush) or owes a RESUME (its RQ is watched).

After every visit :meth:`QPScheduler.settle` puts the QP where it waits
next.  A QP that a message just reached may answer at once: if its
application has posted the answer by the time the pass gets there, it is
pumped early (:meth:`QPScheduler.answer_early`), and in a ping-pong the
answer then carries this pass's ACK.

A failure inside the engine ends that QP (QP fatal), never the daemon.
"""

from __future__ import annotations

import collections
import logging
import operator
from typing import Any

from ..wire import shm
from .opcodes import ERR, RTS

log = logging.getLogger("udpverbs.daemon")

#: messages one QP's turn may queue in a pass.  The link's send space bounds
#: a pass's total and the ready line's rotation shares it between QPs; this
#: bounds one turn's Python (a QP of 2-byte Writes takes a WQE per message)
#: without cutting a single QP's 1472-byte stream into small passes, whose
#: fixed costs would then weigh on each datagram.
TURN_BUDGET = 256
#: word of struct uv_ring_hdr holding the consumer index (the producer's is word 0)
_CONSUMER_WORD = shm.ffi.offsetof("struct uv_ring_hdr", "consumer") // 4
#: watching this many QPs or fewer, a Python step per QP is cheaper than the
#: compiled call's set-up
_PY_WATCH_MAX = 4
_BY_RANK = operator.attrgetter("rank")
_RNR_UNTIL = operator.attrgetter("rnr_until")
_FLOW_ACK_HOLD = operator.attrgetter("flow_hold.until")


class QPTable(dict):  # type: ignore[type-arg]
    """The device's QPN -> QueuePair table, which counts its changes.

    The data loop does not walk the table on each pass; it keeps its own
    lists and rebuilds them when ``version`` moves.
    """

    def __init__(self) -> None:
        super().__init__()
        self.version = 0

    def __setitem__(self, key: int, value: Any) -> None:
        super().__setitem__(key, value)
        self.version += 1

    def __delitem__(self, key: int) -> None:
        super().__delitem__(key)
        self.version += 1

    def pop(self, key: int, *default: Any) -> Any:
        self.version += 1
        return super().pop(key, *default)

    def clear(self) -> None:
        self.version += 1
        super().clear()


class SQWatch:
    """The idle QPs of a pass: looked at only for a moved SQ producer index.

    ``qps`` is the device's QP table in order (a QP's ``rank`` is its place).
    With the compiled module one call compares the ring headers of all
    watched QPs (a mask says which); without it, or for a handful, a Python
    step per QP.  Built anew whenever the table changes: it holds raw
    pointers into the QPs' rings, which a destroyed QP unmaps.
    """

    def __init__(self, qps: list[Any], native: Any) -> None:
        self.qps = qps
        self.members: dict[Any, tuple[Any, shm.Ring]] = {}  # QP: (its SQ's header, its SQ)
        self._lib = None
        if native is not None and qps:
            ffi = native.ffi
            self._hdrs = ffi.new("uint32_t *[]", [
                ffi.cast("uint32_t *", int(shm.ffi.cast("uintptr_t", qp.sq.hdr))) for qp in qps])
            self._mask = ffi.new("uint8_t[]", len(qps))
            self._found = ffi.new("uint32_t[]", len(qps))
            self._lib = native.lib

    def __contains__(self, qp: Any) -> bool:
        return qp in self.members

    def add(self, qp: Any) -> None:
        """Watch ``qp`` (it is idle)."""
        self.members[qp] = (qp.sq.hdr, qp.sq)
        if self._lib is not None:
            self._mask[qp.rank] = 1

    def discard(self, qp: Any) -> None:
        """Stop watching ``qp`` (if it was watched)."""
        if qp in self.members:
            del self.members[qp]
            if self._lib is not None:
                self._mask[qp.rank] = 0

    def take_posted(self) -> list[Any]:
        """The watched QPs with new WQEs, in table order, no longer watched."""
        if not self.members:
            return []
        if self._lib is not None and len(self.members) > _PY_WATCH_MAX:
            k = self._lib.udpv_rings_moved(self._hdrs, self._mask, len(self.qps), _CONSUMER_WORD, self._found)
            if not k:
                return []
            found = [self.qps[i] for i in self._found[0:k]]
        else:
            found = [qp for qp, (hdr, sq) in self.members.items() if hdr.producer != sq.cons]
            if not found:
                return found
            if len(found) > 1:
                found.sort(key=_BY_RANK)
        for qp in found:
            self.discard(qp)
        return found


class QPScheduler:
    """Where each QP waits for its next visit, and the pass's QP steps (see the module docstring)."""

    def __init__(self, qps: QPTable, native: Any, stats: collections.Counter[str]) -> None:
        self.qps = qps
        self.native = native
        self.stats = stats
        self.seen = -1  # the QP table's version the places were built for
        self.watch = SQWatch([], None)
        self.to_complete: dict[Any, None] = {}
        self.to_pump: dict[Any, None] = {}
        self.prefetch: list[Any] = []  # QPs whose next receive to resolve once the pass's sends left
        #: a message reached a QP since the pass last yielded to applications
        self.delivered = False
        #: the QP this pass last delivered to, whose application may answer
        #: before the pass reaches the SQ watch (``answer_early``)
        self.delivered_to: Any = None
        self.rnr_waiting: set[Any] = set()  # QPs backing off after an RNR NACK
        self.flow_ack_holding: set[Any] = set()  # QPs holding a Modified ACK for their answer

    # -- places -------------------------------------------------------------------
    def rebuild(self, links: dict[Any, Any]) -> None:
        """A QP came or went: forget where QPs wait, and visit each once."""
        qps = list(self.qps.values())
        for i, qp in enumerate(qps):
            qp.rank = i
        for pl in links.values():
            pl.ready.clear()
        self.watch = SQWatch(qps, self.native)
        self.to_complete = dict.fromkeys(qps)
        self.to_pump = dict.fromkeys(qps)
        self.seen = self.qps.version

    def qp_changed(self, qp: Any) -> None:
        """``qp`` may have WRs to complete or something to send: the next
        pass visits it.  Called on a state change and on every message for
        it; a QP not named here is visited only for new WQEs or its ACKs."""
        self.to_complete[qp] = None
        self.to_pump[qp] = None
        self.watch.discard(qp)

    def settle(self, qp: Any) -> None:
        """Put ``qp``, just visited, where it waits for its next visit."""
        # In ERR, new WQEs (SQ or RQ) are to be flushed; owing a RESUME, the
        # RQ is watched for a receive: either way, every pass.
        every_pass = qp.state == ERR or (qp.rx_rnr and not qp.rx_resume_sent)
        pl = qp.link
        ready = pl is not None and qp.state != ERR and (qp.has_send_work() or qp.sq.hdr.producer != qp.sq.cons)
        if ready:
            pl.ready[qp] = None  # keeps its place if it is already in line
        elif pl is not None:
            pl.ready.pop(qp, None)
        if every_pass:
            self.to_pump[qp] = None
        elif not ready:
            # Idle: out of the every-pass set too (it may have been put
            # there earlier in this pass, before this visit found it done).
            self.to_pump.pop(qp, None)
            self.watch.add(qp)

    # -- a QP's turn ---------------------------------------------------------------------
    def pump(self, qp: Any, start: bool = True) -> bool:
        """Let ``qp`` queue what it has (``start``: new WQEs too); True if it queued anything."""
        try:
            sent = qp.pump(TURN_BUDGET, start)
        except Exception:  # an engine bug ends this QP, never the daemon
            self.qp_failed(qp)
            return True
        if sent and qp.q0 and qp.rx_recv is None and self.native is None:
            # Our Sends are out: the peer's may answer them, into our next receive
            self.prefetch.append(qp)
        return bool(sent)

    def qp_failed(self, qp: Any) -> None:
        """An exception inside ``qp``'s engine: log it and move the QP to ERR."""
        self.stats["qp_exception"] += 1
        log.exception("QP %d failed", qp.qpn)
        qp.fatal("internal error")

    def complete_done(self, qp: Any) -> None:
        """Retire the WRs at the head of ``qp``'s SQ that a response has
        just completed (a Read's, an atomic's), as soon as it is taken,
        and before the link accounts for the lane's run: the application
        waits on their CQEs.  Only WRs marked done: what an ACK retires
        waits for the completion step of the pass, so the lane and the
        Python path, whose ACK processing comes at different points,
        retire everything at the same points."""
        try:
            if qp.outstanding:
                qp.complete_acked(-1)
        except Exception:  # an engine bug ends this QP, never the daemon
            self.qp_failed(qp)

    def answer_early(self, qp: Any) -> bool:
        """Take the answer to what this pass delivered to ``qp`` as soon as
        the application has posted it, not when the pass reaches the SQ
        watch; False if nothing is posted yet (the caller looks again later).

        In a ping-pong the application sees the data (or the CQE) at once and
        posts its answer while this pass goes on with the ACK the message
        carried, the links' timers and the completions; the pass looks here
        between those steps, and at its end for an answer posted after the
        SQ watch.  Only a QP on a link where no other QP waits its turn
        (anything else keeps its order), and either watched (nothing of it
        pending) or due a visit this pass for what was just delivered to
        it (a Send leaves it owing a Modified ACK, a response completed a
        Read or an atomic) with at most one WR outstanding, a ping-pong's:
        the answer carries that ACK.  A stream's QP (an ORD window of
        atomics) keeps its new WQEs for the pump, after the completions:
        taken here they would split the pass's batch.
        """
        sq = qp.sq
        if sq.hdr.producer == sq.cons:
            return False
        pl = qp.link
        if pl is not None and not pl.ready and qp.state == RTS and (
                qp in self.watch or qp in self.to_pump and len(qp.outstanding) <= 1):
            self.watch.discard(qp)
            self.to_pump.pop(qp, None)
            self.stats["answered_early"] += 1
            self.pump(qp)
            self.settle(qp)
        return True

    # -- the pass's QP steps ---------------------------------------------------------
    def complete(self) -> bool:
        """Retire the WRs the link acknowledged or responses completed, on
        the QPs that need a look (``to_complete``); True if anything reached
        an application (placed data, a CQE) since the last call
        (``delivered``)."""
        delivered = self.delivered
        to_complete = self.to_complete
        if to_complete:
            self.to_complete = {}
            for qp in sorted(to_complete, key=_BY_RANK):
                # Completions first: they only need what this pass received.
                if qp.outstanding and qp.link is not None:
                    try:
                        if qp.complete_acked(qp.link.link.acked):
                            delivered = True
                    except Exception:  # an engine bug ends this QP, never the daemon
                        self.qp_failed(qp)
        if delivered:
            self.delivered = False
        return delivered

    def pump_all(self, links: dict[Any, Any]) -> bool:
        """Let QPs queue segments: those posted to or due a visit, then each
        link's ready line in turns while the link takes more; True if any
        did something."""
        to_pump = self.to_pump
        for qp in self.watch.take_posted():
            if qp.link is not None:
                qp.link.ready[qp] = None
            else:
                to_pump[qp] = None
        progress = False
        if to_pump:
            for qp in sorted(to_pump, key=_BY_RANK):
                del to_pump[qp]
                if qp.state == ERR:
                    if qp.flush_rings():
                        progress = True
                elif qp.link is not None and self.pump(qp):
                    progress = True
                self.settle(qp)
        for pl in list(links.values()):
            ready = pl.ready
            if not ready:
                continue
            # Turns of the QPs on the link's ready line while the link takes more.
            link = pl.link
            for qp in list(ready):
                if not link.send_space():
                    break  # the rest wait their turn, in order
                # A turn: the Write under way, if any, is finished and nothing
                # new is taken; else new WQEs are taken and the last one taken
                # is finished on the next passes.  So each Write's segments
                # leave in one run (the peer's compiled lane places a run per
                # QP) and no QP holds the link for more.
                if self.pump(qp, start=qp.sending is None):
                    progress = True
                if qp.sending is not None and qp.state != ERR:
                    continue  # keeps its turn
                del ready[qp]
                self.settle(qp)  # back at the end of the line if it has more
        return progress

    def prefetch_receives(self) -> None:
        """Resolve ahead the receives of the QPs whose Sends this pass sent."""
        if self.prefetch:
            prefetch, self.prefetch = self.prefetch, []
            for qp in prefetch:
                try:
                    qp.prefetch_receive()
                except Exception:  # an engine bug ends this QP, never the daemon
                    self.qp_failed(qp)

    def deadline(self, t: float) -> float:
        """``t``, or the earlier deadline of a QP's own: a back-off after an
        RNR NACK, a held Modified ACK (QPs with none left are forgotten)."""
        for waiting, until in ((self.rnr_waiting, _RNR_UNTIL), (self.flow_ack_holding, _FLOW_ACK_HOLD)):
            for qp in list(waiting):
                d = until(qp)
                if d is None or qp.state == ERR or self.qps.get(qp.qpn) is not qp:
                    waiting.discard(qp)
                elif d < t:
                    t = d
        return t

    def check(self) -> None:
        """Raise AssertionError if the last pass left a QP where no later
        pass would find its work: a completable WR nobody will complete,
        something to send while it sits idle, or in no place at all.  It
        walks every QP: a debugging aid (``UDPVERBS_CHECK_PASSES=1``)."""
        for qp in self.qps.values():
            on_link = qp.link is not None and qp in qp.link.ready
            places = (qp in self.watch) + (qp in self.to_pump) + on_link
            assert places, f"QP {qp.qpn} waits nowhere"
            assert qp not in self.watch or places == 1, f"QP {qp.qpn} is both idle and busy"
            if qp.link is None:
                continue
            if qp.has_send_work():
                assert qp in self.to_pump or on_link, f"QP {qp.qpn} idle with work to send"
            if qp.outstanding and qp not in self.to_complete:
                wr = qp.outstanding[0]
                assert not (wr.done or 0 <= wr.last_n < qp.link.link.acked), \
                    f"QP {qp.qpn} left out with WR {wr.wr_id} to complete"
