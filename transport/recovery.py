"""Loss recovery: RTT estimation, the sent-packet table, loss detection, RTO.

Theory of operation
-------------------
Every upper-layer message has a number ``n`` (0, 1, 2, ...; the wire sequence
number is ``isn + n`` modulo 2**32).  :class:`Recovery` keeps the messages the
peer has not cumulatively acknowledged, and for those in flight the
*transmission id* of their latest transmission: a counter that grows with
every packet sent, first sends and retransmissions alike (QUIC's packet
number, RFC 9002 §2, carried only in our memory) and the time it left.
Loss detection is RACK (RFC 8985 §6), on transmission ids and send times:
a packet is lost when one sent after it has been delivered (acknowledged
cumulatively or by a SACK block, RFC 2018) and it is still missing a
reordering window later: ``sent + RACK.rtt + reo_wnd <= now``, where
RACK.rtt is the round trip of that later packet.  Until the path has shown
reordering, QUIC's packet threshold (RFC 9002 §6.1.1) also holds: one sent
``reorder_threshold`` transmissions later was delivered.  A packet that
must still wait sets ``reorder_deadline``, when the link looks again.
Because a transmission is what is compared, a lost *retransmission* is
found the same way, without waiting for the RTO; a retransmission's
delivery counts once it came at least the minimum RTT after it left
(sooner, it was the original's: RFC 8985 §6.2 step 2, and a spurious
retransmission, which widens the reordering window).

The reordering window (RFC 8985 §6.2): zero while no reordering was seen
and the sender is in a recovery episode or ``reorder_threshold`` packets
are SACKed; otherwise a quarter of the minimum RTT, times a multiplier that
each round trip with a spurious retransmission raises and 16 episodes
without one reset, at most SRTT.  Reordering is seen when a packet is
delivered after one sent later than it (and neither was a retransmission).

The send-order queue is scanned only from its head and stale entries are
dropped lazily, so an ACK costs O(newly acknowledged + newly lost), never a
scan of the whole window.  Runs (a run of messages queued in one buffer, a
run of first transmissions sent in one go) are one entry each, so for a
stream of runs an ACK costs O(runs), not O(packets).

:class:`RttEstimator` is RFC 6298 §2: SRTT, RTTVAR, RTO clamped to
``[min_rto_s, max_rto_s]``; back-off (RFC 6298 §5.5) is kept by the link.
"""

from __future__ import annotations

from collections import deque
from typing import Any

INF = float("inf")


class RttEstimator:
    """RFC 6298 smoothed RTT and retransmission timeout."""

    __slots__ = ("srtt_s", "rttvar_s", "latest_s", "min_s", "rto_s", "min_rto_s", "max_rto_s")

    def __init__(self, initial_rto_s: float, min_rto_s: float, max_rto_s: float) -> None:
        self.srtt_s: float | None = None
        self.rttvar_s = 0.0
        self.latest_s = 0.0
        self.min_s = float("inf")
        self.rto_s = initial_rto_s  # RFC 6298 §2.1: before any sample
        self.min_rto_s = min_rto_s
        self.max_rto_s = max_rto_s

    def update(self, rtt_s: float) -> None:
        """Feed one RTT sample (seconds)."""
        self.latest_s = rtt_s
        if rtt_s < self.min_s:
            self.min_s = rtt_s
        srtt = self.srtt_s
        if srtt is None:
            srtt = rtt_s  # RFC 6298 §2.2
            self.rttvar_s = rtt_s / 2
        else:
            # RFC 6298 §2.3, alpha = 1/8, beta = 1/4
            self.rttvar_s = 0.75 * self.rttvar_s + 0.25 * abs(srtt - rtt_s)
            srtt = 0.875 * srtt + 0.125 * rtt_s
        self.srtt_s = srtt
        rto = srtt + 4 * self.rttvar_s
        self.rto_s = self.min_rto_s if rto < self.min_rto_s else self.max_rto_s if rto > self.max_rto_s else rto


