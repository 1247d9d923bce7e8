"""The receiving half of a link: in-order delivery, SACK state and the ACK policy (sans-IO).

Theory of operation
-------------------
Message ``n`` arrives as wire sequence ``peer_isn + n mod 2**32``.  The
:class:`Receiver` accepts ``n`` in ``[rcv_nxt, rcv_nxt + window)``, where the
window is ``rwnd_packets`` minus what the owner has not drained yet (bounded
memory), delivers in order exactly once and buffers what arrives beyond a
hole.  The out-of-order packets are kept as sorted disjoint ranges
``[start, end)`` above ``rcv_nxt`` (with their starts in a list of their
own, for ``bisect`` on plain ints) and the latest out-of-order arrivals, so
an ACK's SACK blocks (RFC 2018) can name the block holding the latest
arrival first and then the lowest ranges, the holes the sender must fill
first.

What every packet we send tells the peer about this direction is the
receiver's: the cumulative ACK field (``rcv_nxt``), the window we advertise
and the SACK blocks (:meth:`Receiver.feedback`).

ACK policy (RFC 5681 §4.2 / RFC 1122 §4.2.3.2): ACK every ``ack_every``
in-order packets, or after ``max_ack_delay_s``; at once for an out-of-order,
duplicate or out-of-window packet, for a filled hole, and when the sender
set ACK_NOW (it does on the last packet of a burst, so a small message is
not held by the delayed-ACK timer).  The receiver only decides that an ACK
is owed (``ack_now``, ``ack_deadline``); the link sends it, alone or on its
own DATA, and reports which with :meth:`Receiver.ack_sent_alone` or
:meth:`Receiver.ack_carried`.

An ACK the sender asked for with ACK_NOW is held, for at most
``max_ack_delay_s``, while the exchange is a ping-pong: nothing of ours is
in flight, and the last such ACK our own DATA carried within that time (or
could have carried: it left alone and our DATA followed in time).  Held,
the ACK rides on the answer, and neither side spends a datagram and a pass
on an ACK alone.  A hold that runs out sends the ACK and ends the holding
until an answer comes in time again, so a peer whose messages we never
answer waits for an ACK once, not each time (``ack_holds_expired``).  An
answer queued with ``Link.send(ack_carrier=False)`` ends the holding too.
The rule is ``ackhold.py``'s, which a QP's Modified ACK follows as well.
"""

from __future__ import annotations

import bisect

from ..wire import link as wl
from .ackhold import AckHold
from .records import LinkStats
from .recovery import Recovery

_U32 = 0xFFFFFFFF
_HALF = 1 << 31
_ACK_NOW = int(wl.LinkFlags.ACK_NOW)
_RETX = int(wl.LinkFlags.RETRANSMISSION)


