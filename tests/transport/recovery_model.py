"""The sent-packet table with one entry per packet.  Not used by udpverbs:
the oracle the run-based ``transport.recovery.Recovery`` is checked
against, operation by operation (``test_recovery_runs.py``).  Its
``messages`` holds every queued message's payload, and ``inflight`` every
packet in flight.  Loss detection is the same rule (RACK, RFC 8985, with
the packet threshold until reordering is seen) written packet by packet.
"""

from __future__ import annotations

from collections import deque

from udpverbs.transport.recovery import RttEstimator

INF = float("inf")


class PacketRecovery:
    """The sender's table of unacknowledged messages and its loss detector.

    Attributes:
        messages: n -> payload for every message queued and not cumulatively
            acknowledged (the retransmission buffer).
        una: lowest unacknowledged message number (the link's ``acked``).
        inflight: n -> (transmission id, size, id credited on delivery or -1,
            time sent) for packets in flight.
        sacked: message numbers above ``una`` the peer reported by SACK.
        lost: message numbers to retransmit, oldest first (may hold stale
            entries; :meth:`next_lost` skips them).
        bytes_in_flight: sum of sizes in ``inflight``.
    """

    __slots__ = ("messages", "una", "inflight", "sacked", "lost", "bytes_in_flight",
                 "_order", "_tx_next", "_sack_from_start", "_sack_from_end", "max_delivered_tx", "reorder_threshold",
                 "rtt", "rack_rtt", "reordering_seen", "reo_mult", "_reo_persist", "_reo_round_tx", "recovery_point",
                 "reorder_deadline", "spurious")

    def __init__(self, reorder_threshold: int = 3, rtt: RttEstimator | None = None) -> None:
        self.messages: dict[int, bytes] = {}
        self.una = 0
        self.inflight: dict[int, tuple[int, int, int, float]] = {}
        self.sacked: set[int] = set()
        self.lost: deque[int] = deque()
        self.bytes_in_flight = 0
        self._order: deque[tuple[int, int]] = deque()  # (tx id, n), send order
        self._tx_next = 0
        self._sack_from_start: dict[int, int] = {}  # block start -> end already applied
        self._sack_from_end: dict[int, int] = {}  # block end -> start already applied
        self.max_delivered_tx = -1
        self.reorder_threshold = reorder_threshold
        self.rtt = rtt if rtt is not None else RttEstimator(1.0, 0.0, 1.0)
        self.rack_rtt = 0.0
        self.reordering_seen = False
        self.reo_mult = 1
        self._reo_persist = 0
        self._reo_round_tx = -1
        self.recovery_point = 0
        self.reorder_deadline: float | None = None
        self.spurious = 0

    def on_sent(self, n: int, size: int, retransmission: bool = False, now: float = 0.0) -> None:
        """Message ``n`` left in a packet of ``size`` bytes at ``now``."""
        tx = self._tx_next
        self._tx_next = tx + 1
        self.inflight[n] = (tx, size, -1 if retransmission else tx, now)
        self._order.append((tx, n))
        self.bytes_in_flight += size

    def on_sent_run(self, n: int, count: int, size: int, last_size: int, now: float = 0.0) -> None:
        """First transmissions of messages ``n`` .. ``n + count - 1``, each in a
        packet of ``size`` bytes but the last (``last_size``): ``on_sent`` for each."""
        tx = self._tx_next
        inflight = self.inflight
        order = self._order
        for i in range(count - 1):
            t = tx + i
            inflight[n + i] = (t, size, t, now)
            order.append((t, n + i))
        t = tx + count - 1
        inflight[n + count - 1] = (t, last_size, t, now)
        order.append((t, n + count - 1))
        self._tx_next = tx + count
        self.bytes_in_flight += size * (count - 1) + last_size

    def _credit(self, info: tuple[int, int, int, float], now: float) -> int:
        if info[2] >= 0:
            return info[2]
        if self.rtt.srtt_s is None:
            return -1
        if now - info[3] >= self.rtt.min_s:
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
        self.recovery_point = point
        if self._reo_persist:
            self._reo_persist -= 1
            if not self._reo_persist:
                self.reo_mult = 1

    def on_ack(self, cum: int, sacks: list[tuple[int, int]], now: float = 0.0) -> tuple[int, int]:
        """Apply a cumulative ACK (all n < ``cum``) and SACK ranges [start, end).

        The caller has checked ``una <= cum <= next unsent`` and clipped the
        SACK ranges to the sent range.  Returns ``(acked_bytes, lost_bytes)``:
        bytes newly acknowledged and bytes newly declared lost.
        """
        inflight = self.inflight
        messages = self.messages
        sacked = self.sacked
        acked = 0
        prev = maxtx = self.max_delivered_tx
        maxts = 0.0
        delivered = []
        if cum > self.una:
            for n in range(self.una, cum):
                del messages[n]
                info = inflight.pop(n, None)
                if info is not None:
                    delivered.append(info)
                elif sacked:
                    sacked.discard(n)
            self.una = cum
        memo_s = self._sack_from_start
        memo_e = self._sack_from_end
        for start, end in sacks:
            lo = memo_s.get(start, start)
            hi = memo_e.get(end, end)
            memo_s[start] = end
            memo_e[end] = start
            if lo < cum:
                lo = cum
            for n in range(lo, hi):
                sacked.add(n)
                info = inflight.pop(n, None)
                if info is not None:
                    delivered.append(info)
        for info in delivered:
            acked += info[1]
            c = self._credit(info, now)
            if c > maxtx:
                maxtx, maxts = c, info[3]
            elif 0 <= c < prev:
                self.reordering_seen = True
        if len(memo_s) > 64:
            self._sack_from_start = {k: v for k, v in memo_s.items() if v > cum}
            self._sack_from_end = {k: v for k, v in memo_e.items() if k > cum}
        self.bytes_in_flight -= acked
        if maxtx > prev:
            self.max_delivered_tx = maxtx
            self.rack_rtt = now - maxts
        return acked, self.detect_lost(now)

    def detect_lost(self, now: float) -> int:
        maxtx = self.max_delivered_tx
        threshold = -1 if self.reordering_seen else maxtx - self.reorder_threshold
        rtt = self.rtt
        if rtt.srtt_s is None:
            wait = INF
        else:
            if not self.reordering_seen and (self.una < self.recovery_point
                                             or len(self.sacked) >= self.reorder_threshold):
                reo = 0.0
            else:
                reo = min(rtt.min_s * self.reo_mult * 0.25, rtt.srtt_s)
            wait = self.rack_rtt + reo
        self.reorder_deadline = None
        inflight = self.inflight
        order = self._order
        lost_bytes = 0
        while order:
            tx, n = order[0]
            info = inflight.get(n)
            if info is None or info[0] != tx:
                order.popleft()  # acknowledged or re-sent since: stale
                continue
            if tx > threshold:
                if tx >= maxtx:
                    break
                if info[3] + wait > now:
                    if wait < INF:
                        self.reorder_deadline = info[3] + wait
                    break
            order.popleft()
            del inflight[n]
            lost_bytes += info[1]
            self.lost.append(n)
        self.bytes_in_flight -= lost_bytes
        return lost_bytes

    def probe_last(self) -> int:
        if not self.inflight:
            return 0
        n = max(self.inflight, key=lambda k: self.inflight[k][0])
        size = self.inflight.pop(n)[1]
        self.lost.appendleft(n)
        self.bytes_in_flight -= size
        return size

    def on_rto(self) -> int:
        """Declare everything in flight lost (RFC 6298 §5.4 onwards, with SACK:
        resend every un-SACKed packet).  Returns the number of packets."""
        pending = set(self.inflight)
        if self.una in self.sacked:  # the peer's SACK reports are not to be believed: resend them too
            pending.update(self.sacked)
            self.sacked.clear()
            self._sack_from_start.clear()
            self._sack_from_end.clear()
        pending.update(n for n in self.lost if n >= self.una and n not in self.sacked)
        self.lost = deque(sorted(pending))
        self.inflight.clear()
        self._order.clear()
        self.bytes_in_flight = 0
        self.reorder_deadline = None
        return len(pending)

    def next_lost(self) -> int | None:
        """Pop the oldest message still needing a retransmission, or None."""
        lost = self.lost
        while lost:
            n = lost.popleft()
            if n >= self.una and n not in self.sacked and n not in self.inflight:
                return n
        return None
