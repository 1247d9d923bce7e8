"""Loss-based AIMD, Reno-like (RFC 5681 with SACK-based recovery, RFC 6675).

Slow start doubles the window per RTT until the first loss or ``ssthresh``;
congestion avoidance adds one MSS per RTT; a loss halves the window at most
once per RTT (one "recovery episode"); a retransmission timeout collapses it
to one MSS and restarts slow start (RFC 5681 §3.1).  Paced like Linux's
TCP pacing: twice the window per RTT in slow start, 1.2x afterwards, so the
comparison with EFE measures the control law, not burstiness.
"""

from __future__ import annotations

from .base import INF, CongestionController, register


@register("aimd")
class Aimd(CongestionController):
    """Reno-style additive increase, multiplicative decrease on loss."""

    def __init__(self, mss: int, *, initial_window_packets: float = 10, beta: float = 0.5,
                 min_window_packets: float = 1) -> None:
        super().__init__(mss)
        self.cwnd_bytes = initial_window_packets * mss
        self.ssthresh = INF
        self.beta = beta
        self.min_cwnd = min_window_packets * mss
        self._recovery_until = -INF
        self._rtt_s = 0.0

    def on_packets_acked(self, acked_bytes: int, rtt_s: float | None, now: float, limited: bool = True) -> None:
        if rtt_s is not None:
            self._rtt_s = rtt_s
        if not limited:
            return
        if self.cwnd_bytes < self.ssthresh:
            self.cwnd_bytes += acked_bytes  # slow start: +1 MSS per MSS acked
        else:
            self.cwnd_bytes += self.mss * acked_bytes / self.cwnd_bytes  # +1 MSS per RTT

    def on_packets_lost(self, lost_bytes: int, now: float, episode: bool = True) -> None:
        if not episode or now < self._recovery_until:
            return  # RFC 6675: one window reduction per loss episode (and per RTT)
        self._recovery_until = now + self._rtt_s
        self.cwnd_bytes = max(self.min_cwnd, self.cwnd_bytes * self.beta)
        self.ssthresh = self.cwnd_bytes

    def on_rto(self, now: float) -> None:
        self.ssthresh = max(self.min_cwnd, self.cwnd_bytes * self.beta)
        self.cwnd_bytes = self.min_cwnd  # RFC 5681 §3.1: loss window = 1 MSS
        self._recovery_until = now + self._rtt_s

    def pacing_rate_Bps(self, srtt_s: float | None) -> float:
        if not srtt_s:
            return INF
        gain = 2.0 if self.cwnd_bytes < self.ssthresh else 1.2
        return gain * self.cwnd_bytes / srtt_s