class Receiver:
    """Receive state of one link, and whether an ACK is owed.

    Args:
        rwnd_packets: the receive window, in packets (buffered out of order
            plus delivered and not yet drained).
        ack_every: in-order packets that make an ACK due at once.
        max_ack_delay_s: the delayed-ACK time, and the longest an ACK is held.
        recovery: our sender's table; an ACK is held only while nothing of
            ours is in flight.
        stats: the link's counters (``data_received``, ``duplicate``,
            ``out_of_window``).

    Attributes:
        rcv_nxt: the next message number expected in order.
        peer_isn: the peer's initial sequence number (set by the handshake).
        delivered: messages delivered in order and not yet drained.
        ranges: sorted disjoint ``[start, end)`` received above ``rcv_nxt``.
        ack_count: in-order packets received since our last ACK left.
        ack_now: an ACK is due at once.
        ack_deadline: an ACK is due at this time (delayed or held), or None.
        hold: the ACK hold's state (``ackhold.AckHold``).
    """

    __slots__ = ("rwnd_packets", "ack_every", "max_ack_delay_s", "recovery", "stats", "peer_isn", "rcv_nxt", "ooo",
                 "ranges", "starts", "recent", "delivered", "adv_rwnd", "ack_count", "ack_now", "ack_deadline", "hold")

    def __init__(self, rwnd_packets: int, ack_every: int, max_ack_delay_s: float, recovery: Recovery,
                 stats: LinkStats) -> None:
        self.rwnd_packets = rwnd_packets
        self.ack_every = ack_every
        self.max_ack_delay_s = max_ack_delay_s
        self.recovery = recovery
        self.stats = stats
        self.peer_isn = 0
        self.rcv_nxt = 0
        self.ooo: dict[int, bytes] = {}
        self.ranges: list[list[int]] = []
        self.starts: list[int] = []
        self.recent: list[int] = []  # out-of-order arrivals, most recent first (<= MAX_SACK_BLOCKS)
        self.delivered: list[bytes | memoryview] = []
        self.adv_rwnd = rwnd_packets  # the window we last advertised
        self.ack_count = 0
        self.ack_now = False
        self.ack_deadline: float | None = None
        # an ACK_NOW ACK may wait (until ack_deadline too) for our DATA to carry it
        self.hold = AckHold()

    # --- arrivals -------------------------------------------------------------

    def data_received(self, seq: int, flags: int, body: memoryview, now: float) -> None:
        """One DATA packet of wire sequence ``seq`` with ``flags`` and ``body``."""
        stats = self.stats
        rcv_nxt = self.rcv_nxt
        d = (seq - self.peer_isn - rcv_nxt) & _U32
        window = self.rwnd_packets - len(self.delivered)
        if d >= _HALF:
            stats.duplicate += 1  # below rcv_nxt: already delivered
            self.ack_now = True
            return
        if d >= window:
            stats.out_of_window += 1
            self.ack_now = True
            return
        stats.data_received += 1
        if d == 0:
            delivered = self.delivered
            # A view of an immutable datagram is handed on as it is (the
            # common in-order case costs no copy); anything that may change
            # under us is copied.
            delivered.append(body if body.readonly else bytes(body))
            rcv_nxt += 1
            ranges = self.ranges
            if ranges and ranges[0][0] == rcv_nxt:
                # Filled a hole: hand over the run behind it, ACK at once
                # (RFC 5681 §4.2) so the sender learns quickly.
                end = ranges.pop(0)[1]
                del self.starts[0]
                ooo = self.ooo
                for n in range(rcv_nxt, end):
                    delivered.append(ooo.pop(n))
                rcv_nxt = end
                self.ack_now = True
            self.rcv_nxt = rcv_nxt
            self.ack_count += 1
            if self.ack_count >= self.ack_every:
                self.ack_now = True
            elif flags & _ACK_NOW:
                self.ack_asked(flags, now)
            return
        if flags & _ACK_NOW:
            self.ack_now = True
        self._out_of_order(rcv_nxt + d, body)

    def _out_of_order(self, n: int, body: memoryview) -> None:
        """Message ``n``, beyond a hole: buffer it and extend the ranges."""
        ooo = self.ooo
        ranges = self.ranges
        recent = self.recent
        if ranges and ranges[-1][1] == n:
            # Continues the highest run beyond a hole: nothing the sender
            # does not already know (the hole was reported when it opened),
            # so the normal every-`ack_every` rule applies; this halves the
            # ACKs of a lossy bulk transfer.
            ooo[n] = bytes(body)
            ranges[-1][1] = n + 1
            if recent and recent[0] == n - 1:
                recent[0] = n
            else:
                self._note_recent(n)
            self.ack_count += 1
            if self.ack_count >= self.ack_every:
                self.ack_now = True
            return
        self._note_recent(n)
        self.ack_now = True  # out of order: ACK at once with SACK (RFC 5681 §4.2)
        if n in ooo:
            self.stats.duplicate += 1  # a D-SACK-like hint: its block is reported first
            return
        ooo[n] = bytes(body)
        starts = self.starts
        i = bisect.bisect_left(starts, n + 1)  # first range starting after n
        if i and ranges[i - 1][1] == n:
            ranges[i - 1][1] = n + 1
            if i < len(ranges) and starts[i] == n + 1:
                ranges[i - 1][1] = ranges.pop(i)[1]
                del starts[i]
        elif i < len(ranges) and starts[i] == n + 1:
            ranges[i][0] = n
            starts[i] = n
        else:
            ranges.insert(i, [n, n + 1])
            starts.insert(i, n)

    def _note_recent(self, n: int) -> None:
        recent = self.recent
        if n in recent:
            recent.remove(n)
        recent.insert(0, n)
        if len(recent) > wl.MAX_SACK_BLOCKS:
            recent.pop()

    def run_received(self, count: int, flags_any: int, now: float) -> None:
        """``count`` in-order DATA packets the owner took in itself (see
        ``Link.data_run_received``); ``flags_any``: the OR of their flags."""
        self.rcv_nxt += count
        self.ack_count += count
        if self.ack_count >= self.ack_every:
            self.ack_now = True
        elif flags_any & _ACK_NOW:
            self.ack_asked(flags_any, now)

    def ack_asked(self, flags: int, now: float) -> None:
        """In-order DATA with ACK_NOW (``flags``) arrived: ACK at once, or hold
        the ACK for our answer (see the module docstring).  Never held when
        another rule already ACKs at once (a filled hole, say): the hold
        would only count as expired and stop the holding."""
        hold_s = self.max_ack_delay_s
        h = self.hold
        if not self.ack_now and not flags & _RETX and not self.recovery.bytes_in_flight and h.owe(now, hold_s):
            if self.ack_deadline is None or h.until < self.ack_deadline:  # type: ignore[operator]
                self.ack_deadline = h.until
            return
        self.ack_now = True
        h.acking_now(now, hold_s)

    # --- the owner's side -----------------------------------------------------

    def drain(self) -> list[bytes | memoryview]:
        """Messages delivered in order since the last call (see ``Link.drain_received``)."""
        out = self.delivered
        if not out:
            return out
        self.delivered = []
        # If the window we last advertised was small (the sender may be
        # stalled on it), or much has been freed, tell the peer it reopened;
        # otherwise a lost or absent update would stall it until keep-alive.
        if self.adv_rwnd * 4 < self.rwnd_packets or len(out) * 2 >= self.rwnd_packets:
            self.ack_now = True
        return out

    # --- what our packets carry -----------------------------------------------

    def advertise(self) -> int:
        """The window to advertise in a packet about to be built (the room
        left, in packets, at most 0xFFFF), recorded as advertised."""
        w = self.rwnd_packets - len(self.delivered)
        w = 0 if w < 0 else 0xFFFF if w > 0xFFFF else w
        self.adv_rwnd = w
        return w

    def feedback(self) -> tuple[int, int, tuple[tuple[int, int], ...]]:
        """The ACK field, the window to advertise (recorded as advertised,
        as :meth:`advertise` does) and the SACK blocks, for a packet about
        to be built."""
        w = self.rwnd_packets - len(self.delivered)  # advertise(), written out: every burst's path
        w = 0 if w < 0 else 0xFFFF if w > 0xFFFF else w
        self.adv_rwnd = w
        return (self.peer_isn + self.rcv_nxt) & _U32, w, self.sack_blocks() if self.ranges else ()

    def sack_blocks(self) -> tuple[tuple[int, int], ...]:
        """Up to ``MAX_SACK_BLOCKS`` received ranges above ``rcv_nxt``, as wire sequences."""
        # RFC 2018 §4: the first block holds the most recent arrival, the
        # others repeat the most recently reported ranges, so each range is
        # reported in several ACKs and survives ACK loss.  Then the lowest
        # ranges (the holes the sender must fill first).
        ranges = self.ranges
        starts = self.starts
        blocks: list[tuple[int, int]] = []
        seen: list[int] = []
        base = self.peer_isn
        for n in self.recent:
            i = bisect.bisect_right(starts, n) - 1
            if i < 0 or i in seen:
                continue
            r = ranges[i]
            if r[1] <= n:
                continue  # n has since been delivered
            seen.append(i)
            blocks.append(((base + r[0]) & _U32, (base + r[1]) & _U32))
        i = 0
        while len(blocks) < wl.MAX_SACK_BLOCKS and i < len(ranges):
            if i not in seen:
                r = ranges[i]
                blocks.append(((base + r[0]) & _U32, (base + r[1]) & _U32))
            i += 1
        return tuple(blocks)

    # --- the ACK leaves -------------------------------------------------------

    def ack_carried(self, now: float, poor_carrier: bool) -> None:
        """Our DATA left, carrying the ACK: nothing is owed any more, and a
        held ACK was carried (or, ``poor_carrier``, such answers are no use
        for holding, see ``Link.send``)."""
        self.ack_count = 0
        self.ack_now = False
        self.ack_deadline = None
        hold = self.hold
        if poor_carrier:
            hold.stop()
        else:
            hold.answered(now, hold.until is not None)  # a held ACK: carried, as hoped

    def ack_sent_alone(self) -> bool:
        """An ACK left in a packet of its own.  Returns True if it was held
        for our answer, which did not come in time: ACK at once from now on,
        until an answer comes in time again."""
        self.ack_count = 0
        self.ack_now = False
        self.ack_deadline = None
        if self.hold.until is None:
            return False
        self.hold.stop()
        return True

    def arm_delayed_ack(self, now: float) -> None:
        """Nothing left now: in-order packets not yet ACKed start the
        delayed-ACK timer (RFC 1122 §4.2.3.2)."""
        if self.ack_count and self.ack_deadline is None:
            self.ack_deadline = now + self.max_ack_delay_s
