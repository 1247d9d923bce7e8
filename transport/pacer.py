"""A pacer: spreads a window over the RTT instead of sending it in one burst.

Theory of operation
-------------------
The congestion controller names a rate (``cwnd / rtt * gain``); the pacer
turns it into a release time.  It keeps one number, ``next_send_s``, the
earliest time the next packet may leave; sending ``size`` bytes pushes it
``size / rate`` later.  Idle time accrues credit, but at most
``burst_bytes`` worth, so a flow that was quiet may send a short burst and no
more (a token bucket, written as a virtual clock).  Bursts matter here: an
unpaced sender on loopback lost 3-40% of its datagrams to receive-buffer
overflow (``docs/DESIGN.md``, "Facts measured"), and on a shared bottleneck a window sent at
once is a queue.

A sender that only acts now and then also needs the credit of the time in
between: ``burst_s`` lets the credit reach ``burst_s`` worth at the current
rate when that is more than ``burst_bytes``.  The daemon acts once per pass
of its loop, and a loaded pass lasts a good part of a millisecond; Linux TCP
likewise sizes a burst to about 1 ms at the pacing rate (``sk_pacing_shift``
10).  A cap in packets alone caps the rate: 32 packets of 1,472 B per
300 µs pass is at most 157 MB/s, whatever the window.
"""

from __future__ import annotations

INF = float("inf")


class Pacer:
    """Virtual-clock token bucket.

    Args:
        burst_bytes: the credit an idle sender may accumulate...
        burst_s: ...or this much time's worth at the current rate, if more.
    """

    __slots__ = ("rate_Bps", "next_send_s", "burst_bytes", "burst_s")

    def __init__(self, burst_bytes: float, burst_s: float = 0.0) -> None:
        self.rate_Bps = INF
        self.next_send_s = -INF
        self.burst_bytes = burst_bytes
        self.burst_s = burst_s

    def floor(self, now: float) -> float:
        """The earliest ``next_send_s`` idle time can earn by ``now`` (the
        credit cap); the rate must be finite."""
        credit_s = self.burst_bytes / self.rate_Bps
        return now - (credit_s if credit_s > self.burst_s else self.burst_s)

    def can_send(self, now: float) -> bool:
        """True if a packet may leave at ``now``."""
        return now >= self.next_send_s

    def on_sent(self, size: int, now: float) -> None:
        """Account ``size`` bytes sent at ``now``."""
        rate = self.rate_Bps
        if rate == INF:
            return
        # credit for idle time, capped: floor(now), written out (every packet's path)
        credit_s = self.burst_bytes / rate
        floor = now - (credit_s if credit_s > self.burst_s else self.burst_s)
        t = self.next_send_s
        self.next_send_s = (t if t > floor else floor) + size / rate
