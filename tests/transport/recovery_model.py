"""The sent-packet table as it was before runs (commit b4607df): one entry per
packet.  Not used by udpverbs: the oracle the run-based
``transport.recovery.Recovery`` is checked against, operation by operation
(``test_recovery_runs.py``).  Its ``messages`` holds every queued message's
payload, and ``inflight`` every packet in flight.
"""

from __future__ import annotations

from collections import deque


class PacketRecovery:
    """The sender's table of unacknowledged messages and its loss detector.

    Attributes:
        messages: n -> payload for every message queued and not cumulatively
            acknowledged (the retransmission buffer).
        una: lowest unacknowledged message number (the link's ``acked``).
        inflight: n -> (transmission id, size, id credited on delivery or -1)
            for packets in flight.
        sacked: message numbers above ``una`` the peer reported by SACK.
        lost: message numbers to retransmit, oldest first (may hold stale
            entries; :meth:`next_lost` skips them).
        bytes_in_flight: sum of sizes in ``inflight``.
    """

    __slots__ = ("messages", "una", "inflight", "sacked", "lost", "bytes_in_flight",
                 "_order", "_tx_next", "_sack_from_start", "_sack_from_end", "max_delivered_tx", "reorder_threshold")

    def __init__(self, reorder_threshold: int = 3) -> None:
        self.messages: dict[int, bytes] = {}
        self.una = 0
        self.inflight: dict[int, tuple[int, int, int]] = {}
        self.sacked: set[int] = set()
        self.lost: deque[int] = deque()
        self.bytes_in_flight = 0
        self._order: deque[tuple[int, int]] = deque()  # (tx id, n), send order
        self._tx_next = 0
        self._sack_from_start: dict[int, int] = {}  # block start -> end already applied
        self._sack_from_end: dict[int, int] = {}  # block end -> start already applied
        self.max_delivered_tx = -1
        self.reorder_threshold = reorder_threshold

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
        packet of ``size`` bytes but the last (``last_size``): ``on_sent`` for each."""
        tx = self._tx_next
        inflight = self.inflight
        order = self._order
        for i in range(count - 1):
            t = tx + i
            inflight[n + i] = (t, size, t)
            order.append((t, n + i))
        t = tx + count - 1
        inflight[n + count - 1] = (t, last_size, t)
        order.append((t, n + count - 1))
        self._tx_next = tx + count
        self.bytes_in_flight += size * (count - 1) + last_size

    def on_ack(self, cum: int, sacks: list[tuple[int, int]]) -> tuple[int, int]:
        """Apply a cumulative ACK (all n < ``cum``) and SACK ranges [start, end).

        The caller has checked ``una <= cum <= next unsent`` and clipped the
        SACK ranges to the sent range.  Returns ``(acked_bytes, lost_bytes)``:
        bytes newly acknowledged and bytes newly declared lost.
        """
        inflight = self.inflight
        messages = self.messages
        sacked = self.sacked
        acked = 0
        maxtx = self.max_delivered_tx
        if cum > self.una:
            for n in range(self.una, cum):
                del messages[n]
                info = inflight.pop(n, None)
                if info is not None:
                    acked += info[1]
                    if info[2] > maxtx:
                        maxtx = info[2]
                elif sacked:
                    sacked.discard(n)
            self.una = cum
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
            for n in range(lo, hi):
                # Also a message already declared lost (so not in flight):
                # SACKed now, it must not be retransmitted.
                sacked.add(n)
                info = inflight.pop(n, None)
                if info is not None:
                    acked += info[1]
                    if info[2] > maxtx:
                        maxtx = info[2]
        if len(memo_s) > 64:
            self._sack_from_start = {k: v for k, v in memo_s.items() if v > cum}
            self._sack_from_end = {k: v for k, v in memo_e.items() if k > cum}
        self.bytes_in_flight -= acked
        self.max_delivered_tx = maxtx
        # QUIC packet threshold on transmission ids (RFC 9002 §6.1.1).
        threshold = maxtx - self.reorder_threshold
        order = self._order
        lost_bytes = 0
        while order:
            tx, n = order[0]
            info = inflight.get(n)
            if info is None or info[0] != tx:
                order.popleft()  # acknowledged or re-sent since: stale
                continue
            if tx > threshold:
                break
            order.popleft()
            del inflight[n]
            lost_bytes += info[1]
            self.lost.append(n)
        self.bytes_in_flight -= lost_bytes
        return acked, lost_bytes

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
        return len(pending)

    def next_lost(self) -> int | None:
        """Pop the oldest message still needing a retransmission, or None."""
        lost = self.lost
        while lost:
            n = lost.popleft()
            if n >= self.una and n not in self.sacked and n not in self.inflight:
                return n
        return None
