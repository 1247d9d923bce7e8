"""A fixed window: no congestion control at all (the baseline).

``window_packets`` packets may be in flight whatever happens; losses and
timeouts change nothing.  Optionally paced at ``window / srtt`` so a fixed
window does not leave in one burst.
"""

from __future__ import annotations

from .base import INF, CongestionController, register


@register("fixed")
class FixedWindow(CongestionController):
    """Constant ``cwnd_bytes = window_packets * mss``."""

    def __init__(self, mss: int, *, window_packets: float = 64, paced: bool = False) -> None:
        super().__init__(mss)
        self.cwnd_bytes = window_packets * mss
        self.paced = paced

    def on_packets_acked(self, acked_bytes: int, rtt_s: float | None, now: float, limited: bool = True) -> None:
        pass  # a fixed window ignores feedback by definition

    def on_packets_lost(self, lost_bytes: int, now: float, episode: bool = True) -> None:
        pass

    def on_rto(self, now: float) -> None:
        pass

    def pacing_rate_Bps(self, srtt_s: float | None) -> float:
        if not self.paced or not srtt_s:
            return INF
        return self.cwnd_bytes / srtt_s
