"""EFE-style delay-based congestion control.

Theory of operation
-------------------
ExpEther's Ether Forwarding Engine (SEEDS.md §1) keeps a lossless fabric by
end-to-end, *delay-based* control: it probes the path, keeps a *predicted*
round-trip time, ramps quickly while the measured RTT matches the
prediction, and backs off as soon as switch queues build.  We have no
published EFE algorithm, so this controller combines that description with
two published delay-based schemes for data centres:

* from **TIMELY** (Mittal et al., SIGCOMM 2015): RTT measured end to end from
  timestamps is a good enough congestion signal in a data centre; below a
  low threshold grow fast, and after several consecutive uncongested RTTs
  use a larger increase step (its "hyperactive increase", our ``mi_gain``
  ramp).  We do not use TIMELY's RTT gradient: with paced senders and a
  drop-tail queue the absolute queueing delay is the steadier signal.
* from **Swift** (Kumar et al., SIGCOMM 2020): a *target delay* instead of a
  threshold pair; additive increase (``ai_packets`` per RTT) while below it;
  a multiplicative decrease proportional to the excess,
  ``cwnd *= 1 - beta * (rtt - target) / rtt``, bounded by ``max_mdf`` and
  applied at most once per RTT; *flow scaling*, a target that grows as the
  window shrinks (``fs_range_s``), so small flows gain on large ones and
  many flows converge to a fair share; and windows below one packet, made
  real by pacing (``cwnd / rtt``), so 64 flows fit a short path without a
  standing queue.

The *predicted RTT* is ``base_rtt + target``, where ``base_rtt`` is the
minimum RTT seen over a sliding window (two buckets of ``base_window_s``, so a
stale minimum, e.g. after a route change, expires within two windows).
Because a well-controlled queue never drains on its own, the controller
*probes* at each bucket rotation: for one RTT it halves its window, so the
queue it contributes drains and a fresh minimum can be sampled (BBR's
ProbeRTT idea); flows that started together probe together.

Modes, per ACK, from the queueing delay ``q = rtt - base_rtt``:

* startup (until the first time ``q`` exceeds the target): window doubles per
  RTT (``+acked``), the fast ramp;
* ``q < target / 2`` ("near the prediction"): ``+mi_gain * acked``, a
  multiplicative ramp that re-fills capacity released by departing flows in a
  few RTTs;
* ``target/2 <= q <= target``: ``+ai_packets`` MSS per RTT;
* ``q > target``: Swift's proportional decrease, once per RTT.

Loss (which should not happen with a buffer of one BDP) cuts by ``max_mdf``
once per RTT; an RTO drops to the minimum window.
"""

from __future__ import annotations

import math

from .base import INF, CongestionController, register


