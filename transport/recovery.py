"""Loss recovery: RTT estimation, the sent-packet table, loss detection, RTO.

Theory of operation
-------------------
Every upper-layer message has a number ``n`` (0, 1, 2, ...; the wire sequence
number is ``isn + n`` modulo 2**32).  :class:`Recovery` keeps the messages the
peer has not cumulatively acknowledged, and for those in flight the
*transmission id* of their latest transmission: a counter that grows with
every packet sent, first sends and retransmissions alike (QUIC's packet
number, RFC 9002 §2, carried only in our memory).  Loss detection is then
QUIC's packet threshold (RFC 9002 §6.1.1): a packet is lost when one sent at
least ``reorder_threshold`` transmissions later has been acknowledged
(cumulatively or by a SACK block, RFC 2018).  Using transmission ids rather
than sequence numbers makes a lost *retransmission* detectable the same way,
without waiting for the RTO.

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
        inflight: n -> (transmission id, size, id credited on delivery or -1)
            for packets in flight sent one by one (``on_sent``);
            :meth:`in_flight` adds the runs'.
        sacked: message numbers above ``una`` the peer reported by SACK.
        lost: message numbers to retransmit, oldest first (may hold stale
            entries; :meth:`next_lost` skips them).
        bytes_in_flight: sum of sizes of the packets in flight.
    """

    __slots__ = ("messages", "una", "inflight", "sacked", "lost", "bytes_in_flight", "_runs", "_spans",
                 "_order", "_tx_next", "_sack_from_start", "_sack_from_end", "max_delivered_tx", "reorder_threshold")

    def __init__(self, reorder_threshold: int = 3) -> None:
        self.messages: dict[int, bytes | bytearray | memoryview] = {}
        # payload runs, by n: [first n not acknowledged, end, buffer, stride,
        # last message's length, the run's first n]
        self._runs: deque[list[Any]] = deque()
        self.una = 0
        self.inflight: dict[int, tuple[int, int, int]] = {}
        # packets in flight sent as runs, by n and so by transmission id:
        # [first n, end, its transmission id, size, the last one's size];
        # never a packet also in ``inflight`` (a retransmission goes there)
        self._spans: list[list[int]] = []
        self.sacked: set[int] = set()
        self.lost: deque[int] = deque()
        self.bytes_in_flight = 0
        self._order: deque[tuple[int, int]] = deque()  # (tx id, n) of ``inflight``, send order
        self._tx_next = 0
        self._sack_from_start: dict[int, int] = {}  # block start -> end already applied
        self._sack_from_end: dict[int, int] = {}  # block end -> start already applied
        self.max_delivered_tx = -1
        self.reorder_threshold = reorder_threshold

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

    def in_flight(self) -> dict[int, tuple[int, int, int]]:
        """n -> (transmission id, size, id credited) of every packet in flight."""
        out = dict(self.inflight)
        for n0, n1, tx0, size, last_size in self._spans:
            for n in range(n0, n1):
                tx = tx0 + n - n0
                out[n] = (tx, last_size if n == n1 - 1 else size, tx)
        return out

    def on_sent(self, n: int, size: int, retransmission: bool = False) -> None:
        """Message ``n`` left in a packet of ``size`` bytes."""
        tx = self._tx_next
        self._tx_next = tx + 1
        # An ACK for a retransmitted message is ambiguous (which copy
        # arrived?  Karn's problem): crediting the newest transmission when a
        # late original arrived would declare everything sent in between lost.
        # So a retransmission's delivery never advances max_delivered_tx.
        self.inflight[n] = (tx, size, -1 if retransmission else tx)
        self._order.append((tx, n))
        self.bytes_in_flight += size

    def on_sent_run(self, n: int, count: int, size: int, last_size: int) -> None:
        """First transmissions of messages ``n`` .. ``n + count - 1``, each in a
        packet of ``size`` bytes but the last (``last_size``): ``on_sent`` for
        each, kept as one span."""
        tx = self._tx_next
        self._spans.append([n, n + count, tx, size, last_size])
        self._tx_next = tx + count
        self.bytes_in_flight += size * (count - 1) + last_size

    def _take_spans(self, lo: int, hi: int) -> tuple[int, int]:
        """Take packets ``lo`` .. ``hi - 1`` out of the spans (delivered);
        return their bytes and the highest transmission id among them (-1: none)."""
        spans = self._spans
        nbytes = 0
        maxtx = -1
        i = 0
        while i < len(spans):
            n0, n1, tx0, size, last_size = spans[i]
            if n1 <= lo:
                i += 1
                continue
            if n0 >= hi:
                break
            a = n0 if n0 > lo else lo
            b = n1 if n1 < hi else hi
            nbytes += (b - a) * size + (last_size - size if b == n1 else 0)
            maxtx = tx0 + (b - 1 - n0)
            pieces = []
            if a > n0:
                pieces.append([n0, a, tx0, size, size])
            if b < n1:
                pieces.append([b, n1, tx0 + (b - n0), size, last_size])
            spans[i:i + 1] = pieces
            i += len(pieces)
        return nbytes, maxtx

    def on_ack(self, cum: int, sacks: list[tuple[int, int]]) -> tuple[int, int]:
        """Apply a cumulative ACK (all n < ``cum``) and SACK ranges [start, end).

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
                if info[2] > self.max_delivered_tx:
                    self.max_delivered_tx = info[2]
                return info[1], 0
        acked = 0
        maxtx = self.max_delivered_tx
        if cum > self.una:
            acked, maxtx = self._ack_cumulative(cum, maxtx)
        if sacks:
            nbytes, maxtx = self._ack_sacks(cum, sacks, maxtx)
            acked += nbytes
        if len(self._sack_from_start) > 64:  # forget blocks wholly below the cumulative ACK
            self._sack_from_start = {k: v for k, v in self._sack_from_start.items() if v > cum}
            self._sack_from_end = {k: v for k, v in self._sack_from_end.items() if k > cum}
        self.bytes_in_flight -= acked
        self.max_delivered_tx = maxtx
        # QUIC packet threshold on transmission ids (RFC 9002 §6.1.1), over
        # single packets and spans merged in transmission order.
        threshold = maxtx - self.reorder_threshold
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
                    break
                order.popleft()
                lost_bytes += inflight.pop(n)[1]
                lost.append(n)
                continue
            if not spans:
                break
            n0, n1, tx0, size, last_size = s = spans[0]
            if tx0 > threshold:
                break
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
        return acked, lost_bytes

    def _ack_cumulative(self, cum: int, maxtx: int) -> tuple[int, int]:
        """Messages ``una`` .. ``cum - 1`` are acknowledged: take them out of
        flight and drop their payloads.  Returns their bytes in flight and
        the highest transmission id credited (at least ``maxtx``)."""
        inflight = self.inflight
        sacked = self.sacked
        spans = self._spans
        acked = 0
        n = self.una
        while n < cum:
            if spans and spans[0][0] <= n:
                # A span's packets: first transmissions, credited with
                # their own ids, the highest being the last one acked.
                s = spans[0]
                n0, n1, tx0, size, last_size = s
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
                    maxtx = top
                continue
            stop = spans[0][0] if spans and spans[0][0] < cum else cum
            for k in range(n, stop):
                info = inflight.pop(k, None)
                if info is not None:
                    acked += info[1]
                    if info[2] > maxtx:
                        maxtx = info[2]
                elif sacked:
                    sacked.discard(k)
            n = stop
        self._drop_payloads(self.una, cum)
        self.una = cum
        return acked, maxtx

    def _ack_sacks(self, cum: int, sacks: list[tuple[int, int]], maxtx: int) -> tuple[int, int]:
        """Apply SACK ranges [start, end) above ``cum``.  Returns the bytes
        they newly take out of flight and the highest transmission id
        credited (at least ``maxtx``)."""
        inflight = self.inflight
        sacked = self.sacked
        spans = self._spans
        acked = 0
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
                    if info[2] > maxtx:
                        maxtx = info[2]
            if spans:
                nbytes, top = self._take_spans(lo, hi)
                acked += nbytes
                if top > maxtx:
                    maxtx = top
        return acked, maxtx

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
        return len(pending)

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