class Recovery:
    """The sender's table of unacknowledged messages and its loss detector.

    A stream's packets mostly come in runs: a message run queued at once
    (``add_run``, the send lane's bodies) and sent at once (``on_sent_run``,
    the framer), with consecutive transmission ids.  Such runs are kept as
    runs, so queuing, sending and acknowledging one costs the same whatever
    its length; SACK blocks and losses split them.  Everything else is kept
    per packet, as in the per-packet model ``tests/transport/recovery_model.py``
    against which this class is checked operation by operation.

    Attributes:
        messages: n -> payload of the messages queued one by one (``add``)
            and not cumulatively acknowledged; :meth:`message` reads runs too.
        una: lowest unacknowledged message number (the link's ``acked``).
        inflight: n -> (transmission id, size, id credited on delivery or -1
            for a retransmission, time sent) for packets in flight sent one
            by one (``on_sent``);
            :meth:`in_flight` adds the runs'.
        sacked: message numbers above ``una`` the peer reported by SACK.
        lost: message numbers to retransmit, oldest first (may hold stale
            entries; :meth:`next_lost` skips them).
        bytes_in_flight: sum of sizes of the packets in flight.
    """

    __slots__ = ("messages", "una", "inflight", "sacked", "lost", "bytes_in_flight", "_runs", "_spans",
                 "_order", "_tx_next", "_sack_from_start", "_sack_from_end", "max_delivered_tx", "reorder_threshold",
                 "rtt", "rack_rtt", "reordering_seen", "reo_mult", "_reo_persist", "_reo_round_tx", "recovery_point",
                 "reorder_deadline", "spurious")

    def __init__(self, reorder_threshold: int = 3, rtt: RttEstimator | None = None) -> None:
        self.messages: dict[int, bytes | bytearray | memoryview] = {}
        # payload runs, by n: [first n not acknowledged, end, buffer, stride,
        # last message's length, the run's first n]
        self._runs: deque[list[Any]] = deque()
        self.una = 0
        self.inflight: dict[int, tuple[int, int, int, float]] = {}
        # packets in flight sent as runs, by n and so by transmission id:
        # [first n, end, its transmission id, size, the last one's size, time sent];
        # never a packet also in ``inflight`` (a retransmission goes there)
        self._spans: list[list[Any]] = []
        self.sacked: set[int] = set()
        self.lost: deque[int] = deque()
        self.bytes_in_flight = 0
        self._order: deque[tuple[int, int]] = deque()  # (tx id, n) of ``inflight``, send order
        self._tx_next = 0
        self._sack_from_start: dict[int, int] = {}  # block start -> end already applied
        self._sack_from_end: dict[int, int] = {}  # block end -> start already applied
        self.max_delivered_tx = -1
        self.reorder_threshold = reorder_threshold
        # RACK (RFC 8985): the link's RTT estimator (its time rule waits for
        # a sample), the round trip of the latest-sent packet delivered
        self.rtt = rtt if rtt is not None else RttEstimator(1.0, 0.0, 1.0)
        self.rack_rtt = 0.0
        self.reordering_seen = False
        self.reo_mult = 1
        self._reo_persist = 0
        self._reo_round_tx = -1  # the multiplier grows once per round trip
        #: the recovery episode lasts while ``una`` is below this (RFC 6675's RecoveryPoint; the link sets it)
        self.recovery_point = 0
        #: when a packet not yet lost by the time rule will be (the link's reorder timer), or None
        self.reorder_deadline: float | None = None
        self.spurious = 0  #: retransmissions found unneeded: delivered sooner than a round trip after they left

    # -- payloads ----------------------------------------------------------
    def add(self, n: int, payload: bytes | bytearray | memoryview) -> None:
        """Message ``n`` is queued with ``payload``."""
        self.messages[n] = payload

    def add_run(self, n: int, count: int, buf: memoryview, stride: int, last_len: int, head: int = 0,
                slot: int | None = None) -> None:
        """Messages ``n`` .. ``n + count - 1`` are queued in ``buf``, ``stride``
        bytes long but the last (``last_len``), the first at ``head`` and the
        next ``slot`` bytes apart (default ``stride``: back to back)."""
        self._runs.append([n, n + count, buf, stride, last_len, n, head, stride if slot is None else slot])

    def message(self, n: int) -> bytes | bytearray | memoryview:
        """The payload of queued message ``n``.  Raises KeyError if there is none."""
        m = self.messages.get(n)
        if m is not None:
            return m
        for start, end, buf, stride, last_len, first, head, slot in self._runs:
            if start <= n < end:
                at = head + (n - first) * slot
                return buf[at:at + (last_len if n == end - 1 else stride)]
        raise KeyError(n)

    def queued(self) -> set[int]:
        """Numbers of the messages whose payload is kept (for tests and checks)."""
        out = set(self.messages)
        for r in self._runs:
            out.update(range(r[0], r[1]))
        return out

    def _drop_payloads(self, n: int, cum: int) -> None:
        # Messages n .. cum - 1 are acknowledged: runs shrink or go, messages
        # queued one by one (between runs) are deleted.
        runs = self._runs
        messages = self.messages
        while n < cum:
            if runs and runs[0][0] <= n:
                r = runs[0]
                if r[1] <= cum:
                    n = r[1]
                    runs.popleft()
                else:
                    r[0] = n = cum
            else:
                stop = runs[0][0] if runs and runs[0][0] < cum else cum
                for k in range(n, stop):
                    del messages[k]
                n = stop

    # -- packets in flight -------------------------------------------------
    def has_inflight(self) -> bool:
        """True if any packet is in flight."""
        return bool(self.inflight or self._spans)

    def in_flight(self) -> dict[int, tuple[int, int, int, float]]:
        """n -> (transmission id, size, id credited, time sent) of every packet in flight."""
        out = dict(self.inflight)
        for n0, n1, tx0, size, last_size, t in self._spans:
            for n in range(n0, n1):
                tx = tx0 + n - n0
                out[n] = (tx, last_size if n == n1 - 1 else size, tx, t)
        return out

    def on_sent(self, n: int, size: int, retransmission: bool = False, now: float = 0.0) -> None:
        """Message ``n`` left in a packet of ``size`` bytes at ``now``."""
        tx = self._tx_next
        self._tx_next = tx + 1
        # An ACK for a retransmitted message is ambiguous (which copy
        # arrived?  Karn's problem): crediting the newest transmission when a
        # late original arrived would declare everything sent in between lost.
        # So a retransmission's delivery is credited only when it cannot be
        # the original's (``_retx_credit``).
        self.inflight[n] = (tx, size, -1 if retransmission else tx, now)
        self._order.append((tx, n))
        self.bytes_in_flight += size

    def on_sent_run(self, n: int, count: int, size: int, last_size: int, now: float = 0.0) -> None:
        """First transmissions of messages ``n`` .. ``n + count - 1``, each in a
        packet of ``size`` bytes but the last (``last_size``), at ``now``:
        ``on_sent`` for each, kept as one span."""
        tx = self._tx_next
        self._spans.append([n, n + count, tx, size, last_size, now])
        self._tx_next = tx + count
        self.bytes_in_flight += size * (count - 1) + last_size

    def _take_spans(self, lo: int, hi: int, maxtx: int, prev: int) -> tuple[int, int, float]:
        """Take packets ``lo`` .. ``hi - 1`` out of the spans (delivered);
        return their bytes, the highest transmission id credited (at least
        ``maxtx``) and its send time (-1.0: not from these).  ``prev``: the
        highest id delivered before this ACK (an older one now: reordering)."""
        spans = self._spans
        nbytes = 0
        maxts = -1.0
        i = 0
        while i < len(spans):
            n0, n1, tx0, size, last_size, t = spans[i]
            if n1 <= lo:
                i += 1
                continue
            if n0 >= hi:
                break
            a = n0 if n0 > lo else lo
            b = n1 if n1 < hi else hi
            nbytes += (b - a) * size + (last_size - size if b == n1 else 0)
            top = tx0 + (b - 1 - n0)
            if top > maxtx:
                maxtx, maxts = top, t
            if tx0 + (a - n0) < prev:
                self.reordering_seen = True
            pieces = []
            if a > n0:
                pieces.append([n0, a, tx0, size, size, t])
            if b < n1:
                pieces.append([b, n1, tx0 + (b - n0), size, last_size, t])
            spans[i:i + 1] = pieces
            i += len(pieces)
        return nbytes, maxtx, maxts

    def _retx_credit(self, info: tuple[int, int, int, float], now: float) -> int:
        """The id a delivered retransmission (``info``) credits, or -1.  RFC
        8985 §6.2 step 2: delivered sooner than the minimum RTT after it
        left, it was the original that arrived, and the retransmission was
        spurious: the path reorders more than the window allowed, which
        grows, once per round trip (the RFC's answer to a DSACK)."""
        rtt = self.rtt
        if rtt.srtt_s is None:
            return -1
        if now - info[3] >= rtt.min_s:
            return info[0]
        self.spurious += 1
        self.reordering_seen = True
        if self.max_delivered_tx >= self._reo_round_tx:
            self._reo_round_tx = self._tx_next
            if self.reo_mult < 64:
                self.reo_mult += 1
        self._reo_persist = 16
        return -1

    def start_episode(self, point: int) -> None:
        """A recovery episode starts: it lasts while ``una`` < ``point`` (RFC
        6675's RecoveryPoint).  16 episodes without a spurious retransmission
        bring the reordering window back to its base (RFC 8985 §6.2)."""
        self.recovery_point = point
        if self._reo_persist:
            self._reo_persist -= 1
            if not self._reo_persist:
                self.reo_mult = 1

    def on_ack(self, cum: int, sacks: list[tuple[int, int]], now: float = 0.0) -> tuple[int, int]:
        """Apply a cumulative ACK (all n < ``cum``) and SACK ranges [start, end)
        that arrived at ``now``.

        The caller has checked ``una <= cum <= next unsent`` and clipped the
        SACK ranges to the sent range.  Returns ``(acked_bytes, lost_bytes)``:
        bytes newly acknowledged and bytes newly declared lost.
        """
        inflight = self.inflight
        order = self._order
        if cum == self.una + 1 and not sacks and len(order) == 1 and not self._spans and not self._runs:
            # One packet in flight, and this ACK covers it: every ACK of a
            # ping-pong.  What the general path below does then, without
            # its calls and loops (a latency hop's receiving pass waits on
            # them): the packet leaves the table, its payload goes, and the
            # loss walk finds nothing (only that packet's entry was in order).
            tx, n = order[0]
            info = inflight.get(n)
            if n == cum - 1 and info is not None and info[0] == tx and len(self._sack_from_start) <= 64:
                del inflight[n]
                del self.messages[n]
                order.clear()
                self.una = cum
                self.bytes_in_flight -= info[1]
                c = info[2] if info[2] >= 0 else self._retx_credit(info, now)
                if c > self.max_delivered_tx:
                    self.max_delivered_tx = c
                    self.rack_rtt = now - info[3]
                self.reorder_deadline = None
                return info[1], 0
        acked = 0
        prev = maxtx = self.max_delivered_tx
        maxts = -1.0
        if cum > self.una:
            acked, maxtx, maxts = self._ack_cumulative(cum, maxtx, now)
        if sacks:
            nbytes, top, ts = self._ack_sacks(cum, sacks, maxtx, now)
            acked += nbytes
            if top > maxtx:
                maxtx, maxts = top, ts
        if len(self._sack_from_start) > 64:  # forget blocks wholly below the cumulative ACK
            self._sack_from_start = {k: v for k, v in self._sack_from_start.items() if v > cum}
            self._sack_from_end = {k: v for k, v in self._sack_from_end.items() if k > cum}
        self.bytes_in_flight -= acked
        if maxtx > prev:
            self.max_delivered_tx = maxtx
            self.rack_rtt = now - maxts  # RACK.rtt: the latest-sent delivered packet's round trip
        return acked, self._detect(now)

    def detect_lost(self, now: float) -> int:
        """The reorder timer expired (``reorder_deadline``): declare what the
        time rule now finds lost.  Returns the bytes."""
        return self._detect(now)

    def _reo_wnd(self) -> float:
        """RACK's reordering window now (RFC 8985 §6.2)."""
        if not self.reordering_seen and (self.una < self.recovery_point or len(self.sacked) >= self.reorder_threshold):
            return 0.0
        rtt = self.rtt
        w = rtt.min_s * self.reo_mult * 0.25
        srtt = rtt.srtt_s
        return w if srtt is None or w < srtt else srtt

    def _detect(self, now: float) -> int:
        """RACK over single packets and spans merged in transmission order:
        declare lost, oldest first, every packet sent before the latest-sent
        delivered one and past the packet threshold (until reordering is
        seen) or the time rule.  Returns the bytes; sets ``reorder_deadline``."""
        maxtx = self.max_delivered_tx
        threshold = -1 if self.reordering_seen else maxtx - self.reorder_threshold
        wait: float | None = None  # RACK.rtt + reo_wnd: how long after its send a packet is lost by time
        self.reorder_deadline = None
        inflight = self.inflight
        order = self._order
        spans = self._spans
        lost = self.lost
        lost_bytes = 0
        while True:
            while order:
                tx, n = order[0]
                info = inflight.get(n)
                if info is None or info[0] != tx:
                    order.popleft()  # acknowledged or re-sent since: stale
                    continue
                break
            if order and (not spans or order[0][0] < spans[0][2]):
                tx, n = order[0]
                if tx > threshold:
                    if tx >= maxtx:
                        break
                    if wait is None:
                        wait = self._wait()
                    t = inflight[n][3] + wait
                    if t > now:
                        if t < INF:
                            self.reorder_deadline = t
                        break
                order.popleft()
                lost_bytes += inflight.pop(n)[1]
                lost.append(n)
                continue
            if not spans:
                break
            n0, n1, tx0, size, last_size, t = s = spans[0]
            if tx0 > threshold:
                if tx0 >= maxtx:
                    break
                if wait is None:
                    wait = self._wait()
                t += wait
                if t > now:
                    if t < INF:
                        self.reorder_deadline = t
                    break
                k = maxtx - tx0  # the span's packets sent before the delivered one
            else:
                k = threshold - tx0 + 1
            if k >= n1 - n0:
                k = n1 - n0
                lost_bytes += (k - 1) * size + last_size
                del spans[0]
            else:
                lost_bytes += k * size
                s[0], s[2] = n0 + k, tx0 + k
            lost.extend(range(n0, n0 + k))
        self.bytes_in_flight -= lost_bytes
        return lost_bytes

    def _wait(self) -> float:
        """RACK's time rule: a packet is lost once ``sent + RACK.rtt +
        reo_wnd <= now``; this is ``RACK.rtt + reo_wnd`` (INF before an RTT
        sample: no time rule)."""
        if self.rtt.srtt_s is None:
            return INF
        return self.rack_rtt + self._reo_wnd()

    def _ack_cumulative(self, cum: int, maxtx: int, now: float) -> tuple[int, int, float]:
        """Messages ``una`` .. ``cum - 1`` are acknowledged: take them out of
        flight and drop their payloads.  Returns their bytes in flight, the
        highest transmission id credited (at least ``maxtx``) and its send
        time (-1.0: none of them)."""
        inflight = self.inflight
        sacked = self.sacked
        spans = self._spans
        acked = 0
        prev = maxtx
        maxts = -1.0
        n = self.una
        while n < cum:
            if spans and spans[0][0] <= n:
                # A span's packets: first transmissions, credited with
                # their own ids, the highest being the last one acked.
                s = spans[0]
                n0, n1, tx0, size, last_size, t = s
                if tx0 < prev:
                    self.reordering_seen = True  # delivered after one sent later
                if n1 <= cum:
                    acked += (n1 - n0 - 1) * size + last_size
                    top = tx0 + n1 - n0 - 1
                    del spans[0]
                    n = n1
                else:
                    acked += (cum - n0) * size
                    top = tx0 + cum - n0 - 1
                    s[0], s[2] = cum, tx0 + cum - n0
                    n = cum
                if top > maxtx:
                    maxtx, maxts = top, t
                continue
            stop = spans[0][0] if spans and spans[0][0] < cum else cum
            for k in range(n, stop):
                info = inflight.pop(k, None)
                if info is not None:
                    acked += info[1]
                    c = info[2] if info[2] >= 0 else self._retx_credit(info, now)
                    if c > maxtx:
                        maxtx, maxts = c, info[3]
                    elif 0 <= c < prev:
                        self.reordering_seen = True
                elif sacked:
                    sacked.discard(k)
            n = stop
        self._drop_payloads(self.una, cum)
        self.una = cum
        return acked, maxtx, maxts

    def _ack_sacks(self, cum: int, sacks: list[tuple[int, int]], maxtx: int, now: float) -> tuple[int, int, float]:
        """Apply SACK ranges [start, end) above ``cum``.  Returns the bytes
        they newly take out of flight, the highest transmission id credited
        (at least ``maxtx``) and its send time (-1.0: none of them)."""
        inflight = self.inflight
        sacked = self.sacked
        spans = self._spans
        acked = 0
        prev = self.max_delivered_tx
        maxts = -1.0
        memo_s = self._sack_from_start
        memo_e = self._sack_from_end
        for start, end in sacks:
            # SACK blocks repeat across ACKs (RFC 2018 §4); walk only the
            # part of this block no earlier block with the same start or end
            # covered, so a repeated block costs O(1).
            lo = memo_s.get(start, start)
            hi = memo_e.get(end, end)
            memo_s[start] = end
            memo_e[end] = start
            if lo < cum:
                lo = cum
            if lo >= hi:
                continue
            for n in range(lo, hi):
                # Also a message already declared lost (so not in flight):
                # SACKed now, it must not be retransmitted.
                sacked.add(n)
                info = inflight.pop(n, None)
                if info is not None:
                    acked += info[1]
                    c = info[2] if info[2] >= 0 else self._retx_credit(info, now)
                    if c > maxtx:
                        maxtx, maxts = c, info[3]
                    elif 0 <= c < prev:
                        self.reordering_seen = True
            if spans:
                nbytes, top, ts = self._take_spans(lo, hi, maxtx, prev)
                acked += nbytes
                if top > maxtx:
                    maxtx, maxts = top, ts
        return acked, maxtx, maxts

    def probe_last(self) -> int:
        """A tail loss probe with no new data to send (RFC 8985 §7.3): the
        most recently sent packet still in flight goes to the front of the
        retransmission queue.  Returns its bytes (0: nothing in flight)."""
        order = self._order
        inflight = self.inflight
        while order:
            tx, n = order[-1]
            info = inflight.get(n)
            if info is None or info[0] != tx:
                order.pop()  # stale
                continue
            break
        spans = self._spans
        if spans and (not order or spans[-1][2] + spans[-1][1] - spans[-1][0] > order[-1][0]):
            s = spans[-1]
            n = s[1] - 1
            size = s[4]
            if s[1] - s[0] == 1:
                del spans[-1]
            else:
                s[1], s[4] = n, s[3]
        elif order:
            n = order.pop()[1]
            size = inflight.pop(n)[1]
        else:
            return 0
        self.lost.appendleft(n)
        self.bytes_in_flight -= size
        return size

    def on_rto(self) -> int:
        """Declare everything in flight lost (RFC 6298 §5.4 onwards, with SACK:
        resend every un-SACKed packet).  Returns the number of packets.

        If the oldest unacknowledged message is one the peer reported by
        SACK, its reports are not to be believed (a receiver never SACKs the
        message its cumulative ACK waits for; a forged block does): every
        SACKed message is resent too (RFC 2018 §8, the sender's answer to a
        receiver that reneges)."""
        pending = set(self.inflight)
        for n0, n1, *_ in self._spans:
            pending.update(range(n0, n1))
        sacked = self.sacked
        if self.una in sacked:
            pending.update(sacked)
            sacked.clear()
            self._sack_from_start.clear()
            self._sack_from_end.clear()
        pending.update(n for n in self.lost if n >= self.una and n not in sacked)
        self.lost = deque(sorted(pending))
        self.inflight.clear()
        self._spans.clear()
        self._order.clear()
        self.bytes_in_flight = 0
        self.reorder_deadline = None
        return len(pending)

    def take_flight(self) -> list[tuple[int, int, int, bool, float]]:
        """Hand over what is in flight, for a multi-path link to track per
        path (``paths.py``): ``(n, transmission id, size, retransmission,
        time sent)`` in send order; the table keeps the payloads, ``una``,
        ``sacked`` and ``lost``, and holds nothing in flight afterwards."""
        out = sorted((tx, n, size, credit < 0, t) for n, (tx, size, credit, t) in self.in_flight().items())
        self.inflight.clear()
        self._spans.clear()
        self._order.clear()
        self.reorder_deadline = None
        return [(n, tx, size, retx, t) for tx, n, size, retx, t in out]

    def release(self, cum: int) -> None:
        """Messages below ``cum`` are acknowledged, by a multi-path link that
        tracks what is in flight itself (``paths.py``): drop their payloads."""
        if cum > self.una:
            self._drop_payloads(self.una, cum)
            self.una = cum

    def retransmission_pending(self) -> bool:
        """True if a message declared lost still waits to be resent."""
        una, sacked, inflight = self.una, self.sacked, self.inflight
        return any(n >= una and n not in sacked and n not in inflight for n in self.lost)

    def next_lost(self) -> int | None:
        """Pop the oldest message still needing a retransmission, or None.

        A message in ``lost`` is in no span: it left its span when declared
        lost, and spans hold only first transmissions."""
        lost = self.lost
        while lost:
            n = lost.popleft()
            if n >= self.una and n not in self.sacked and n not in self.inflight:
                return n
        return None