@register("efe")
class Efe(CongestionController):
    """Delay-based controller: fast ramp to a predicted RTT, Swift-like decrease."""

    def __init__(
        self,
        mss: int,
        *,
        initial_window_packets: float = 10,
        target_queue_s: float = 10e-6,
        fs_range_s: float = 20e-6,
        fs_min_packets: float = 0.5,
        fs_max_packets: float = 100.0,
        ai_packets: float = 1.0,
        ai_fraction: float = 0.0,
        mi_gain: float = 0.25,
        beta: float = 0.8,
        max_mdf: float = 0.5,
        min_window_packets: float = 0.05,
        max_window_packets: float = 10000.0,
        probe_rtts: float = 200.0,
        max_probe_interval_s: float = 1.0,
        probe_fraction: float = 0.5,
        pacing_gain: float = 1.25,
    ) -> None:
        super().__init__(mss)
        self.cwnd_bytes = initial_window_packets * mss
        self.target_queue_s = target_queue_s
        self.fs_range_s = fs_range_s
        # Swift's flow scaling: target grows like 1/sqrt(cwnd) between the bounds.
        self._fs_a = 1.0 / math.sqrt(fs_min_packets) - 1.0 / math.sqrt(fs_max_packets)
        self._fs_b = 1.0 / math.sqrt(fs_max_packets)
        self.ai_bytes = ai_packets * mss
        self.ai_fraction = ai_fraction
        self.mi_gain = mi_gain
        self.beta = beta
        self.max_mdf = max_mdf
        self.min_cwnd = min_window_packets * mss
        self.max_cwnd = max_window_packets * mss
        self.probe_rtts = probe_rtts
        self.max_probe_interval_s = max_probe_interval_s
        self.probe_fraction = probe_fraction
        self._next_probe = INF  # set when startup ends
        self.pacing_gain = pacing_gain
        self.startup = True
        self.base_rtt_s = INF  #: min RTT over the filter window: the path without queues
        self._bucket_min = INF  # min of the current bucket
        self._prev_bucket_min = INF
        self._probe_until = -INF
        self._last_decrease = -INF
        self.rtt_s = 0.0  #: latest RTT sample
        self.probes = 0
        self.decreases = 0

    # --- the predicted RTT --------------------------------------------------

    def target_rtt_s(self) -> float:
        """base RTT + target queueing delay (+ flow scaling): the predicted RTT."""
        pk = self.cwnd_bytes / self.mss
        fs = (1.0 / math.sqrt(pk) - self._fs_b) / self._fs_a if pk > 0 else 1.0
        fs = 0.0 if fs < 0.0 else 1.0 if fs > 1.0 else fs
        return self.base_rtt_s + self.target_queue_s + self.fs_range_s * fs

    def _sample(self, rtt_s: float, now: float) -> None:
        if rtt_s < self._bucket_min:
            self._bucket_min = rtt_s
            if rtt_s < self.base_rtt_s:
                self.base_rtt_s = rtt_s
        if now >= self._next_probe and not self.startup:
            self._probe(now, rtt_s)

    def _probe(self, now: float, rtt_s: float) -> None:
        # Rotate the min filter: the older bucket's minimum expires, so a
        # minimum from before a path change is forgotten after two probes,
        # and a base measured over somebody's queue gets corrected.
        self._prev_bucket_min = self._bucket_min
        self._bucket_min = INF
        self.base_rtt_s = self._prev_bucket_min
        # Shrink for two RTTs so the queue we contribute drains and the new
        # bucket sees (close to) the empty-queue RTT.  A flow that owns most
        # of the queue, the one whose inflated base would starve the others,
        # is exactly the one whose probe empties it.
        self.probes += 1
        self.cwnd_bytes = max(self.min_cwnd, self.cwnd_bytes * self.probe_fraction)
        self._probe_until = now + 2 * rtt_s
        self._next_probe = now + min(self.probe_rtts * self.base_rtt_s, self.max_probe_interval_s)

    # --- controller callbacks -----------------------------------------------

    def on_packets_acked(self, acked_bytes: int, rtt_s: float | None, now: float) -> None:
        if rtt_s is not None and rtt_s > 0.0:
            self.rtt_s = rtt_s
            self._sample(rtt_s, now)
        rtt = self.rtt_s
        if rtt <= 0.0 or self.base_rtt_s == INF:
            return
        if now < self._probe_until:
            return  # hold the probe window
        # After a probe the window is not restored at once (that would be a
        # burst into the queue we just drained): the empty queue puts us in
        # the multiplicative ramp, which regains it in a few RTTs.
        cwnd = self.cwnd_bytes
        target = self.target_rtt_s()
        if rtt > target:
            if self.startup:
                self._leave_startup(now)
            if now - self._last_decrease >= rtt:
                # Swift: decrease in proportion to the excess delay, once per RTT.
                mdf = self.beta * (rtt - target) / rtt
                if mdf > self.max_mdf:
                    mdf = self.max_mdf
                cwnd *= 1.0 - mdf
                self._last_decrease = now
                self.decreases += 1
        elif self.startup:
            cwnd += acked_bytes  # fast ramp: x2 per RTT while on prediction
        elif rtt - self.base_rtt_s < 0.5 * (target - self.base_rtt_s):
            cwnd += self.mi_gain * acked_bytes
        elif cwnd >= self.mss:
            # +ai packets +ai_fraction of the window per RTT.  The fixed part
            # is what makes AIMD converge to fairness; keeping it small and
            # adding a part proportional to the window keeps the *aggregate*
            # increase of N flows per RTT near ai_fraction x BDP instead of
            # N x ai, so 64 flows do not overrun the target queue.
            cwnd += (self.ai_bytes + self.ai_fraction * cwnd) * acked_bytes / cwnd
        else:
            # Swift for sub-packet windows: the increase per RTT shrinks with
            # the window (+ai x cwnd/mss), as the ACKs per RTT do.
            cwnd += self.ai_bytes * acked_bytes / self.mss
        if cwnd < self.min_cwnd:
            cwnd = self.min_cwnd
        elif cwnd > self.max_cwnd:
            cwnd = self.max_cwnd
        self.cwnd_bytes = cwnd

    def _leave_startup(self, now: float) -> None:
        self.startup = False
        if self.base_rtt_s < INF:
            self._next_probe = now + min(self.probe_rtts * self.base_rtt_s, self.max_probe_interval_s)

    def on_packets_lost(self, lost_bytes: int, now: float) -> None:
        if self.startup:
            self._leave_startup(now)
        if now - self._last_decrease >= self.rtt_s:
            self.cwnd_bytes = max(self.min_cwnd, self.cwnd_bytes * (1.0 - self.max_mdf))
            self._last_decrease = now

    def on_rto(self, now: float) -> None:
        if self.startup:
            self._leave_startup(now)
        self.cwnd_bytes = self.min_cwnd
        self._last_decrease = now

    def pacing_rate_Bps(self, srtt_s: float | None) -> float:
        rtt = self.rtt_s or srtt_s
        if not rtt:
            return INF
        gain = 2.0 if self.startup else self.pacing_gain
        if self.cwnd_bytes < self.mss:
            gain = 1.0  # Swift: a sub-packet window is exactly a rate
        return gain * self.cwnd_bytes / rtt
